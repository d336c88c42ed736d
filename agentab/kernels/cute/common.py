"""Compile helpers shared by the CuTe DSL kernels."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

PDL_ENV = "AGENTAB_KERNELS_PDL"
PDL_MODES = ("end", "early")


def pdl_mode() -> str:
    """Where each kernel lets its PDL dependent launch: "end" (after its last store) or
    "early" (right after its own griddepcontrol.wait).

    With "end" the dependent grid starts only as this one drains, so its pre-wait weight loads
    overlap nothing but the final memory flush. With "early" the dependent's CTAs take SM slots
    as this grid's CTAs retire and issue their constant (weight) loads under its tail. Safe
    because every kernel reads and writes activations only after its own wait, and a grid
    completes only after its wait returned (so completion stays transitive along the chain).
    Read at trace time: compile caches must key on it.
    """
    raw = os.environ.get(PDL_ENV, "end").strip() or "end"
    if raw not in PDL_MODES:
        raise ValueError(f"${PDL_ENV}: {raw!r} is not one of {', '.join(PDL_MODES)}")
    return raw


# Hopper's shared-memory capacities per SM (KB); the rest of the 256 KB is L1.
SMEM_CONFIGS_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)


def carveout_for(smem_per_sm: int) -> int:
    """The carveout hint (percent of 228 KB) that selects the smallest shared-memory
    configuration holding `smem_per_sm` bytes, whether the driver rounds the hint up or to the
    nearest configuration (the percentage is rounded down from the configuration's own)."""
    for kb in SMEM_CONFIGS_KB:
        if kb * 1024 >= smem_per_sm:
            return int(100 * kb / 228)
    raise ValueError(f"{smem_per_sm} bytes of shared memory per SM: more than 228 KB")


def fake(dtype: Any, shape: tuple[int, ...]) -> Any:
    """A fake row-major tensor of a static shape, 16-byte aligned (what 128-bit loads need)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)


def compile_tvm_ffi(host: Callable[..., Any], *args: Any) -> Any:
    """Compile `host` for the given fake tensors with TVM-FFI and the caller's (torch) stream."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(host, *args, stream, options="--enable-tvm-ffi")


def ptx_of(compiled: Any) -> str | None:
    """The PTX of a compiled kernel when CUTE_DSL_KEEP includes ptx (else None)."""
    return getattr(compiled, "__ptx__", None)

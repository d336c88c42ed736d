"""Compile helpers shared by the CuTe DSL kernels."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# The kernels are compiled ahead of their first launch with fake tensors, on machines without a
# GPU too (the CPU compile tests, CI): CuTe DSL then needs the target named, since it cannot ask
# a device. A value set by the caller wins; on an H200 it names the same target.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


OPTIONS = "--enable-tvm-ffi"

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


def compile_tvm_ffi(host: Callable[..., Any], *args: Any, key: Any = None) -> Any:
    """Compile `host` for the given fake tensors with TVM-FFI and the caller's (torch) stream.

    `key`: what `host` was built from (its spec dataclasses), beyond the arguments' shapes and
    this package's source; given, the compiled kernel is kept in the disk cache (`cute.cache`)
    and later processes load it instead of compiling. Without it every call compiles."""
    from agentab.kernels.cute.cache import compile_cached

    def compile_now() -> Any:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(host, *args, stream, options=OPTIONS)

    return compile_cached(compile_now, host, args, key, OPTIONS)

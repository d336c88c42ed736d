"""Every CuTe DSL kernel of the specialized path compiles for sm_90a on a CPU machine.

Marked `gpu`: it needs the gpu extra (nvidia-cutlass-dsl), not a GPU. CI installs the extra so an
API break in CuTe DSL shows up there. The PTX is checked for what the design relies on: 128-bit
weight loads, the PDL wait, and no local-memory spills.
"""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_DSL_KEEP"] = "ptx"


def _ops(ptx: str | None) -> set[str]:
    assert ptx, "no PTX kept"
    return set(re.findall(r"\b(ld\.global\.v4\.b32|griddepcontrol\.wait|ld\.local|st\.local)", ptx))


@pytest.fixture(scope="module")
def k2():
    from agentab.kernels.config import PRESETS

    return PRESETS["k2-tp8-shard"]


@pytest.mark.parametrize("batch", [1, 4])
def test_gemv_kernels_compile_with_wide_loads(k2, batch: int) -> None:
    from agentab.kernels.cute.gemv import compile_gemv
    from agentab.kernels.specialized import gemv_specs

    for name, spec in gemv_specs(k2, batch).items():
        ops = _ops(compile_gemv(spec).__ptx__)
        assert {"ld.global.v4.b32", "griddepcontrol.wait"} <= ops, name
        assert not ops & {"ld.local", "st.local"}, f"{name} spills to local memory"


def test_mla_prep_compiles_alone_and_fused_into_the_absorb_gemv(k2) -> None:
    from agentab.kernels.cute.gemv import compile_gemv
    from agentab.kernels.cute.mla_prep import PrepSpec, compile_prep
    from agentab.kernels.specialized import gemv_specs

    pspec = PrepSpec.from_config(k2, 2, 513, 513)
    assert "griddepcontrol.wait" in _ops(compile_prep(pspec).__ptx__)
    fused = compile_gemv(gemv_specs(k2, 2)["absorb"], pspec)
    ops = _ops(fused.__ptx__)
    assert {"ld.global.v4.b32", "griddepcontrol.wait"} <= ops
    assert not ops & {"ld.local", "st.local"}


def test_moe_kernels_compile(k2) -> None:
    from agentab.kernels.cute.moe import MoeSpec, compile_moe

    up, down = compile_moe(MoeSpec.from_config(k2))
    for f in (up, down):
        ops = _ops(f.__ptx__)
        assert {"ld.global.v4.b32", "griddepcontrol.wait"} <= ops


def test_gemv_plan_fills_the_gpu() -> None:
    from agentab.kernels.cute.gemv import GemvSpec, plan

    rw, ksplit, unroll = plan(GemvSpec(n=384, k=7168, m=1, x_cols=7168, out_cols=384))
    assert (rw, ksplit, unroll) == (1, 4, 1)  # 384 CTAs of 4 warps, each warp 7 of 28 chunks
    rw, ksplit, unroll = plan(GemvSpec(n=2112, k=7168, m=1, x_cols=7168, out_cols=2112))
    assert 2112 // (rw * unroll) >= 264 and ksplit == 4

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


def test_mla_prep_compiles_fused_into_the_absorb_gemv(k2) -> None:
    from agentab.kernels.cute.gemv import compile_gemv
    from agentab.kernels.cute.mla_prep import PrepSpec
    from agentab.kernels.specialized import gemv_specs

    pspec = PrepSpec.from_config(k2, 2, 513, 513)
    fused = compile_gemv(gemv_specs(k2, 2)["absorb"], pspec)
    ops = _ops(fused.__ptx__)
    assert {"ld.global.v4.b32", "griddepcontrol.wait"} <= ops
    assert not ops & {"ld.local", "st.local"}


def test_mla_prep_writes_a_paged_cache_through_its_slot_row(k2) -> None:
    """The serving engine's variant: positions and slots in a (2, batch) tensor, the cache as
    (slots, width); fused into the absorb GEMV it stores bf16 entries and keeps 128-bit loads."""
    from agentab.kernels.cute.gemv import compile_gemv
    from agentab.kernels.cute.mla_prep import PrepSpec
    from agentab.kernels.specialized import gemv_specs

    pspec = PrepSpec.from_config(k2, 1, 16 * 4096, 8193, paged=True)
    assert pspec.cache_shape() == (16 * 4096, 576) and pspec.positions_shape() == (2, 1)
    absorb = gemv_specs(k2, 1)["absorb"]
    fused = compile_gemv(absorb, pspec).__ptx__
    contiguous = compile_gemv(absorb, PrepSpec.from_config(k2, 1, 4097, 8193)).__ptx__
    assert {"ld.global.v4.b32", "griddepcontrol.wait"} <= _ops(fused) and "st.global" in fused
    assert not _ops(fused) & {"ld.local", "st.local"}
    assert fused != contiguous


def _before_wait(ptx: str, op: str) -> int:
    return ptx[: ptx.index("griddepcontrol.wait")].count(op)


def test_simt_moe_kernels_compile(k2) -> None:
    """Batch 1..4: the SIMT moe_up (gamma staged before the PDL wait, 128-bit loads, the
    one-warp work list for small batches) and moe_down."""
    from agentab.kernels.cute.moe import compile_moe
    from agentab.kernels.cute.moe_routing import MoeSpec

    up, down = compile_moe(MoeSpec.from_config(k2), tensor_cores=False)
    for f in (up, down):
        ops = _ops(f.__ptx__)
        assert {"ld.global.v4.b32", "griddepcontrol.wait"} <= ops
        assert not ops & {"ld.local", "st.local"}
    # the norm weight (a constant) is the one global load moe_up issues before the wait
    assert _before_wait(up.__ptx__, "ld.global") == 1
    # `_list_small`: three rounds of 32 index shuffles (expert ids, head flags, ids again)
    assert up.__ptx__.count("shfl.sync.idx") >= 96
    # weights through L1 in both SIMT kernels
    assert "L1::no_allocate" not in up.__ptx__ + down.__ptx__


def test_moe_up_on_the_tensor_cores(k2) -> None:
    from agentab.kernels.cute.moe import compile_moe
    from agentab.kernels.cute.moe_routing import MoeSpec

    up, down = compile_moe(MoeSpec.from_config(k2), tensor_cores=True)
    ptx = up.__ptx__
    # 28 steps of 32 columns per warp, two m16n8k16 per step; per step one 16-byte load of the
    # gate row, of the up row (both past L1) and of the token
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 56
    assert ptx.count("ld.global.L1::no_allocate.v4") == 56
    assert ptx.count("ld.global.v4.b32") == 28
    assert _before_wait(ptx, "ld.global") == 0  # the normalized tokens need no gamma
    assert not _ops(ptx) & {"ld.local", "st.local"}
    assert "griddepcontrol.wait" in _ops(down.__ptx__)


def test_compile_all_builds_every_kernel_the_path_launches(k2) -> None:
    """The path's own entry point: batch 1..4 gets the six GEMVs (absorb with the fused MLA
    preparation) and the SIMT MoE pair; batch 5..64 only the tensor-core MoE pair."""
    from agentab.kernels.specialized import compile_all

    small = compile_all(k2, 3, 1025, 1025, paged=True)
    assert set(small) == {"moe_spec", "prenorm", "moe", "qkv_a", "q_b", "absorb", "uv",
                          "o_proj", "router"}  # fmt: skip
    assert small["prenorm"] is False
    large = compile_all(k2, 5, 1025, 1025)
    assert set(large) == {"moe_spec", "prenorm", "moe"} and large["prenorm"] is True
    kernels = [small[n][1] for n in ("qkv_a", "q_b", "absorb", "uv", "o_proj", "router")]
    kernels += [*small["moe"], *large["moe"]]
    for f in kernels:
        assert "griddepcontrol.launch_dependents" in f.__ptx__
        assert not _ops(f.__ptx__) & {"ld.local", "st.local"}


def test_gemv_plan_fills_the_gpu() -> None:
    from agentab.kernels.cute.gemv import GemvSpec, plan

    rw, ksplit, unroll = plan(GemvSpec(n=384, k=7168, m=1, x_cols=7168, out_cols=384))
    assert (rw, ksplit, unroll) == (1, 4, 1)  # 384 CTAs of 4 warps, each warp 7 of 28 chunks
    rw, ksplit, unroll = plan(GemvSpec(n=2112, k=7168, m=1, x_cols=7168, out_cols=2112))
    assert 2112 // (rw * unroll) >= 264 and ksplit == 4

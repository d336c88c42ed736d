"""The research kernels under benchmarks/kernels/research compile for sm_90a on a CPU machine.

They are not part of the decode path; compiling them here keeps them runnable for the
measurements benchmarks/kernels/NOTES.md describes. Marked `gpu` like the production compile
tests: it needs the gpu extra (nvidia-cutlass-dsl), not a GPU.
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


def _before_wait(ptx: str, op: str) -> int:
    return ptx[: ptx.index("griddepcontrol.wait")].count(op)


@pytest.fixture(scope="module")
def k2():
    from agentab.kernels.config import PRESETS

    return PRESETS["k2-tp8-shard"]


# The GEMVs that the cp.async-ring variant streams (qkv_a, q_b and o_proj at batch 1-4).
STREAMED = ("qkv_a", "q_b", "o_proj")


def test_the_stand_alone_mla_prep_compiles_for_both_cache_layouts(k2) -> None:
    from agentab.kernels.cute.mla_prep import PrepSpec
    from benchmarks.kernels.research.cute.mla_prep_alone import compile_prep

    contiguous = compile_prep(PrepSpec.from_config(k2, 1, 4097, 8193)).__ptx__
    paged = compile_prep(PrepSpec.from_config(k2, 1, 16 * 4096, 8193, paged=True)).__ptx__
    for ptx in (contiguous, paged):
        assert "griddepcontrol.wait" in _ops(ptx) and "st.global" in ptx
    assert paged != contiguous


@pytest.mark.parametrize("batch", [1, 4])
def test_streaming_gemvs_compile_without_spills(k2, batch: int) -> None:
    from agentab.kernels.specialized import gemv_specs
    from benchmarks.kernels.research.cute.gemv_stream import compile_gemv_stream, stream_plan

    for name, spec in gemv_specs(k2, batch).items():
        if name not in STREAMED:
            continue
        _warps, _rw, stages = stream_plan(spec)
        ptx = compile_gemv_stream(spec).__ptx__
        assert _before_wait(ptx, "cp.async.cg.shared.global") == stages, name
        assert not _ops(ptx) & {"ld.local", "st.local"}, f"{name} spills to local memory"


def test_stream_plans_for_the_k2_shard() -> None:
    from agentab.kernels.config import PRESETS
    from agentab.kernels.specialized import gemv_specs
    from benchmarks.kernels.research.cute.gemv_stream import stream_plan

    plans = {n: stream_plan(s) for n, s in gemv_specs(PRESETS["k2-tp8-shard"], 1).items()}
    # (warps, rows per warp, ring stages): qkv_a 132 CTAs, q_b 256, o_proj 256.
    assert plans["qkv_a"] == (8, 2, 40)
    assert plans["q_b"] == (6, 2, 12)
    assert plans["o_proj"] == (7, 4, 28)
    assert plans["router"] is None and plans["absorb"] is None and plans["uv"] is None


def _chain_phases():
    from benchmarks.kernels.research.cute.stream_chain import Phase

    return (
        Phase(2112, 7168, -1),
        Phase(3072, 1536, 0),
        Phase(4096, 256, 1),
        Phase(2048, 512, 2),
        Phase(7168, 2048, 3),
        Phase(384, 7168, 4),
        Phase(4096, 7168, 4, gate=5),
        Phase(57344, 256, 6),
    )


@pytest.mark.parametrize(
    ("mma", "sync", "dynamic"),
    [(False, "red", False), (True, "red", False), (True, "flags", False), (True, "red", True)],
)
def test_stream_chain_compiles_with_bulk_copies_and_no_spills(
    mma: bool, sync: str, dynamic: bool
) -> None:
    from benchmarks.kernels.research.cute.stream_chain import compile_chain, plan_units

    phases = _chain_phases()
    ptx = compile_chain(
        phases, 132, 7168, stages=12, warps=6, mma=mma, sync=sync, dynamic=dynamic
    ).__ptx__
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") >= 1
    flags = sync == "flags"
    # flags: every output is one 64-bit {value, flag} store, inputs are read as two such words
    flagged = "st.relaxed.gpu.global.b64" in ptx and "ld.relaxed.gpu.global.v2.b64" in ptx
    assert flagged == flags
    # flags: the last CTA out advances the epoch; dynamic units: three claims per phase in code
    assert ptx.count("atom.global") == (1 if flags else 3 * len(phases) if dynamic else 0)
    counters = "red.release.gpu.global.add.s32" in ptx and "ld.acquire.gpu.global.b32" in ptx
    assert counters == (not flags)  # grid barriers by counters, or none with flags
    assert not _ops(ptx) & {"ld.local", "st.local"}
    hmma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    if mma:
        # two MMAs per lane chunk step: (rows / 8 blocks or 1) x chunks per group per row
        steps = 0
        for ph in phases:
            u = plan_units(ph, 16384)
            per_row = 8 // u.rows if u.rows < 8 else 1
            steps += max(1, u.rows // 8) * (ph.k // 8) // (4 * per_row)
        assert hmma == 2 * steps
    else:
        assert hmma == 0


def test_stream_chain_row_sums_by_store_use_shuffles_not_shared_atomics() -> None:
    from benchmarks.kernels.research.cute.stream_chain import compile_chain, plan_units

    phases = _chain_phases()
    kw = dict(stages=12, warps=6, mma=True)
    assert "atom.shared.cta.add.f32" in compile_chain(phases, 132, 7168, **kw).__ptx__
    ptx = compile_chain(phases, 132, 7168, row_sum="store", **kw).__ptx__
    assert "atom.shared" not in ptx
    # rows < 8 share a row among 32 / rows lanes: log2(32 / rows) butterfly steps per phase
    rows = [plan_units(ph, 16384).rows for ph in phases]
    assert ptx.count("shfl.sync.bfly") == sum((32 // r).bit_length() - 1 for r in rows if r < 8)


def test_stream_chain_layers_loop_at_run_time_instead_of_growing_the_code() -> None:
    from benchmarks.kernels.research.cute.stream_chain import build, compile_chain

    phases = _chain_phases()
    kw = dict(stages=12, warps=6, mma=True)
    hmma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    one = compile_chain(phases, 132, 7168, **kw).__ptx__
    three = compile_chain(phases, 132, 7168, layers=3, **kw).__ptx__
    assert three.count(hmma) == one.count(hmma) > 0
    with pytest.raises(ValueError, match="layers > 1: with counters"):
        build(phases, 132, 7168, sync="flags", layers=2)


def test_stream_chain_plans_whole_rows_the_mma_consumer_can_split() -> None:
    from benchmarks.kernels.research.cute.stream_chain import Phase, build, plan_units

    assert [plan_units(p, 16384).rows for p in _chain_phases()] == [1, 4, 32, 16, 4, 1, 1, 32]
    assert plan_units(Phase(3 * 7, 512), 16384).rows == 1  # 3, 7, 21 rows: not splittable
    with pytest.raises(ValueError, match="6 stages: not a multiple of 4 consumer warps"):
        build(_chain_phases(), 132, 7168, stages=6, warps=4)
    with pytest.raises(ValueError, match="not an earlier phase"):
        build((Phase(256, 256, 1),), 132, 256)
    with pytest.raises(ValueError, match="dynamic units: with counters"):
        build(_chain_phases(), 132, 7168, sync="flags", dynamic=True)
    with pytest.raises(ValueError, match="sync='fence': one of flags, red, atomic"):
        build(_chain_phases(), 132, 7168, sync="fence")


def test_stream_chain_prefetch_staggered_polls_and_poll_sleep() -> None:
    """Measured options (benchmarks/kernels/NOTES.md): an L2 prefetch warp (one prefetch per
    phase in the code),
    staggered polls (4 kept relaxed loads before and 4 inside each wait's loop, instead of one
    acquire load), a sleep between polls, counters in lines of their own."""
    from benchmarks.kernels.research.cute.stream_chain import build, compile_chain

    phases = _chain_phases()
    kw = dict(stages=12, warps=6, mma=True)
    waits = sum(ph.src >= 0 for ph in phases) + sum(ph.gate >= 0 for ph in phases)
    prefetched = compile_chain(phases, 132, 7168, prefetch=8 << 20, **kw).__ptx__
    assert prefetched.count("cp.async.bulk.prefetch.L2.global") == len(phases)
    staggered = compile_chain(phases, 132, 7168, polls=4, **kw).__ptx__
    assert staggered.count("ld.relaxed.gpu.global.b32") == 8 * waits
    assert "ld.acquire.gpu.global.b32" not in staggered
    assert staggered.count("nanosleep.u32") == 3 * waits
    slept = compile_chain(phases, 132, 7168, gap=200, spacing=32, **kw).__ptx__
    assert slept.count("nanosleep.u32") == waits
    assert slept.count("ld.acquire.gpu.global.b32") == waits
    for ptx in (prefetched, staggered, slept):
        assert not _ops(ptx) & {"ld.local", "st.local"}
    with pytest.raises(ValueError, match="polls=2: 1 to 4, more than 1 only with sync='red'"):
        build(phases, 132, 7168, sync="atomic", polls=2)


def test_stream_chain_phase_ends_in_shared_slots_replace_the_end_markers() -> None:
    """ends="slots": each phase's end position is one shared word (stored by the producer,
    polled in each phase's consumer loop), not six end-marker stages per phase."""
    from benchmarks.kernels.research.cute.stream_chain import build, compile_chain

    phases = _chain_phases()
    kw = dict(stages=12, warps=6, mma=True, dynamic=True, row_sum="store")
    markers = compile_chain(phases, 132, 7168, **kw).__ptx__
    slots = compile_chain(phases, 132, 7168, ends="slots", **kw).__ptx__
    assert "st.relaxed.cta.shared::cta.b32" not in markers
    assert slots.count("st.relaxed.cta.shared::cta.b32") == len(phases)
    assert slots.count("ld.relaxed.cta.shared::cta.b32") == len(phases)
    # the markers' plain arrivals on the full barriers (6 per phase) are gone
    plain = "mbarrier.arrive.shared.b64"
    assert markers.count(plain) - slots.count(plain) == 6 * len(phases)
    assert not _ops(slots) & {"ld.local", "st.local"}
    with pytest.raises(ValueError, match="ends='slots': 'markers', or 'slots' with dynamic"):
        build(phases, 132, 7168, ends="slots")


def test_stream_chain_probe_warp_compiles_beside_the_producer() -> None:
    """`probe` (with `trace`) adds a warp timing L2 round trips; it must build with and without
    the prefetch warp (an earlier prefetch dispatch broke the probe-only build)."""
    from benchmarks.kernels.research.cute.stream_chain import compile_chain

    phases = _chain_phases()
    kw = dict(stages=12, warps=6, mma=True, trace=True, probe="y")
    for extra in ({}, {"prefetch": 8 << 20}):
        ptx = compile_chain(phases, 132, 7168, **kw, **extra).__ptx__
        assert "%globaltimer" in ptx
        assert ptx.count("cp.async.bulk.prefetch.L2.global") == (len(phases) if extra else 0)
        assert not _ops(ptx) & {"ld.local", "st.local"}


def test_stream_chain_stream_options_of_session_8() -> None:
    """copy="lsu": the producer warp's 16-byte cp.async (each lane's arrival on the stage's
    full barrier, which then expects 32 + 1 arrivals) instead of one bulk copy; evict_first:
    the bulk copies carry an evict-first L2 policy; rolled: the tensor-core consumers loop at
    run time (one step group per phase in the code), which 32 KB stages need to compile."""
    from benchmarks.kernels.research.cute.stream_chain import build, compile_chain, plan_units

    phases = _chain_phases()
    kw = dict(stages=12, warps=6, mma=True, sets=4)
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    lsu = compile_chain(phases, 132, 7168, copy="lsu", **kw).__ptx__
    pieces = sum(plan_units(ph, 16384).bytes(ph.k) // 512 for ph in phases)
    assert lsu.count("cp.async.cg.shared.global") == pieces
    assert lsu.count("cp.async.mbarrier.arrive.noinc.shared.b64") == len(phases)
    assert bulk not in lsu
    assert ", 33;" in lsu  # the full barriers' expected arrivals
    hinted = compile_chain(phases, 132, 7168, evict_first=True, **kw).__ptx__
    assert "createpolicy.fractional.L2::evict_first.b64" in hinted
    # (every bulk copy in the code carries it; the compiler may peel a phase's loop)
    assert hinted.count(f"{bulk}.L2::cache_hint") == hinted.count(bulk) >= len(phases)
    hmma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    rolled = compile_chain(phases, 132, 7168, rolled=True, **kw).__ptx__
    assert rolled.count(hmma) == 2 * 4 * len(phases)  # two MMAs per step, sets steps a group
    big = compile_chain(
        phases, 132, 7168, chunk_bytes=32768, stages=6, rolled=True, dynamic=True,
        row_sum="store", **{k: v for k, v in kw.items() if k != "stages"},
    ).__ptx__  # fmt: skip
    for ptx in (lsu, hinted, rolled, big):
        assert not _ops(ptx) & {"ld.local", "st.local"}
    with pytest.raises(ValueError, match="copy='lsu': 'bulk', or 'lsu' with counters"):
        build(phases, 132, 7168, copy="lsu", sync="flags")
    # claimed units take an in-flight cap with end markers (measured slower; see
    # benchmarks/kernels/NOTES.md)
    capped = compile_chain(phases, 132, 7168, dynamic=True, inflight=6, **kw).__ptx__
    assert capped.count(bulk) >= len(phases)
    with pytest.raises(ValueError, match="inflight with markers"):
        build(phases, 132, 7168, dynamic=True, inflight=6, ends="slots")

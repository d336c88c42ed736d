"""A persistent chain of GEMVs whose weight stream never waits for the data (experimental).

Why: at batch 1 a decode layer is a chain of skinny GEMVs, each needing the previous one's
output, and every kernel boundary (or grid barrier) leaves HBM idle for ~2.7 us while the next
phase starts its loads (NOTES.md: nine kernels read the layer's 182.6 MB at 62%
of the roofline, one barrier-free kernel at 82%). But the weights do not depend on the data, only
the arithmetic does. So one CTA per SM splits into a producer warp, which streams the CTA's
slices of every phase's weights, in phase order, into a ring of shared-memory stages with bulk
copies (`cp.async.bulk`, completion on an mbarrier), and consumer warps, which wait at a grid
barrier for a phase's input, then reduce the stages against it. While the consumers wait, the
ring keeps up to `stages` x 16 KB per SM in flight, so the HBM does not see the dependency.

The phases here are plain GEMVs y_p = W_p x_p (fp32 out; x_p = the first k_p values of an
earlier phase's output, or of the layer input): the skeleton of a persistent decode layer, and
the measurement of what it can reach (benchmarks/kernels/research/stream_chain_run.py). The
layer's other work (norms, attention, routing) would become consumer code between the same barriers.

Grid barriers: after writing its rows of y_p, a CTA adds 1 to counter[slot, p] (release);
consumers of phase q wait, one thread polling, until counter[slot, src_q] >= grid (acquire).
Launches alternate `slot` 0/1 and each launch zeroes the other slot's counters (the previous
launch, which used them, has completed: no PDL), so a CUDA graph of an even number of launches
replays without a reset kernel. The grid must be co-resident: one CTA per SM (the ring fills the
shared memory), at most as many CTAs as SMs.

Measured variants and options (NOTES.md): tensor-core consumers (`mma`), the
spare units rotated over the CTAs (`rotate`), barriers by red.release / ld.acquire (`sync`),
or no barriers at all with flagged output words (`sync="flags"`, `flagged.py`), units claimed
at run time (`dynamic`), row sums by shuffles (`row_sum`), several layers per launch as a
runtime loop (`layers`), an L2 lookahead (`prefetch`), the counters' polls (`polls`, `gap`)
and layout (`spacing`), phase ends without marker stages (`ends`), how a stage is filled
(`copy`: bulk or per-lane cp.async), an evict-first L2 policy on the copies (`evict_first`),
runtime consumer loops (`rolled`). Best measured (NOTES.md): mma, sync="red", dynamic,
row_sum="store", layers=4, gap=100, evict_first, rolled, warps=4: 64.8 us for the batch-1
layer's 182.6 MB, 66% of the HBM roofline; the same kernel without its input waits 52.9 us.
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernels' annotations at trace time.
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from agentab.kernels.cute.common import compile_tvm_ffi, fake
from benchmarks.kernels.research.cute.chain_dot import consume_unit
from benchmarks.kernels.research.cute.chain_sync import (
    WATCHDOG,
    Counters,
    arrive_count,
    mwait,
    report_stuck,
    tick,
    wait_count,
    wait_flagged,
)
from benchmarks.kernels.research.cute.chain_trace import (
    CTA_STAMPS,
    TRACE_LEN,
    WATCH,
    probe_l2,
    stamp,
    stamp_position,
)
from benchmarks.kernels.research.cute.flagged import l2_evict_first_policy, ld_flagged2, st_flagged

SMEM_LIMIT = 227 * 1024  # Hopper's largest dynamic shared memory per CTA
FRONT_EL = 128  # the prefetch front's unit: 256 bytes of weights (int32 covers 512 GB)
TAG_SHIFT = 20  # ends="slots": a stage's tag is (the launch's phase number << 20) | unit
NOT_YET = 1 << 30  # ends="slots": a phase's end position before the producer has published it


@dataclass(frozen=True)
class Phase:
    """One GEMV of the chain: n rows of k bf16 weights; `src` = the phase whose output is the
    input (-1: the layer input); `gate` = a phase that must complete before the producer may
    stream these weights (-1: none), as routed experts' weights are known only after routing."""

    n: int
    k: int
    src: int = -1
    gate: int = -1


@dataclass(frozen=True)
class Unit:
    """How a phase is cut into bulk copies: `rows` whole weight rows per copy, `units` copies."""

    rows: int
    units: int

    def bytes(self, k: int) -> int:
        return self.rows * k * 2


def plan_units(ph: Phase, chunk_bytes: int) -> Unit:
    """The largest whole-row copy that fits a stage (rows dividing n, so every copy is full)."""
    if ph.k % 256:
        raise ValueError(f"k={ph.k}: needs a multiple of 256 (32 lanes x 8 values)")
    if ph.k * 2 > chunk_bytes:
        raise ValueError(f"k={ph.k}: one row ({ph.k * 2} B) exceeds a {chunk_bytes} B stage")
    # rows 1, 2, 4 or a multiple of 8: the tensor-core consumer gives each row 8 / rows of
    # its 8 lane groups, or 8 rows at a time (`unit_mma`)
    rows = max(
        r
        for r in range(1, chunk_bytes // (ph.k * 2) + 1)
        if ph.n % r == 0 and (r in (1, 2, 4) or r % 8 == 0)
    )
    return Unit(rows, ph.n // rows)


def _starts(sizes: list[int]) -> list[int]:
    """Each size's start in a packed buffer, then the total."""
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    return offs


def y_offsets(phases: tuple[Phase, ...]) -> list[int]:
    """Where each phase's output starts in the fp32 workspace (then its length)."""
    return _starts([ph.n for ph in phases])


def w_offsets(phases: tuple[Phase, ...]) -> list[int]:
    """Where each phase's weights start in the packed bf16 weight buffer (elements)."""
    return _starts([ph.n * ph.k for ph in phases])


def validate(phases: tuple[Phase, ...]) -> None:
    for i, ph in enumerate(phases):
        if not -1 <= ph.src < i or not -1 <= ph.gate < i:
            raise ValueError(f"phase {i}: src {ph.src} / gate {ph.gate}: not an earlier phase")
        if ph.src >= 0 and phases[ph.src].n < ph.k:
            raise ValueError(f"phase {i}: k={ph.k} exceeds phase {ph.src}'s {phases[ph.src].n}")


@dataclass(frozen=True)
class _Plan:
    """What the producer needs at trace time (compile-time constants)."""

    phases: tuple[Phase, ...]
    units: tuple[Unit, ...]
    rot: tuple[int, ...]
    woff: tuple[int, ...]
    yoff: tuple[int, ...]
    grid: int
    stages: int
    chunk_el: int
    inflight: int
    wait_kind: str
    trace: bool
    wait: bool
    sync: str
    cs: Counters  # the counters' layout and polling (sync "red" / "atomic")
    dynamic: bool = False
    claim: int = 2
    warps: int = 6
    layers: int = 1
    prefetch: int = 0  # bytes of L2 lookahead beyond the producer (0: none)
    ends: str = "markers"  # dynamic units: how a phase's end reaches the consumer warps
    copy: str = "bulk"  # how the producer fills a stage: "bulk" (one cp.async.bulk) or "lsu"
    evict_first: bool = False  # bulk copies: mark the weights' L2 lines evict-first

    @property
    def lsu(self) -> bool:
        """The whole producer warp copies (cp.async, 16 bytes a lane) instead of lane 0's bulk
        copy: each full barrier then expects 32 asynchronous arrivals and lane 0's one."""
        return self.copy == "lsu"

    @property
    def full_arrivals(self) -> int:
        """Arrivals that complete a stage's full barrier: lane 0's (bulk: with the copy's
        bytes), or (lsu) each lane's cp.async arrival and lane 0's."""
        return 33 if self.lsu else 1

    @property
    def stride(self) -> int:
        """Counters per layer: each phase's arrivals, then (dynamic units) its claims."""
        return len(self.phases) * (2 if self.dynamic else 1)

    def counter_base(self, slot, layer):
        """Layer `layer`'s first counter in launch slot `slot` (0 / 1)."""
        return slot * (self.layers * self.stride) + layer * self.stride

    def unit_el(self, p: int, wb, u):
        """The first weight element of unit u of phase p in the layer whose weights start at
        element wb (each caller computes it where it uses it, so the measured kernels'
        instruction order stays as it was)."""
        return wb + self.woff[p] + u * (self.units[p].bytes(self.phases[p].k) // 2)

    def share(self, p: int, bidx):
        """This CTA's round-robin share of phase p's units: its first unit (unit u goes to
        CTA (rot[p] + u) % grid) and how many it takes."""
        grid = self.grid
        b = (bidx + grid - self.rot[p] % grid) % grid
        return b, (self.units[p].units - b + grid - 1) // grid


def counter_words(phases_per_launch: int, dynamic: bool, spacing: int) -> int:
    """The int32 words per slot of the counters argument: each phase's arrivals (and with
    dynamic units its claims), `spacing` words apart."""
    return Counters(spacing=spacing).words(phases_per_launch * (2 if dynamic else 1))


@cute.jit
def _wait_gate(plan: cutlass.Constexpr, mCnt: cute.Tensor, cb, p: cutlass.Constexpr,
               mT: cute.Tensor, bidx):  # fmt: skip
    """Before streaming phase p's weights: wait for its gate phase (routing) to complete."""
    g = plan.phases[p].gate
    if cutlass.const_expr(plan.wait and g >= 0):
        wait_count(mCnt, cb + g, plan.grid, mT, 2, bidx, plan.cs)


@cute.jit
def _produce(plan: cutlass.Constexpr, mW: cute.Tensor, mY: cute.Tensor, mCnt: cute.Tensor,
             slot, mT: cute.Tensor, ring: cute.Tensor, full, empty, tag, flag, lane,
             bidx, front=None, ends=None):  # fmt: skip
    """The producer warp: lane 0 streams this CTA's slices of every phase, never waiting for
    data but for a gate (counters: lane 0 polls; flags: the whole warp polls the gate phase's
    words, then lane 0 goes on)."""
    n_ph = len(plan.phases)
    if cutlass.const_expr(plan.sync == "flags"):
        it = Int32(0)
        for p in cutlass.range_constexpr(n_ph):
            g = plan.phases[p].gate
            if cutlass.const_expr(plan.wait and g >= 0):
                wait_flagged(mY, plan.yoff[g], plan.phases[g].n, flag, lane, mT, 2, bidx)
            if lane == 0:
                it = _issue(plan, p, mW, 0, ring, full, empty, mT, it, bidx)
    else:
        if cutlass.const_expr(plan.lsu):  # the whole warp copies, lane 0 alone signals
            _stream_layers(plan, mW, mCnt, slot, mT, ring, full, empty, tag, lane, bidx, front,
                           ends)  # fmt: skip
        else:
            if lane == 0:
                _stream_layers(plan, mW, mCnt, slot, mT, ring, full, empty, tag, lane, bidx,
                               front, ends)  # fmt: skip


@cute.jit
def _stream_layers(plan: cutlass.Constexpr, mW: cute.Tensor, mCnt: cute.Tensor, slot,
                   mT: cute.Tensor, ring: cute.Tensor, full, empty, tag, lane, bidx, front,
                   ends):  # fmt: skip
    """Counters: every layer's phases in order, each after its gate (lane 0 polls)."""
    n_ph = len(plan.phases)
    it = Int32(0)
    for l in range(plan.layers):  # noqa: E741
        cb = plan.counter_base(slot, l)
        wb = l * plan.woff[-1]  # the layer's weights
        for p in cutlass.range_constexpr(n_ph):
            if cutlass.const_expr(plan.lsu):
                if lane == 0:
                    _wait_gate(plan, mCnt, cb, p, mT, bidx)
                cute.arch.sync_warp()
            else:
                _wait_gate(plan, mCnt, cb, p, mT, bidx)
            if cutlass.const_expr(plan.dynamic):
                it = _issue_claimed(plan, p, mW, wb, mCnt, cb, ring, full, empty, tag, mT, it,
                                    bidx, front, l * n_ph + p, ends, lane)  # fmt: skip
            else:
                it = _issue(plan, p, mW, wb, ring, full, empty, mT, it, bidx, front, lane)
    if cutlass.const_expr(front is not None):
        # done: release the prefetch warp (with claimed units this CTA's last unit may lie well
        # before the stream's end)
        cute.arch.store(front.llvm_ptr, Int32(1 << 30), ss="cta", sem="relaxed", scope="cta")


@cute.jit
def _issue(plan: cutlass.Constexpr, p: cutlass.Constexpr, mW: cute.Tensor, wb,
           ring: cute.Tensor, full, empty, mT: cute.Tensor, it, bidx, front=None,
           lane=0):  # fmt: skip
    """Lane 0 (copy="lsu": the warp) streams this CTA's units of phase p (of the layer whose
    weights start at element wb) into the ring from position `it` (unit u on CTA
    (rot[p] + u) % grid); returns the next position."""
    b, mine = plan.share(p, bidx)
    for j in range(mine):
        _copy_unit(plan, p, mW, wb, b + j * plan.grid, ring, full, empty, None, mT, it, bidx,
                   front, 0, lane)  # fmt: skip
        it = it + 1
    return it


@cute.jit
def _copy_unit(plan: cutlass.Constexpr, p: cutlass.Constexpr, mW: cute.Tensor, wb, u,
               ring: cute.Tensor, full, empty, tag, mT: cute.Tensor, it, bidx,
               front=None, tag_hi=0, lane=0):  # fmt: skip
    """Ring position `it` gets unit u of phase p: wait until its stage is free (and, with an
    in-flight cap, until copy it - inflight has landed), tag the stage (dynamic units), start
    the bulk copy with the stage's full barrier expecting its bytes (copy="lsu": every lane
    copies its 16-byte pieces with cp.async instead). With an L2 lookahead,
    publish the unit's place in the launch's weight stream to the prefetch warp (`front`)."""
    stages, inflight, wait_kind = plan.stages, plan.inflight, plan.wait_kind
    ub = plan.units[p].bytes(plan.phases[p].k)
    s = it % stages
    mwait(empty + s, ((it // stages) & 1) ^ 1, wait_kind, mT, 0, bidx)
    if cutlass.const_expr(0 < inflight < stages):  # noqa: SIM102
        if it >= inflight:
            q = it - inflight
            mwait(full + q % stages, (q // stages) & 1, wait_kind, mT, 0, bidx)
    if cutlass.const_expr(plan.lsu):
        src = mW.iterator + plan.unit_el(p, wb, u)
        # every lane copies 16-byte pieces lane, lane + 32, ...; its cp.async arrival fires when
        # they have landed; lane 0's plain arrival publishes the tag (release)
        dst = ring.iterator + s * plan.chunk_el
        for i in cutlass.range_constexpr(ub // 512):
            nvvm.cp_async_shared_global(dst + (i * 32 + lane) * 8, src + (i * 32 + lane) * 8, 16,
                                        "cg")  # fmt: skip
        nvvm.cp_async_mbarrier_arrive(full + s, noinc=True)
        if lane == 0:
            stamp_position(plan.trace, mT, 0, it, bidx)
            if cutlass.const_expr(tag is not None):
                tag[s] = u + tag_hi
            cute.arch.mbarrier_arrive(full + s)
    else:
        stamp_position(plan.trace, mT, 0, it, bidx)
        if cutlass.const_expr(tag is not None):
            tag[s] = u + tag_hi  # published by the arrive's release, read after the consumer's wait
        cute.arch.mbarrier_arrive_and_expect_tx(full + s, ub)
        src = mW.iterator + plan.unit_el(p, wb, u)
        hint = l2_evict_first_policy() if plan.evict_first else None
        nvvm.cp_async_bulk_shared_cluster_global(ring.iterator + s * plan.chunk_el, src,
                                                 full + s, ub, l2_cache_hint=hint)  # fmt: skip
    if cutlass.const_expr(front is not None):
        cute.arch.store(front.llvm_ptr, Int32(plan.unit_el(p, wb, u) // FRONT_EL), ss="cta",
                        sem="relaxed", scope="cta")  # fmt: skip


@cute.jit
def _issue_claimed(plan: cutlass.Constexpr, p: cutlass.Constexpr, mW: cute.Tensor, wb,
                   mCnt: cute.Tensor, cb, ring: cute.Tensor, full, empty, tag, mT: cute.Tensor,
                   it, bidx, front=None, seq=0, ends=None, lane=0):  # fmt: skip
    """Dynamic units: lane 0 claims phase p's units `plan.claim` at a time from the phase's
    claim counter (two claims in flight while a third's copies go out: an atomic's round trip
    under the stream is 0.2-3 us, a 16 KB unit streams in ~0.6 us), tags each
    stage with its unit, then closes the phase with one end marker (tag -1, no data) per
    consumer warp: consecutive positions, so each warp meets exactly one. The CTAs whose SMs
    stream faster take more units, so a phase no longer waits for the slowest SM's share.

    ends="slots": no end markers; the stages carry the launch's phase number `seq` in their
    tags, and the phase's end position goes into the shared word ends[seq] (`_filled_or_ended`).
    Why: six markers per phase hold ring stages until the consumers pass the phase, so the
    producer ran at most about two phases ahead (a trace in NOTES.md: o_proj's copies
    issued 8-13 us late, behind the small phases' markers). Measured slower all the same
    (68.7 vs 66.0 us, call 7): copies issued further ahead queue in front of the current
    phase's (up to 15 us from issue to landing)."""
    stages, claim = plan.stages, plan.claim
    n_units = plan.units[p].units
    counter = (mCnt.iterator + (cb + len(plan.phases) + p) * plan.cs.spacing).llvm_ptr
    base = _claim(plan, counter, lane)
    after = _claim(plan, counter, lane)
    while base < n_units:
        later = _claim(plan, counter, lane)
        for c in cutlass.range_constexpr(claim):
            u = base + c
            if u < n_units:
                tag_hi = seq << TAG_SHIFT if plan.ends == "slots" else 0
                _copy_unit(plan, p, mW, wb, u, ring, full, empty, tag, mT, it, bidx, front, tag_hi,
                           lane)  # fmt: skip
                it = it + 1
        base = after
        after = later
    if cutlass.const_expr(plan.ends == "slots"):
        cute.arch.store((ends + seq).llvm_ptr, Int32(it), ss="cta", sem="relaxed", scope="cta")
    else:
        for _ in cutlass.range_constexpr(plan.warps):
            s = it % stages
            mwait(empty + s, ((it // stages) & 1) ^ 1, plan.wait_kind, mT, 0, bidx)
            if lane == 0:
                tag[s] = Int32(-1)
                # (lsu: the arrivals of the 32 lanes' copies and lane 0's, all at once)
                cute.arch.mbarrier_arrive(full + s, arrive_count=plan.full_arrivals)
            it = it + 1
    return it


@cute.jit
def _claim(plan: cutlass.Constexpr, counter, lane):
    """Claim `plan.claim` units: lane 0's atomic (lsu: handed to the whole warp)."""
    if cutlass.const_expr(plan.lsu):
        got = Int32(0)
        if lane == 0:
            got = cute.arch.atomic_add(counter, Int32(plan.claim), scope="gpu")
        return cute.arch.shuffle_sync(got, 0)
    return cute.arch.atomic_add(counter, Int32(plan.claim), scope="gpu")


@cute.jit
def _prefetch(plan: cutlass.Constexpr, mW: cute.Tensor, mCnt: cute.Tensor, slot, mT: cute.Tensor,
              front, lane, bidx):  # fmt: skip
    """The prefetch warp: lane 0 pulls this CTA's round-robin share of every phase's weights
    into L2 (`cp.async.bulk.prefetch.L2`, no destination, nothing to wait for), staying at most
    `plan.prefetch` bytes ahead of the CTA's producer in the launch's weight stream (`front`).

    Why: the ring (12 x 16 KB per SM) is the stream's only buffer, so a phase boundary that
    outlasts it stops the HBM; and every copy in flight waits in the SMs' full memory queues
    (issue to filled 3-4 us at phase starts). Weights already in L2 decouple the HBM from the
    consumers' waits, and the ring's copies then land from L2. Gated phases (routed experts)
    are prefetched only after their gate, as their addresses would come from routing.
    Measured slower (NOTES.md: +5.7 to +7.5 us per layer for 4-16 MB ahead): the ring was not
    what stalled the stream, and more requests in flight lengthen every queue."""
    if lane == 0:
        grid = plan.grid
        ahead = plan.prefetch // (2 * FRONT_EL)
        for l in range(plan.layers):  # noqa: E741
            cb = plan.counter_base(slot, l)
            wb = l * plan.woff[-1]
            for p in cutlass.range_constexpr(len(plan.phases)):
                _wait_gate(plan, mCnt, cb, p, mT, bidx)
                ub = plan.units[p].bytes(plan.phases[p].k)
                b, mine = plan.share(p, bidx)
                for j in range(mine):
                    el = plan.unit_el(p, wb, b + j * grid)
                    n = Int32(0)
                    while n >= 0 and el // FRONT_EL > ahead + cute.arch.load(
                        front.llvm_ptr, Int32, sem="relaxed", scope="cta", ss="cta"
                    ):
                        n = n + 1
                        if n > WATCHDOG:  # the producer stopped: report, then go on
                            mT[WATCH + 14] = bidx + 1
                            n = Int32(-1)
                    nvvm.cp_async_bulk_prefetch(mW.iterator + el, ub)


@cute.jit
def _filled_or_ended(bar, parity, end, q, mT: cute.Tensor, bidx) -> Int32:
    """ends="slots": wait until ring position q is filled (1) or lies at or past the phase's
    end position once the producer has published it in the shared word `end` (3); every lane
    polls, as the mbarrier waits do."""
    state = Int32(0)
    n = Int32(0)
    while state == 0:
        if q >= cute.arch.load(end.llvm_ptr, Int32, sem="relaxed", scope="cta", ss="cta"):
            state = Int32(3)
        elif cute.arch.mbarrier_test_wait(bar, parity):
            state = Int32(1)
        n, state = tick(n, state)
    report_stuck(state, mT, 1, bidx)
    return state


@cute.jit
def _take_unit(atom, ring: cute.Tensor, xs: cute.Tensor, acc: cute.Tensor, s,
               max_rows: cutlass.Constexpr, rows: cutlass.Constexpr, vpr: cutlass.Constexpr,
               sets: cutlass.Constexpr, lane, chunk_el: cutlass.Constexpr,
               consume: cutlass.Constexpr, mma: cutlass.Constexpr, row_sum: cutlass.Constexpr,
               mY: cute.Tensor, y0, u, rolled: cutlass.Constexpr = False):  # fmt: skip
    """Dynamic units: one warp reduces the unit in stage s and writes its rows of y at once
    (y0 = the phase's first output)."""
    consume_unit(atom, ring, xs, acc, s, s * max_rows, rows, vpr, sets, lane, chunk_el, consume,
                 mma, row_sum, rolled)  # fmt: skip
    cute.arch.sync_warp()
    for r in cutlass.range_constexpr((rows + 31) // 32):  # (above 16 KB: units of 64 rows)
        if r * 32 + lane < rows:
            mY[y0 + u * rows + r * 32 + lane] = acc[s * max_rows + r * 32 + lane]
            acc[s * max_rows + r * 32 + lane] = Float32(0.0)


@cute.jit
def _release(trace: cutlass.Constexpr, mT: cute.Tensor, q, bidx, lane, empty, s,
             warps: cutlass.Constexpr):  # fmt: skip
    """Dynamic units: the warp hands ring position q's stage s back to the producer; returns
    the warp's next position."""
    cute.arch.sync_warp()
    if lane == 0:
        stamp_position(trace, mT, 2, q, bidx)
        cute.arch.mbarrier_arrive(empty + s)
    return q + warps


@cute.jit
def _stage_input(mX: cute.Tensor, mY: cute.Tensor, xs: cute.Tensor, k: cutlass.Constexpr,
                 from_x: cutlass.Constexpr, y_vec0, tidx, threads: cutlass.Constexpr):  # fmt: skip
    """Stage k input values into xs as bf16 (layer input or fp32 outputs from vector y_vec0),
    every 16-byte load in flight at once: one latency per phase."""
    for i in cutlass.range_constexpr((k // 8 + threads - 1) // threads):
        v = tidx + i * threads
        if cutlass.const_expr((i + 1) * threads <= k // 8):
            _stage_x(mX, mY, xs, v, from_x, y_vec0)
        else:
            if v < k // 8:
                _stage_x(mX, mY, xs, v, from_x, y_vec0)


@cute.jit
def _stage_x(mX: cute.Tensor, mY: cute.Tensor, xs: cute.Tensor, v, from_x: cutlass.Constexpr,
             y_vec0):  # fmt: skip
    """xs vector v (8 bf16) = layer input vector v, or output vector y_vec0 + v (8 fp32)."""
    if cutlass.const_expr(from_x):
        cute.local_tile(xs, (8,), (v,)).store(cute.local_tile(mX, (8,), (v,)).load())
    else:
        val = cute.local_tile(mY, (8,), (y_vec0 + v,)).load()
        cute.local_tile(xs, (8,), (v,)).store(val.to(BFloat16))


@cute.jit
def _stage_flagged_vec(mY: cute.Tensor, xs: cute.Tensor, v, y0: cutlass.Constexpr, flag):
    """xs vector v (8 bf16) = the flagged words y0 + 8 v .. + 7; 1 when all carried `flag`."""
    ok = Int32(1)
    frag = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
    for q in cutlass.range_constexpr(4):
        a, fa, b, fb = ld_flagged2((mY.iterator + (y0 + v * 8 + 2 * q)).llvm_ptr)
        frag[2 * q] = a.to(BFloat16)
        frag[2 * q + 1] = b.to(BFloat16)
        ok = ok & Int32(fa == flag) & Int32(fb == flag)
    cute.local_tile(xs, (8,), (v,)).store(frag.load())
    return ok


@cute.jit
def _stage_flagged(mX: cute.Tensor, mY: cute.Tensor, xs: cute.Tensor, k: cutlass.Constexpr,
                   src: cutlass.Constexpr, y0: cutlass.Constexpr, flag, poll: cutlass.Constexpr,
                   tidx, threads: cutlass.Constexpr, mT: cute.Tensor, code: cutlass.Constexpr,
                   bidx):  # fmt: skip
    """Stage a phase's k input values into xs as bf16 from the layer input or the flagged
    words from y0 (one 16-byte vector's four loads at a time: issuing all of a thread's loads
    first measured slower, NOTES.md). `poll`: reload until every word carries `flag`
    (the flagged-word grid sync), under the watchdog."""
    if cutlass.const_expr(src < 0):
        _stage_input(mX, mY, xs, k, True, 0, tidx, threads)
    else:
        done = Int32(0)
        n = Int32(0)
        while done == 0:
            done = Int32(1)
            for i in cutlass.range_constexpr((k // 8 + threads - 1) // threads):
                v = tidx + i * threads
                if cutlass.const_expr((i + 1) * threads <= k // 8):
                    done = done & _stage_flagged_vec(mY, xs, v, y0, flag)
                else:
                    if v < k // 8:
                        done = done & _stage_flagged_vec(mY, xs, v, y0, flag)
            if cutlass.const_expr(not poll):
                done = Int32(1)
            n = n + 1
            if n > WATCHDOG:
                mT[WATCH + code] = bidx + 1
                done = Int32(1)


def build(phases: tuple[Phase, ...], grid: int, x_len: int, stages: int = 12,
          chunk_bytes: int = 16384, wait: bool = True, consume: bool = True, wait_kind: str = "try",
          trace: bool = False, warps: int = 6, mma: bool = False, sets: int = 2,
          rotate: bool = True, sync: str = "red", inflight: int = 0,
          probe: str = "", dynamic: bool = False, claim: int = 2,
          row_sum: str = "atomic", layers: int = 1, prefetch: int = 0,
          polls: int = 1, spacing: int = 1, gap: int = 0,
          ends: str = "markers", copy: str = "bulk", evict_first: bool = False,
          rolled: bool = False) -> Any:  # fmt: skip
    """Trace the persistent kernel for `phases` on `grid` CTAs; returns the @cute.jit host.

    `wait=False` drops the grid barriers (every phase then reads whatever its source holds):
    the read ceiling of the same kernel, for measurement only. `consume=False` skips the
    arithmetic (consumers only wait for and release the stages): the stream's own rate.
    `warps` consumer warps own the ring's stages round robin; `wait_kind` picks the mbarrier
    wait (`mwait`); `trace` has CTA 0 write %globaltimer stamps
    into the trace argument (producer issue, stage filled, stage released per ring position;
    each phase's start and end). `mma` runs the consumers' dot products on the tensor cores
    (`unit_mma`, `sets` accumulator pairs) instead of CUDA-core FMAs. `rotate` starts each
    phase's round robin of units where the previous phase's left off, so the CTAs that take a
    phase's spare units differ from phase to phase (without it CTA 0 takes every spare: 3.8%
    more bytes than the mean). `sync` picks the grid barrier: "flags" (no barrier: each output
    word carries the launch's flag, readers poll the words themselves, `flagged.py`), "red"
    (counters: arrival by red.release, polling by ld.acquire) or "atomic" (counters: fence +
    atom.release, polling by atom.add 0 with acquire). `inflight` (0: the whole ring) caps the
    copies in flight: every global load a consumer makes (its phase's input) queues behind
    the SM's in-flight weight bytes (12 x 16 KB at ~25 GB/s per SM: ~7 us), while ~4 copies
    already keep the HBM busy; the rest of the ring then only buffers landed stages (measured:
    no shorter boundaries; with dynamic units any cap costs ~9 us, NOTES.md). `probe`
    (with `trace`: "word" or "y") adds a warp to CTA 0 that times L2 round trips during the
    launch (`probe_l2`). `dynamic` (counters only): CTAs claim each phase's units at run
    time, `claim` per claim (`_issue_claimed`), instead of a fixed round robin. `row_sum`
    ("atomic" or "store") is how the tensor-core consumers land a row's sum (`unit_mma`).
    `layers` (counters only): that many layers in one launch, as a runtime loop over one layer's
    code (layer l + 1's input is layer l's last output; its weights, outputs and counters follow
    layer l's), so the stream runs on across layer ends and the code does not grow.
    `prefetch` (bytes, counters only; 0: none) adds a warp that prefetches the weights into L2
    that far ahead of the producer (`_prefetch`). `polls` (1-4, sync="red"): loads in flight
    per counter wait, staggered (`poll_staggered`); `gap`: ns of sleep between polls;
    `spacing`: int32 words between counters (32: one 128-byte line each; the counters argument
    is then that much longer). `ends` (dynamic units): "markers" closes each phase with one
    end-marker stage per consumer warp; "slots" publishes the phase's end position in shared
    memory instead, so the ring holds only weights (`_issue_claimed`). `copy`: how the
    producer fills a stage: "bulk" (lane 0's cp.async.bulk, the TMA engine) or "lsu" (the
    whole warp's 16-byte cp.async through the load-store units, `_copy_unit`; NOTES.md:
    faster alone, 47.4 vs 53.3 us, but 82.7 vs 66.3 in the chain, where its copy instructions
    compete with the consumers' shared-memory loads). `evict_first` (bulk): the copies carry
    an evict-first L2 policy (alone -2.5 us, in the chain -0.5). `rolled`: the tensor-core
    consumers' row blocks and steps as runtime loops (`unit_mma`; -0.6 us, and stages above
    16 KB compile in seconds instead of minutes).
    """
    validate(phases)
    if sync not in ("flags", "red", "atomic"):
        raise ValueError(f"sync={sync!r}: one of flags, red, atomic")
    flags = sync == "flags"
    if dynamic and (flags or (inflight and ends == "slots")):
        raise ValueError("dynamic units: with counters (sync red/atomic), inflight with markers")
    if layers > 1 and flags:
        raise ValueError("layers > 1: with counters (sync red/atomic)")
    if not 1 <= polls <= 4 or (polls > 1 and sync != "red"):
        raise ValueError(f"polls={polls}: 1 to 4, more than 1 only with sync='red'")
    if ends not in ("markers", "slots") or (ends == "slots" and not dynamic):
        raise ValueError(f"ends={ends!r}: 'markers', or 'slots' with dynamic units")
    if ends == "slots" and (layers * len(phases) >= 1 << 10):
        raise ValueError(f"ends='slots': {layers * len(phases)} phases per launch, tags hold 1023")
    if copy not in ("bulk", "lsu") or (copy == "lsu" and (flags or prefetch or ends != "markers")):
        raise ValueError(f"copy={copy!r}: 'bulk', or 'lsu' with counters, end markers, no prefetch")
    if prefetch and (flags or prefetch < 16384):
        raise ValueError(f"prefetch={prefetch}: with counters, and at least one 16 KB stage")
    if layers * w_offsets(phases)[-1] >= 2**31:
        raise ValueError(f"{layers} layers of weights: element offsets beyond int32")
    if layers > 1 and phases[-1].n < phases[0].k:
        raise ValueError("layers > 1: the last phase's output is shorter than the first's input")
    if stages % warps:
        # Position q lives in stage q % stages and belongs to warp q % warps: only when the
        # warps divide the stages does each stage keep one owner, so that no warp waits on a
        # stage's next round (same parity test) before its current round was consumed.
        raise ValueError(f"{stages} stages: not a multiple of {warps} consumer warps")
    CONSUMER_WARPS = warps
    CONSUMERS = 32 * warps
    PREFETCH_WARP = warps + 1 if prefetch else -1
    side_warps = bool(probe or prefetch)  # warps beside the producer
    extra_warps = 1 + (1 if prefetch else 0) + (1 if probe else 0)  # producer, prefetch, probe
    units = [plan_units(ph, chunk_bytes) for ph in phases]
    n_ph = len(phases)
    rot = _starts([u.units % grid if rotate else 0 for u in units])  # phase p's first CTA
    yoff, woff = y_offsets(phases), w_offsets(phases)
    cs = Counters(sync, polls, spacing, gap)
    plan = _Plan(phases, tuple(units), tuple(rot), tuple(woff), tuple(yoff), grid, stages,
                 chunk_bytes // 2, inflight, wait_kind, trace, wait, sync, cs, dynamic, claim,
                 warps, layers, prefetch, ends, copy, evict_first)  # fmt: skip
    stride = plan.stride
    n_y = yoff[-1]
    k_max = max(max(ph.k for ph in phases), x_len)
    # dynamic units: a row accumulator per stage (a unit's rows go out when it is done)
    max_rows = max(u.rows for u in units)
    acc_len = stages * max_rows if dynamic else max(-(-u.units // grid) * u.rows for u in units)
    chunk_el = chunk_bytes // 2
    ends_mode = ends
    smem = stages * chunk_bytes + 2 * k_max + 4 * acc_len + 20 * stages + 256 + 32
    smem += 4 * layers * n_ph if ends == "slots" else 0
    if smem > SMEM_LIMIT:
        raise ValueError(f"{smem} B of shared memory per CTA: more than {SMEM_LIMIT}")

    @cute.kernel
    def kernel(mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, mCnt: cute.Tensor,
               slot: Int32, mT: cute.Tensor, mE: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        alloc = cutlass.memory.SmemAllocator()
        ring = alloc.allocate_tensor(BFloat16, cute.make_layout(stages * chunk_el),
                                     byte_alignment=128)  # fmt: skip
        xs = alloc.allocate_tensor(BFloat16, cute.make_layout(k_max), byte_alignment=16)
        acc = alloc.allocate_tensor(Float32, cute.make_layout(acc_len), byte_alignment=16)
        full = alloc.allocate_array(cutlass.Int64, num_elems=stages)
        empty = alloc.allocate_array(cutlass.Int64, num_elems=stages)
        epoch = None
        tag = None
        front = None
        ends = None
        if cutlass.const_expr(ends_mode == "slots"):
            ends = alloc.allocate_array(Int32, num_elems=layers * n_ph)  # each phase's end
        if cutlass.const_expr(prefetch):
            front = alloc.allocate_array(Int32, num_elems=1)  # the producer's place (FRONT_EL)
        if cutlass.const_expr(dynamic):
            tag = alloc.allocate_array(Int32, num_elems=stages)  # each stage's unit (-1: end)
        if cutlass.const_expr(flags):
            epoch = alloc.allocate_array(Int32, num_elems=1)
        if tidx == 0:
            if cutlass.const_expr(flags):
                epoch[0] = mE[0]
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(full + s, plan.full_arrivals)
                cute.arch.mbarrier_init(empty + s, 1)  # the owning consumer warp
            if cutlass.const_expr(prefetch):
                front[0] = Int32(0)
            if cutlass.const_expr(ends_mode == "slots"):
                for i in cutlass.range_constexpr(layers * n_ph):
                    ends[i] = Int32(NOT_YET)
            if bidx == 0:  # the other slot's counters, for the next launch
                for p in cutlass.range_constexpr(layers * stride):
                    mCnt[1 - slot, cs.words(p)] = Int32(0)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(trace and n_ph < 16):  # noqa: SIM102 (compile time, then runtime)
            if tidx == 0:
                stamp(True, mT, CTA_STAMPS + bidx * 16 + 15)
        flag = 0
        if cutlass.const_expr(flags):
            flag = epoch[0] + 1  # this launch's output words; the last CTA out advances mE[0]

        # warps: consumers 0 .. CONSUMER_WARPS - 1, the producer, then the prefetch warp (with
        # `prefetch`), then the probe (with `probe`)
        if warp >= CONSUMER_WARPS if side_warps else warp == CONSUMER_WARPS:
            if cutlass.const_expr(side_warps):
                if warp == CONSUMER_WARPS:
                    _produce(plan, mW, mY, mCnt, slot, mT, ring, full, empty, tag, flag, lane,
                             bidx, front, ends)  # fmt: skip
                elif warp == PREFETCH_WARP:  # (-1 without prefetch: never)
                    if cutlass.const_expr(prefetch):
                        _prefetch(plan, mW, mCnt, slot, mT, front, lane, bidx)
                else:
                    if cutlass.const_expr(probe):  # noqa: SIM102 (compile time, then runtime)
                        if bidx == 0 and lane == 0:
                            probe_l2(mT, mY, probe, yoff[-1])
            else:
                _produce(plan, mW, mY, mCnt, slot, mT, ring, full, empty, tag, flag, lane,
                             bidx, front, ends)  # fmt: skip
        else:
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            it = Int32(0)
            q = warp  # dynamic units: this warp's next ring position
            for l in range(layers):  # noqa: E741 (a runtime loop: one layer's code, any layers)
                cb = plan.counter_base(slot, l)
                yb = l * n_y  # this layer's outputs
                for p in cutlass.range_constexpr(n_ph):
                    ph = phases[p]
                    rows = units[p].rows
                    vpr = ph.k // 8  # 16-byte vectors per row
                    b, mine = plan.share(p, bidx)
                    # Wait for the input (counters: one thread polls, the rest wait at the named
                    # barrier; flags: every thread polls its own share of the input words).
                    if cutlass.const_expr(wait and ph.src >= 0 and not flags):
                        if tidx == 0:
                            wait_count(mCnt, cb + ph.src, grid, mT, 3 + p, bidx, cs)
                        cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
                    if cutlass.const_expr(wait and ph.src < 0 and layers > 1):  # noqa: SIM102
                        if l > 0:  # the previous layer's last output is this layer's input
                            if tidx == 0:
                                wait_count(mCnt, cb - stride + n_ph - 1, grid, mT, 3 + p, bidx,
                                            cs)  # fmt: skip
                            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
                    if bidx == 0 and tidx == 0:
                        stamp(trace, mT, 3072 + p)
                    # The input as bf16 in shared memory (half the shared-memory reads of fp32).
                    if cutlass.const_expr(flags):
                        _stage_flagged(mX, mY, xs, ph.k, ph.src, yoff[max(ph.src, 0)], flag,
                                       wait and ph.src >= 0, tidx, CONSUMERS, mT, 3 + p,
                                       bidx)  # fmt: skip
                    elif cutlass.const_expr(ph.src >= 0 or layers == 1):
                        _stage_input(mX, mY, xs, ph.k, ph.src < 0, (yb + yoff[max(ph.src, 0)]) // 8,
                                     tidx, CONSUMERS)  # fmt: skip
                    else:  # a layer's first phase: the layer input, or the last layer's output
                        if l == 0:
                            _stage_input(mX, mY, xs, ph.k, True, 0, tidx, CONSUMERS)
                        else:
                            _stage_input(mX, mY, xs, ph.k, False, (yb - n_y + yoff[-2]) // 8,
                                         tidx, CONSUMERS)  # fmt: skip
                    for c in range(tidx, acc_len, CONSUMERS):
                        acc[c] = Float32(0.0)
                    cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
                    if bidx == 0 and tidx == 0:
                        stamp(trace, mT, 3200 + p)

                    if cutlass.const_expr(dynamic):
                        # Position q belongs to warp q % warps; the warp's positions of this phase
                        # hold claimed units until its end marker. A unit's rows go out when done.
                        more = Int32(1)
                        seq = l * n_ph + p  # the launch's phase number (ends="slots" tags)
                        while more == 1:
                            s = q % stages
                            if cutlass.const_expr(ends_mode == "slots"):
                                # the phase is over for this warp once its end position is
                                # published and passed, or its next stage holds a later phase
                                got = _filled_or_ended(full + s, (q // stages) & 1, ends + seq, q,
                                                       mT, bidx)  # fmt: skip
                                u = tag[s] - (seq << TAG_SHIFT)
                                if got == 1 and u < (1 << TAG_SHIFT):
                                    if lane == 0:
                                        stamp_position(trace, mT, 1, q, bidx)
                                    _take_unit(atom, ring, xs, acc, s, max_rows, rows, vpr, sets,
                                               lane, chunk_el, consume, mma, row_sum, mY,
                                               yb + yoff[p], u, rolled)  # fmt: skip
                                    q = _release(trace, mT, q, bidx, lane, empty, s, CONSUMER_WARPS)
                                else:
                                    more = Int32(0)  # (a later phase's stage stays unreleased)
                            else:
                                mwait(full + s, (q // stages) & 1, wait_kind, mT, 1, bidx)
                                if lane == 0:
                                    stamp_position(trace, mT, 1, q, bidx)
                                u = tag[s]
                                if u < 0:
                                    more = Int32(0)
                                else:
                                    _take_unit(atom, ring, xs, acc, s, max_rows, rows, vpr, sets,
                                               lane, chunk_el, consume, mma, row_sum, mY,
                                               yb + yoff[p], u, rolled)  # fmt: skip
                                q = _release(trace, mT, q, bidx, lane, empty, s, CONSUMER_WARPS)
                    else:
                        # Units go round robin to the consumer warps; a warp owns whole units and
                        # keeps its partial sums in registers until a row (or row block) is done.
                        first = (warp - it % CONSUMER_WARPS + CONSUMER_WARPS) % CONSUMER_WARPS
                        for j in range(first, mine, CONSUMER_WARPS):
                            s = (it + j) % stages
                            mwait(full + s, ((it + j) // stages) & 1, wait_kind, mT, 1, bidx)
                            if lane == 0:
                                stamp_position(trace, mT, 1, it + j, bidx)
                            consume_unit(atom, ring, xs, acc, s, j * rows, rows, vpr, sets, lane,
                                          chunk_el, consume, mma, row_sum, rolled)  # fmt: skip
                            cute.arch.sync_warp()
                            if lane == 0:
                                stamp_position(trace, mT, 2, it + j, bidx)
                                cute.arch.mbarrier_arrive(empty + s)
                        it = it + mine

                    cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
                    if cutlass.const_expr(trace and p < 15):  # noqa: SIM102
                        if tidx == 0:
                            stamp(True, mT, CTA_STAMPS + bidx * 16 + p)
                    if bidx == 0 and tidx == 0:
                        stamp(trace, mT, 3264 + p)
                    if cutlass.const_expr(flags):
                        # (each thread writes and, next phase, zeroes the same acc entries)
                        for c in range(tidx, mine * rows, CONSUMERS):
                            j = c // rows
                            r = c % rows
                            y = mY.iterator + (yoff[p] + (b + j * grid) * rows + r)
                            st_flagged(y.llvm_ptr, acc[c], flag)
                    else:
                        if cutlass.const_expr(not dynamic):  # (dynamic: written per unit)
                            for c in range(tidx, mine * rows, CONSUMERS):
                                j = c // rows
                                r = c % rows
                                mY[yb + yoff[p] + (b + j * grid) * rows + r] = acc[c]
                            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
                        if tidx == 0:
                            arrive_count(mCnt, cb + p, cs)
                    if bidx == 0 and tidx == 0:
                        stamp(trace, mT, 3136 + p)

        if cutlass.const_expr(flags):
            # The last CTA out advances the epoch, so the next launch's flags differ from every
            # word this one wrote (a kernel boundary separates launches: plain stores suffice).
            cute.arch.sync_threads()
            if tidx == 0:  # noqa: SIM102 (the atomic must not run in every thread)
                if cute.arch.atomic_add((mE.iterator + 1).llvm_ptr, Int32(1)) == grid - 1:
                    mE[1] = Int32(0)
                    mE[0] = flag

    @cute.jit
    def host(mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, mCnt: cute.Tensor, slot: Int32,
             mT: cute.Tensor, mE: cute.Tensor, stream):  # fmt: skip
        kernel(mW, mX, mY, mCnt, slot, mT, mE).launch(
            grid=[grid, 1, 1],
            block=[CONSUMERS + 32 * extra_warps, 1, 1],
            smem=smem,
            stream=stream,
        )

    return host


def compile_chain(phases: tuple[Phase, ...], grid: int, x_len: int, **kw: Any) -> Any:
    """Compile once; call as f(W_packed_bf16, x_bf16, Y, counters_i32[2, `counter_words`],
    slot, trace_i32[TRACE_LEN], epoch_i32[2]) for L = `layers` layers. Y: fp32 outputs, or
    with sync="flags" one int64 {fp32 value, int32 flag} word per output (the epoch is then
    read and advanced)."""
    layers = kw.get("layers", 1)
    n_w = w_offsets(phases)[-1] * layers
    n_y = y_offsets(phases)[-1] * layers
    n_cnt = counter_words(layers * len(phases), kw.get("dynamic", False), kw.get("spacing", 1))
    args = [
        fake(BFloat16, (n_w,)),
        fake(BFloat16, (x_len,)),
        fake(Int64 if kw.get("sync") == "flags" else Float32, (n_y,)),
        fake(Int32, (2, n_cnt)),
        Int32(0),
        fake(Int32, (TRACE_LEN,)),
        fake(Int32, (2,)),
    ]
    return compile_tvm_ffi(build(phases, grid, x_len, **kw), *args)

"""Waits of the persistent GEMV chain (`stream_chain.py`): mbarrier waits, grid counters and
flagged-word polls, each under a watchdog.

Why a watchdog: a persistent kernel whose grid waits on itself hangs the GPU on any protocol
bug; every wait here gives up after WATCHDOG polls and flags the trace buffer instead
(mT[WATCH + code] = 1 + CTA), so a stuck pipeline ends with a report, not a hung device.
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernels' annotations at trace time.

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from benchmarks.kernels.research.cute.chain_trace import WATCH
from benchmarks.kernels.research.cute.flagged import ld_flagged2, ld_relaxed_kept


@dataclass(frozen=True)
class Counters:
    """How the grid's counters are laid out and polled (compile-time): `sync` "red"
    (arrival by red.release, polls by ld.acquire) or "atomic" (fence + atom.release, polls by
    atom.add 0); `polls` staggered loads in flight per wait (`poll_staggered`); `spacing` int32
    words from one counter to the next (32: each in its own 128-byte line); `gap` ns of sleep
    between polls."""

    sync: str = "red"
    polls: int = 1
    spacing: int = 1
    gap: int = 0

    def words(self, counters: int) -> int:
        """The int32 words that `counters` counters take."""
        return counters * self.spacing


POLL_GAP_NS = 100  # between staggered polls: a fraction of a loaded round trip (0.2-3 us)
WATCHDOG = 1 << 22  # polls before a wait gives up and reports (mT[WATCH + code] = 1 + bidx)


@cute.jit
def tick(n, state):
    """Count one more poll; past WATCHDOG polls the wait gives up (state 2)."""
    n = n + 1
    if n > WATCHDOG:
        state = Int32(2)
    return n, state


@cute.jit
def report_stuck(state, mT: cute.Tensor, code: cutlass.Constexpr, bidx):
    """A wait that gave up flags the trace buffer: mT[WATCH + code] = 1 + CTA."""
    if state == 2:
        mT[WATCH + code] = bidx + 1


@cute.jit
def poll(probe: cutlass.Constexpr, where, arg, mT: cute.Tensor, code: cutlass.Constexpr, bidx,
         gap: cutlass.Constexpr = 0):  # fmt: skip
    """Poll until `probe` succeeds: "test" / "try_nohint" (mbarrier `where`, parity `arg`) or
    "count" / "load" (global counter pointer `where` >= `arg`: atom.add 0 / ld, acquire);
    `gap` > 0: sleep that many ns after a failed poll (fewer polls queue at the counter's L2
    slice, where the arrivals land).
    Gives up after WATCHDOG polls and writes 1 + bidx to mT[WATCH + code]: a stuck pipeline
    ends with a flag, not a hung GPU."""
    state = Int32(0)
    n = Int32(0)
    while state == 0:
        if cutlass.const_expr(probe == "test"):
            if cute.arch.mbarrier_test_wait(where, arg):
                state = Int32(1)
        elif cutlass.const_expr(probe == "try_nohint"):
            if cute.arch.mbarrier_try_wait(where, arg):
                state = Int32(1)
        elif cutlass.const_expr(probe == "load"):
            if cute.arch.load(where, Int32, sem="acquire", scope="gpu") >= arg:
                state = Int32(1)
        else:
            if cute.arch.atomic_add(where, Int32(0), sem="acquire", scope="gpu") >= arg:
                state = Int32(1)
        if cutlass.const_expr(gap > 0):  # noqa: SIM102 (compile time, then runtime)
            if state == 0:
                nvvm.nanosleep(gap)
        n, state = tick(n, state)
    report_stuck(state, mT, code, bidx)


@cute.jit
def _look_again(v, arg, state, where):
    """One staggered poll: note whether `v` reached `arg`, then reissue its load."""
    if v >= arg:
        state = Int32(1)
    return ld_relaxed_kept(where), state


@cute.jit
def poll_staggered(where, arg, depth: cutlass.Constexpr, gap_ns: cutlass.Constexpr,
                   mT: cute.Tensor, code: cutlass.Constexpr, bidx):  # fmt: skip
    """Poll the global counter `where` until it reaches `arg` with `depth` relaxed loads in
    flight, issued `gap_ns` apart; the caller's fence then acquires.

    Why: a lone poll sees an arrival only with its next round trip, 1.5 round trips after it
    lands on average, and a round trip under the weight stream is 0.2-3 us (a probe, NOTES.md),
    on every phase boundary's critical path. Staggered loads in flight cut that to about one
    return trip plus the gap. Measured slower (NOTES.md: +1.8 / +3.3 us per layer with 2 / 4
    in flight): the polls queue at the counter's L2 line with the arrivals they wait for; a
    sleep between single polls (`poll`'s `gap`) is what helped."""
    vals = [ld_relaxed_kept(where)]
    for _ in cutlass.range_constexpr(depth - 1):
        nvvm.nanosleep(gap_ns)
        vals.append(ld_relaxed_kept(where))
    v0, v1, v2, v3 = (vals + vals[:1] * 3)[:4]
    state = Int32(0)
    n = Int32(0)
    while state == 0:
        # the oldest load first; each is reissued as soon as it has been looked at
        v0, state = _look_again(v0, arg, state, where)
        if cutlass.const_expr(depth > 1):
            v1, state = _look_again(v1, arg, state, where)
        if cutlass.const_expr(depth > 2):
            v2, state = _look_again(v2, arg, state, where)
        if cutlass.const_expr(depth > 3):
            v3, state = _look_again(v3, arg, state, where)
        n, state = tick(n, state)
    report_stuck(state, mT, code, bidx)


@cute.jit
def mwait(bar, parity, kind: cutlass.Constexpr, mT: cute.Tensor, code: cutlass.Constexpr, bidx):
    """Wait for the mbarrier phase of `parity`: "try" lets the hardware suspend the thread
    (mbarrier.try_wait's time hint, what cute.arch.mbarrier_wait emits); "test" spins and
    "try_nohint" polls try_wait without a hint, both under the watchdog (`poll`)."""
    if cutlass.const_expr(kind == "try"):
        cute.arch.mbarrier_wait(bar, parity)
    else:
        poll(kind, bar, parity, mT, code, bidx)


@cute.jit
def wait_count(mCnt: cute.Tensor, idx, target, mT: cute.Tensor, code: cutlass.Constexpr, bidx,
                cs: cutlass.Constexpr):  # fmt: skip
    """Spin (one thread) until counter `idx` (laid out and polled as `cs`, a `Counters`)
    reaches `target`, then acquire: the writes released before the arrivals are visible to
    this CTA after its next barrier."""
    ptr = (mCnt.iterator + idx * cs.spacing).llvm_ptr
    if cutlass.const_expr(cs.polls > 1):
        poll_staggered(ptr, target, cs.polls, POLL_GAP_NS, mT, code, bidx)
    else:
        poll("load" if cs.sync == "red" else "count", ptr, target, mT, code, bidx, cs.gap)
    cute.arch.fence_acq_rel_gpu()


@cute.jit
def arrive_count(mCnt: cute.Tensor, idx, cs: cutlass.Constexpr):
    """One thread adds this CTA's arrival to counter `idx` (`cs` as in `wait_count`),
    releasing the CTA's writes (which the preceding named barrier ordered before this
    thread's): red.release needs no reply."""
    ptr = (mCnt.iterator + idx * cs.spacing).llvm_ptr
    if cutlass.const_expr(cs.sync == "red"):
        cute.arch.red(ptr, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
    else:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add(ptr, Int32(1), sem="release", scope="gpu")


@cute.jit
def wait_flagged(mY: cute.Tensor, y0: cutlass.Constexpr, n: cutlass.Constexpr, flag, lane,
                  mT: cute.Tensor, code: cutlass.Constexpr, bidx):  # fmt: skip
    """A whole warp polls until the n flagged words from y0 all carry `flag`."""
    done = Int32(0)
    polls = Int32(0)
    while done == 0:
        ok = Int32(1)
        for i in cutlass.range_constexpr((n // 2 + 31) // 32):
            pair = lane + 32 * i
            if pair < n // 2:
                _, fa, _, fb = ld_flagged2((mY.iterator + (y0 + 2 * pair)).llvm_ptr)
                ok = ok & Int32(fa == flag) & Int32(fb == flag)
        done = Int32(cute.arch.vote_all_sync(ok == 1))
        polls = polls + 1
        if polls > WATCHDOG:
            mT[WATCH + code] = bidx + 1
            done = Int32(1)

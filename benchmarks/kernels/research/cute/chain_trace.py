"""The trace buffer of the persistent GEMV chain (`stream_chain.py`) and what writes into it.

Why a buffer of %globaltimer stamps: the chain's cost lies between its phases (who waits for
whom, for how long), which a kernel-level profiler does not show; CTA 0 stamps its ring
positions and phase boundaries, every CTA its units-done times, and an optional probe warp
times L2 round trips while the weight stream runs (NOTES.md).
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernels' annotations at trace time.

import cutlass
import cutlass.cute as cute
from cutlass import Int32

TRACE_LEN = 16384  # int32 stamps: issue / filled / released per ring position (< 1024), phases
# (3072 + p: input ready, 3136 + p: arrived, 3200 + p: input staged, 3264 + p: units done)
CTA_STAMPS = 4096  # every CTA's units-done time of phases p < 15 at 4096 + 16 CTA + p, entry + 15
PROBE = 8192  # CTA 0's probe warp: (start, round trip) ns of dependent L2 loads, in pairs
PROBE_SAMPLES = 2048
PROBE_WORD = PROBE + 2 * PROBE_SAMPLES  # the word it loads (never written: an L2 hit)
PROBE_NS = 90_000  # the probe stops after this long (the kernel waits for it)
WATCH = 4080  # watchdog flags: mT[WATCH + code] = 1 + CTA of a wait that gave up


@cute.jit
def stamp(on: cutlass.Constexpr, mT: cute.Tensor, idx):
    if cutlass.const_expr(on):
        mT[idx] = cute.arch.globaltimer_lo()


TRACE_POSITIONS = 1024  # ring positions CTA 0 stamps (issue, filled, released: 3 x 1024 slots)


@cute.jit
def stamp_position(on: cutlass.Constexpr, mT: cute.Tensor, kind: cutlass.Constexpr, pos, bidx):
    """CTA 0's stamp of ring position `pos`: kind 0 issued, 1 filled, 2 released."""
    if cutlass.const_expr(on):  # noqa: SIM102 (compile time, then runtime)
        if bidx == 0 and pos < TRACE_POSITIONS:
            mT[kind * TRACE_POSITIONS + pos] = cute.arch.globaltimer_lo()


@cute.jit
def probe_l2(mT: cute.Tensor, mY: cute.Tensor, where: cutlass.Constexpr, n_y: cutlass.Constexpr):
    """Time dependent GPU-scope loads while the weight stream runs: the round trip every
    phase input pays in a persistent kernel. `where`: "word" (one L2-resident word, again and
    again) or "y" (the output words, a new line each time, as a phase input reads them)."""
    start = cute.arch.globaltimer_lo()
    now = start
    i = Int32(0)
    while i < PROBE_SAMPLES and now - start < PROBE_NS:
        t0 = cute.arch.globaltimer_lo()
        ptr = (mT.iterator + PROBE_WORD).llvm_ptr
        if cutlass.const_expr(where == "y"):
            ptr = (mY.iterator + (i * 97 * 16) % n_y).llvm_ptr  # 97 lines apart, cycling
        v = cute.arch.load(ptr, Int32, sem="relaxed", scope="gpu")
        if v != 0:  # never true; the branch makes the next stamp wait for the load
            mT[WATCH + 15] = v
        now = cute.arch.globaltimer_lo()
        mT[PROBE + 2 * i] = t0
        mT[PROBE + 2 * i + 1] = now - t0
        i = i + 1

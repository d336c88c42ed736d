"""Bulk L2 prefetch: keep HBM streaming across kernel boundaries (kernel version 15).

Measured (NOTES.md, session 3): a kernel boundary costs ~2.7 us of HBM time, and a batch-1
kernel that walks work items with one round of loads in flight per item runs at half the read
ceiling. `cp.async.bulk.prefetch.L2.global` hands the copy engine (TMA) a byte range in one
instruction: HBM fills L2 at its own pace while the threads go on, and the demand loads that
follow hit L2 or a fill already in flight. Weights are constants, so a kernel can request its
own slice before its PDL wait and, near its end, a share of what the next kernels will read.

Where the ranges are requested is traced into the kernels ($AGENTAB_KERNELS_L2, read at trace
time like the PDL mode): "end" (default) requests the look-ahead ranges after the CTA's own
work (its tail, where the HBM would idle), "start" before it, "own" none (own slice only).
"""

import os

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

L2_ENV = "AGENTAB_KERNELS_L2"
L2_MODES = ("end", "start", "own")


def l2_mode() -> str:
    """Where the look-ahead prefetches go: "end", "start" or "own" (none)."""
    raw = os.environ.get(L2_ENV, "end").strip() or "end"
    if raw not in L2_MODES:
        raise ValueError(f"${L2_ENV}: {raw!r} is not one of {', '.join(L2_MODES)}")
    return raw


@dsl_user_op
def prefetch_l2(addr: Int64, nbytes: Int32, *, loc=None, ip=None) -> None:
    """`cp.async.bulk.prefetch.L2.global [addr], nbytes`: addr 16-byte aligned, nbytes a
    multiple of 16 (best effort: the hardware may drop it, never faults on a valid range)."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


PIECE = 1 << 16  # bytes per prefetch instruction (a CTA's share is cut into these)


@cute.jit
def prefetch_range(addr: Int64, nbytes: Int64):
    """Prefetch [addr, addr + nbytes) in PIECE-sized instructions (one thread calls this)."""
    n_pieces = (nbytes + PIECE - 1) // PIECE
    for i in range(n_pieces):
        left = nbytes - i * PIECE
        size = Int64(PIECE)
        if left < PIECE:
            size = left
        prefetch_l2(addr + i * PIECE, Int32(size))


@cute.jit
def prefetch_share(addr: Int64, nbytes: Int64, part, parts: int):
    """Prefetch this part's 1/`parts` of the range [addr, addr + nbytes) (nbytes a multiple
    of 16; parts a compile-time count, part this CTA's index). One thread per CTA calls it."""
    per = ((nbytes + parts * 16 - 1) // (parts * 16)) * 16
    lo = Int64(part) * per
    if lo < nbytes:
        size = per
        if nbytes - lo < per:
            size = nbytes - lo
        prefetch_range(addr + lo, size)


@cute.jit
def prefetch_ahead(a0: Int64, n0: Int64, a1: Int64, n1: Int64, part, parts: int):
    """This CTA's share of the two look-ahead ranges (a, n) given as kernel arguments (n = 0:
    none); the host fills them with the next kernels' weights."""
    if n0 > 0:
        prefetch_share(a0, n0, part, parts)
    if n1 > 0:
        prefetch_share(a1, n1, part, parts)


def ahead_fakes() -> list:
    """The four scalar arguments of the look-ahead ranges, for compiling."""
    return [Int64(0), Int64(0), Int64(0), Int64(0)]

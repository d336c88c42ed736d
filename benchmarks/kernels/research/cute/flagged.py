"""Values that carry their own ready flag: 8-byte {fp32 value, int32 flag} words (LL protocol).

Why: a grid barrier between two phases of a persistent kernel costs a release (the writing
CTA's stores must be acknowledged before its arrival counts) and then a poll and a second read
of the data, each a round trip through an L2 that a saturating weight stream keeps queued
(several microseconds per phase, `benchmarks/kernels/research/stream_chain_run.py`). When
every value is written together with the launch's flag in one 64-bit store, which is
single-copy atomic, a reader that sees the flag also sees the value: no fence, no counter, one
round trip. NCCL's LL protocol does the same for the same reason.

Both accesses are relaxed at GPU scope: they bypass the non-coherent L1 and the compiler keeps
every poll. Not `.volatile`: that is system scope (LDG.STRONG.SYS), and such loads took 5-8 us
under the weight stream where GPU-scope ones take ~0.3 us (NOTES.md).
"""

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result, operands: list, text: str, constraints: str, loc, ip):
    """Inline PTX with side effects, so the compiler keeps every poll and store."""
    return llvm.inline_asm(
        result,
        operands,
        text,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_flagged(ptr, value: Float32, flag: Int32, *, loc=None, ip=None) -> None:
    """Store {value, flag} as one 64-bit word at the 8-byte aligned global pointer `ptr`."""
    bits = llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    _asm(
        None,
        [ptr, bits, Int32(flag).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b64 w;\n\tmov.b64 w, {$1, $2};\n\tst.relaxed.gpu.global.b64 [$0], w;\n\t}",
        "l,r,r",
        loc,
        ip,
    )


@dsl_user_op
def ld_flagged2(ptr, *, loc=None, ip=None) -> tuple[Float32, Int32, Float32, Int32]:
    """Two consecutive flagged words from the 16-byte aligned global pointer `ptr`, in one
    16-byte load of two 64-bit elements (each element single-copy atomic):
    (value 0, flag 0, value 1, flag 1)."""
    words = _asm(
        llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()]),
        [ptr],
        "{\n\t.reg .b64 a, b;\n\tld.relaxed.gpu.global.v2.b64 {a, b}, [$4];\n\t"
        "mov.b64 {$0, $1}, a;\n\tmov.b64 {$2, $3}, b;\n\t}",
        "=r,=r,=r,=r,l",
        loc,
        ip,
    )
    parts = [llvm.extractvalue(T.i32(), words, [i], loc=loc, ip=ip) for i in range(4)]
    v0 = Float32(llvm.bitcast(T.f32(), parts[0], loc=loc, ip=ip))
    v1 = Float32(llvm.bitcast(T.f32(), parts[2], loc=loc, ip=ip))
    return v0, Int32(parts[1]), v1, Int32(parts[3])


@dsl_user_op
def ld_relaxed_kept(ptr, *, loc=None, ip=None) -> Int32:
    """A relaxed GPU-scope 32-bit load the compiler may neither merge with another nor drop:
    several polls of one word can then be in flight at once (`chain_sync.poll_staggered`;
    plain relaxed loads of the same address were merged into one)."""
    return Int32(_asm(T.i32(), [ptr], "ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy marking every line a copy brings in as evict-first (for bulk copies'
    `l2_cache_hint`): weights streamed once should not displace the counters and outputs."""
    return Int64(
        _asm(T.i64(), [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l", loc, ip)
    )

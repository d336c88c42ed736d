"""The MLA step preparation as a kernel of its own (one CTA of 128 threads per token).

The decode path runs the same `mla_prep.prep_body` in extra CTAs of the absorbed-query GEMV
instead, one launch fewer (benchmarks/kernels/NOTES.md has both timed); this stand-alone form
is kept to time the two against each other.
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentab.kernels.cute.common import compile_tvm_ffi, fake
from agentab.kernels.cute.mla_prep import PrepSpec, check_prep, prep_body
from agentab.kernels.cute.pdl import pdl_done, pdl_wait

THREADS = 128


def build_prep(spec: PrepSpec) -> Any:
    check_prep(spec, THREADS)

    @cute.kernel
    def kernel(mQkv: cute.Tensor, mQ: cute.Tensor, mPos: cute.Tensor, mNorm: cute.Tensor,
               mCS: cute.Tensor, mCache: cute.Tensor, mQpe: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        alloc = cutlass.memory.SmemAllocator()
        red = alloc.allocate_tensor(Float32, cute.make_layout(THREADS // 32), byte_alignment=16)
        pdl_wait()
        prep_body(spec, THREADS, b, tidx, mQkv, mQ, mPos, mNorm, mCS, mCache, mQpe, red)
        pdl_done()

    @cute.jit
    def host(mQkv: cute.Tensor, mQ: cute.Tensor, mPos: cute.Tensor, mNorm: cute.Tensor,
             mCS: cute.Tensor, mCache: cute.Tensor, mQpe: cute.Tensor, stream):  # fmt: skip
        kernel(mQkv, mQ, mPos, mNorm, mCS, mCache, mQpe).launch(
            grid=[spec.batch, 1, 1], block=[THREADS, 1, 1], smem=64, stream=stream, use_pdl=True
        )

    return host


def compile_prep(spec: PrepSpec) -> Any:
    """f(qkv, q, positions, kv_a_norm, cos_sin, cache, q_pe_out) with torch tensors."""
    b, kvl, rope = spec.batch, spec.kv_lora, spec.rope
    return compile_tvm_ffi(
        build_prep(spec),
        fake(BFloat16, (b, spec.q_lora + kvl + rope)),
        fake(BFloat16, (b, spec.n_heads * (spec.qk_nope + rope))),
        fake(Int32, spec.positions_shape()),
        fake(BFloat16, (kvl,)),
        fake(Float32, (spec.max_pos, rope)),
        fake(BFloat16, spec.cache_shape()),
        fake(BFloat16, (b, spec.n_heads, rope)),
    )

"""Skinny GEMM for decode (M <= 8 tokens): y[m, n] = sum_k W[n, k] x[m, k], 128-bit weight loads.

At decode batch sizes a projection is a weight stream: every weight byte is used M times, so the
kernel is built to keep HBM busy. `LPR` lanes share one weight row (LPR = 32 for K >= 256), each
lane loads 16 bytes (8 bf16) per chunk, the chunk loop is unrolled at compile time so many loads
are in flight, and the first chunks of the weight rows are loaded before `griddepcontrol.wait`
(PDL): weights do not depend on the previous kernel, so they stream while it drains.

Fusions, chosen at compile time:
- `norm`: RMSNorm of the input rows in the prologue (sum of squares accumulated alongside the dot
  product, gamma applied to x, 1/rms applied to the result): input norm + projection in one kernel.
- `resid`: y = r + W x in the epilogue (output projection + residual add).
- `groups`: a batched GEMV, group g of rows reads its own slice of x (absorbed MLA projections).
- `out_f32`: fp32 output (router logits).
The input X is read from global memory (L1/L2: it is tiny and shared by the CTA's warps).
"""

# No `from __future__ import annotations` here: CuTe DSL reads the kernels' annotations at trace
# time, so `cute.Tensor` must be a real object. This module therefore needs the gpu extra.
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from agentab.kernels.cute.common import compile_tvm_ffi, fake
from agentab.kernels.cute.mla_prep import PrepSpec, check_prep, prep_body, prep_fakes
from agentab.kernels.cute.pdl import pdl_done, pdl_wait

N_SMS = 132


@dataclass(frozen=True)
class GemvSpec:
    """One projection's shapes and fusions; every field is a compile-time constant."""

    n: int  # output rows (all groups together)
    k: int  # reduction length of one row
    m: int  # tokens (1..8)
    x_cols: int  # columns of X (its row stride)
    out_cols: int  # columns of Y (its row stride)
    x_offset: int = 0  # column of X where group 0's input starts
    x_group_stride: int = 0  # columns between two groups' inputs
    groups: int = 1
    out_offset: int = 0  # column of Y where row 0 goes
    norm: bool = False
    resid: bool = False
    out_f32: bool = False
    write_rs: bool = False  # with norm: also write 1/rms per token (fp32) for a later kernel
    eps: float = 1e-6

    @property
    def lanes_per_row(self) -> int:
        return min(32, self.k // 8)

    def validate(self) -> None:
        lpr = self.lanes_per_row
        if self.k % 8 or self.k % (8 * lpr) or 32 % lpr:
            raise ValueError(f"k={self.k}: needs a multiple of 8 lanes x 8 values")
        if self.x_offset % 8 or self.x_group_stride % 8:
            raise ValueError("x offsets must be multiples of 8 (16-byte loads)")
        if self.n % self.groups:
            raise ValueError("n must split into equal groups")
        if self.norm and self.groups != 1:
            raise ValueError("norm needs groups == 1")
        if not 1 <= self.m <= 8:
            raise ValueError(f"m={self.m}: the SIMT GEMV serves 1..8 tokens")


@cute.jit
def zeroed_accumulators(rows: cutlass.Constexpr, m_tok: cutlass.Constexpr) -> tuple:
    """The GEMV's fp32 registers, zeroed: `acc` (rows x tokens dot products) and `ss` (the
    per-token sum of squares a fused RMSNorm needs). Called inside a traced kernel."""
    acc = cute.make_rmem_tensor(cute.make_layout(rows * m_tok), Float32)
    ss = cute.make_rmem_tensor(cute.make_layout(m_tok), Float32)
    for i in cutlass.range_constexpr(rows * m_tok):
        acc[i] = Float32(0.0)
    for i in cutlass.range_constexpr(m_tok):
        ss[i] = Float32(0.0)
    return acc, ss


def plan(spec: GemvSpec) -> tuple[int, int, int]:
    """(row warps, k-split warps, rows unrolled per row slot) for one CTA.

    K is split across `ksplit` warps when a row has many chunks (at most 8 chunks per warp keeps
    enough loads in flight per row); then as many CTAs as possible, at least two per SM.
    """
    lpr = spec.lanes_per_row
    rs = 32 // lpr
    ch = spec.k // (8 * lpr)
    ksplit = 1
    for cand in (1, 2, 4, 7, 8):
        if ch % cand == 0 and cand <= 8:
            ksplit = cand
            if ch // cand <= 8:
                break
    best: tuple[int, int, int] | None = None
    best_ctas = 0
    for total in (8, 4):
        if total % ksplit and ksplit <= total:
            continue
        rw = max(1, total // ksplit)
        for unroll in (2, 1):
            rows = rw * rs * unroll
            if spec.n % rows:
                continue
            ctas = spec.n // rows
            if ctas >= 2 * N_SMS:
                return rw, ksplit, unroll
            if ctas > best_ctas:
                best, best_ctas = (rw, ksplit, unroll), ctas
    if best is None:
        raise ValueError(f"n={spec.n}: no CTA shape divides it")
    return best


def build_gemv(spec: GemvSpec, prep: PrepSpec | None = None) -> Any:
    """Trace the kernel for `spec`; returns the @cute.jit host function.

    With `prep` (a `mla_prep.PrepSpec`), `prep.batch` extra CTAs after the GEMV's own do the
    MLA step preparation (`mla_prep.prep_body`): the absorbed-query GEMV and the cache write /
    RoPE then share one launch, since both only need q_b's output.
    """
    spec.validate()
    lpr = spec.lanes_per_row
    rs = 32 // lpr
    ch_all = spec.k // (8 * lpr)
    rw, ksplit, unroll = plan(spec)
    ch = ch_all // ksplit
    warps = rw * ksplit
    rows_cta = rw * rs * unroll
    rows_group = spec.n // spec.groups
    m_tok, n_rows = spec.m, spec.n
    prefetch = min(ch, 8)
    out_t = Float32 if spec.out_f32 else BFloat16
    inv_k = 1.0 / spec.k
    n_out = rows_cta * m_tok
    smem_bytes = 4 * (n_out * ksplit + m_tok * ksplit) + 64

    @cute.jit
    def body(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
             mY: cute.Tensor, mRs: cute.Tensor, red: cute.Tensor, red_ss: cute.Tensor,
             tidx, bidx):  # fmt: skip
        lane = tidx % 32
        warp = tidx // 32
        wrow = warp // ksplit
        kpart = warp % ksplit
        sub = lane // lpr
        lq = lane % lpr
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        row0 = bidx * rows_cta + wrow * (rs * unroll) + sub
        c0 = kpart * ch

        # Weight chunks are independent of the previous kernel: issue the first ones before the
        # PDL wait so they stream while it drains.
        wfr = []
        for r in cutlass.range_constexpr(unroll):
            for c in cutlass.range_constexpr(prefetch):
                src = cute.local_tile(mW[row0 + r * rs, None], (8,), ((c0 + c) * lpr + lq,))
                frag = cute.make_fragment_like(src)
                cute.copy(atom, src, frag)
                wfr.append(frag)
        pdl_wait()

        acc, ss = zeroed_accumulators(unroll, m_tok)
        group = row0 // rows_group
        xbase = (spec.x_offset + group * spec.x_group_stride) // 8
        for c in cutlass.range_constexpr(ch):
            kc = (c0 + c) * lpr + lq
            wv = []
            for r in cutlass.range_constexpr(unroll):
                if cutlass.const_expr(c < prefetch):
                    wv.append(wfr[r * prefetch + c].load().to(Float32))
                else:
                    src = cute.local_tile(mW[row0 + r * rs, None], (8,), (kc,))
                    frag = cute.make_fragment_like(src)
                    cute.copy(atom, src, frag)
                    wv.append(frag.load().to(Float32))
            if cutlass.const_expr(spec.norm):
                gsrc = cute.local_tile(mG, (8,), (kc,))
                gfr = cute.make_fragment_like(gsrc)
                cute.copy(atom, gsrc, gfr)
                gv = gfr.load().to(Float32)
            for t in cutlass.range_constexpr(m_tok):
                xsrc = cute.local_tile(mX[t, None], (8,), (xbase + kc,))
                xfr = cute.make_fragment_like(xsrc)
                cute.copy(atom, xsrc, xfr)
                xv = xfr.load().to(Float32)
                if cutlass.const_expr(spec.norm):
                    ss[t] = ss[t] + (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    xv = xv * gv
                for r in cutlass.range_constexpr(unroll):
                    part = (wv[r] * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    acc[r * m_tok + t] = acc[r * m_tok + t] + part
        # Reduce within the lanes of a row, then across the k-split warps through shared memory.
        for t in cutlass.range_constexpr(m_tok):
            if cutlass.const_expr(spec.norm):
                tot = cute.arch.warp_reduction_sum(ss[t], threads_in_group=lpr)
                if wrow == 0 and lane == 0:
                    red_ss[t * ksplit + kpart] = tot
            for r in cutlass.range_constexpr(unroll):
                v = cute.arch.warp_reduction_sum(acc[r * m_tok + t], threads_in_group=lpr)
                if lq == 0:
                    rl = wrow * (rs * unroll) + r * rs + sub
                    red[(rl * m_tok + t) * ksplit + kpart] = v
        cute.arch.sync_threads()
        if tidx < n_out:
            rl = tidx // m_tok
            t = tidx % m_tok
            v = Float32(0.0)
            for p in cutlass.range_constexpr(ksplit):
                v = v + red[tidx * ksplit + p]
            if cutlass.const_expr(spec.norm):
                tot = Float32(0.0)
                for p in cutlass.range_constexpr(ksplit):
                    tot = tot + red_ss[t * ksplit + p]
                scale = cute.math.rsqrt(tot * Float32(inv_k) + Float32(spec.eps))
                v = v * scale
                if cutlass.const_expr(spec.write_rs):  # noqa: SIM102 (compile-time, then runtime)
                    if bidx == 0 and rl == 0:
                        mRs[t] = scale
            row = bidx * rows_cta + rl
            if cutlass.const_expr(spec.resid):
                v = v + mR[t, row].to(Float32)
            mY[t, spec.out_offset + row] = v.to(out_t)

    gemv_ctas = n_rows // rows_cta
    if prep is None:

        @cute.kernel
        def kernel(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
                   mY: cute.Tensor, mRs: cute.Tensor):  # fmt: skip
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            alloc = cutlass.memory.SmemAllocator()
            red = alloc.allocate_tensor(
                Float32, cute.make_layout(n_out * ksplit), byte_alignment=16
            )
            red_ss = alloc.allocate_tensor(
                Float32, cute.make_layout(m_tok * ksplit), byte_alignment=16
            )
            body(mW, mX, mG, mR, mY, mRs, red, red_ss, tidx, bidx)
            pdl_done()

        @cute.jit
        def host(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
                 mY: cute.Tensor, mRs: cute.Tensor, stream):  # fmt: skip
            kernel(mW, mX, mG, mR, mY, mRs).launch(
                grid=[gemv_ctas, 1, 1],
                block=[32 * warps, 1, 1],
                smem=smem_bytes,
                stream=stream,
                use_pdl=True,
            )

        return host

    check_prep(prep, 32 * warps)

    @cute.kernel
    def kernel_prep(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
                    mY: cute.Tensor, mRs: cute.Tensor, mQkv: cute.Tensor, mPos: cute.Tensor,
                    mNorm: cute.Tensor, mCS: cute.Tensor, mCache: cute.Tensor,
                    mQpe: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        alloc = cutlass.memory.SmemAllocator()
        red = alloc.allocate_tensor(Float32, cute.make_layout(n_out * ksplit), byte_alignment=16)
        red_ss = alloc.allocate_tensor(Float32, cute.make_layout(m_tok * ksplit), byte_alignment=16)
        red_p = alloc.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
        if bidx < gemv_ctas:
            body(mW, mX, mG, mR, mY, mRs, red, red_ss, tidx, bidx)
        else:
            pdl_wait()
            prep_body(prep, 32 * warps, bidx - gemv_ctas, tidx, mQkv, mX, mPos, mNorm, mCS,
                      mCache, mQpe, red_p)  # fmt: skip
        pdl_done()

    @cute.jit
    def host_prep(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
                  mY: cute.Tensor, mRs: cute.Tensor, mQkv: cute.Tensor, mPos: cute.Tensor,
                  mNorm: cute.Tensor, mCS: cute.Tensor, mCache: cute.Tensor, mQpe: cute.Tensor,
                  stream):  # fmt: skip
        kernel_prep(mW, mX, mG, mR, mY, mRs, mQkv, mPos, mNorm, mCS, mCache, mQpe).launch(
            grid=[gemv_ctas + prep.batch, 1, 1],
            block=[32 * warps, 1, 1],
            smem=smem_bytes + 4 * warps + 64,
            stream=stream,
            use_pdl=True,
        )

    return host_prep


def compile_gemv(spec: GemvSpec, prep: PrepSpec | None = None) -> Any:
    """Compile once for `spec`; call as f(W, X, gamma, resid, Y, rs) with torch tensors.

    Unused gamma / resid / rs take any small tensor of the declared shape (see `dummy_shapes`).
    """
    g_len = spec.k if spec.norm else 8
    r_shape = (spec.m, spec.n) if spec.resid else (1, 8)
    args = [
        fake(BFloat16, (spec.n, spec.k)),
        fake(BFloat16, (spec.m, spec.x_cols)),
        fake(BFloat16, (g_len,)),
        fake(BFloat16, r_shape),
        fake(Float32 if spec.out_f32 else BFloat16, (spec.m, spec.out_cols)),
        fake(Float32, (spec.m,)),
    ]
    if prep is not None:
        args += prep_fakes(prep)
    return compile_tvm_ffi(build_gemv(spec, prep), *args, key=(spec, prep))


def dummy_shapes(spec: GemvSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the gamma and resid arguments the compiled kernel expects."""
    return ((spec.k if spec.norm else 8,), (spec.m, spec.n) if spec.resid else (1, 8))

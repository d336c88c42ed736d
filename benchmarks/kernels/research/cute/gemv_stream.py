"""Streaming GEMV for the large dense projections at batch 1..4 (kernel version 10).

`gemv.py` holds a CTA's weights in registers: 14 loads of 16 bytes per lane at most, so a
30 MB projection needs 528 CTAs in two waves, and only the first wave's loads are in flight
before the PDL wait. Here every thread streams its own chunks through a private ring of
`stages` 16-byte slots in shared memory with `cp.async`: the first `stages` chunks (up to 40
per thread) are requested before `griddepcontrol.wait`, and the slot a thread has just consumed
is refilled with its chunk `stages` further on. The rings leave L1 room for x and gamma, which
every warp re-reads (`ring_budget`); a warp's rows share each x chunk (chunk-major order). A
thread reads back only what it copied itself, so `cp.async.wait_group` is the only
synchronisation: no barrier.

Each warp owns whole rows (the full K), so the RMSNorm's sum of squares and the dot products
reduce within the warp: no shared-memory reduction either. The grid is one wave (two or three
CTAs per SM, spread evenly). Used for the specs `stream_plan` accepts (K a multiple of 256,
one group); the router (384 rows) and the grouped MLA projections keep `gemv.py`.
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
import math
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from agentab.kernels.cute.common import carveout_for, compile_tvm_ffi, fake
from agentab.kernels.cute.gemv import GemvSpec, zeroed_accumulators
from agentab.kernels.cute.pdl import pdl_done, pdl_wait

N_SMS = 132
MAX_STAGES = 40
SMEM_PER_SM = 200 * 1024  # what the rings of the CTAs on one SM may take at most
SM_CACHE = 256 * 1024  # shared memory + L1 per SM
MIN_REGS = 96  # per thread, so m = 4 tokens' accumulators and x chunks fit without spills


def ring_budget(spec: GemvSpec) -> int:
    """Shared memory per SM the rings may take: what leaves x and gamma (m + 1 rows of K bf16,
    re-read by every warp) room in L1 with half again as slack, plus 8 KB per SM reserved."""
    l1_need = (spec.m + 1) * spec.k * 2 * 3 // 2
    return min(SMEM_PER_SM, SM_CACHE - 28 * 1024 - l1_need)


def stream_plan(spec: GemvSpec) -> tuple[int, int, int] | None:
    """(warps per CTA, rows per warp, ring stages) or None when the spec does not suit.

    Among the shapes whose CTAs all fit on the GPU at once, the one whose busiest SM carries
    the least more than the average (grid spread over 132 SMs), then the one with the most
    bytes in flight per SM (ring slots of all its CTAs), then the most rows per warp, then the
    fewest CTAs.
    """
    if spec.k % 256 or spec.groups != 1 or spec.m > 4 or spec.x_offset % 8:
        return None
    ch = spec.k // 256
    budget = ring_budget(spec)
    best: tuple[tuple[float, int, int, int], tuple[int, int, int]] | None = None
    for warps in (8, 7, 6, 4):
        for rw in (1, 2, 4):
            rows = warps * rw
            if spec.n % rows:
                continue
            grid = spec.n // rows
            per_sm = math.ceil(grid / N_SMS)
            regs = 65536 // (per_sm * 32 * warps) // 8 * 8  # registers a thread may use
            fit = (budget // per_sm - 256) // (16 * 32 * warps)  # ring slots a thread may have
            stages = min(MAX_STAGES, rw * ch, fit)
            if grid < N_SMS or stages < min(8, rw * ch) or regs < MIN_REGS:
                continue
            smem = stages * 16 * 32 * warps + 256
            imbalance = per_sm * N_SMS / grid
            # In-flight bytes in 32 KB steps; then more rows per warp (fewer x re-reads).
            key = (round(imbalance, 2), -(per_sm * smem // 32768), -rw, grid)
            if best is None or key < best[0]:
                best = (key, (warps, rw, stages))
    return None if best is None else best[1]


def build_gemv_stream(spec: GemvSpec) -> Any:
    """Trace the kernel for `spec` (see `stream_plan`); same arguments as `gemv.build_gemv`."""
    spec.validate()
    got = stream_plan(spec)
    if got is None:
        raise ValueError(f"{spec}: no streaming plan")
    warps, rw, stages = got
    threads = 32 * warps
    ch = spec.k // 256
    nch = rw * ch  # chunks per thread, chunk-major over its rows
    rows_cta = warps * rw
    grid = spec.n // rows_cta
    m_tok = spec.m
    out_t = Float32 if spec.out_f32 else BFloat16
    inv_k = 1.0 / spec.k
    smem_bytes = stages * 16 * threads + 256
    per_sm = math.ceil(grid / N_SMS)
    carveout = carveout_for(per_sm * (smem_bytes + 1024))

    @cute.kernel
    def kernel(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
               mY: cute.Tensor, mRs: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        alloc = cutlass.memory.SmemAllocator()
        ring = alloc.allocate_tensor(
            BFloat16, cute.make_layout(stages * threads * 8), byte_alignment=128
        )
        casync = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
            num_bits_per_copy=128,
        )  # fmt: skip
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        row0 = bidx * rows_cta + warp * rw
        slots = [cute.local_tile(ring, (8,), (s * threads + tidx,)) for s in range(stages)]
        # Weights are constants: the first `stages` chunks go out before the PDL wait.
        for i in cutlass.range_constexpr(stages):
            c, r = divmod(i, rw)
            src = cute.local_tile(mW[row0 + r, None], (8,), (c * 32 + lane,))
            cute.copy(casync, src, slots[i])
            cute.arch.cp_async_commit_group()
        pdl_wait()

        acc, ss = zeroed_accumulators(rw, m_tok)
        xbase = spec.x_offset // 8
        xs = []
        for i in cutlass.range_constexpr(nch):
            c, r = divmod(i, rw)  # chunk-major: one x (and gamma) chunk serves the warp's rows
            kc = c * 32 + lane
            if cutlass.const_expr(r == 0):
                xs = []
                for t in cutlass.range_constexpr(m_tok):
                    xsrc = cute.local_tile(mX[t, None], (8,), (xbase + kc,))
                    xfr = cute.make_fragment_like(xsrc)
                    cute.copy(atom, xsrc, xfr)
                    xs.append(xfr)
                if cutlass.const_expr(spec.norm):
                    gsrc = cute.local_tile(mG, (8,), (kc,))
                    gfr = cute.make_fragment_like(gsrc)
                    cute.copy(atom, gsrc, gfr)
            # Chunk i landed once at most (committed groups - i - 1) groups are still pending.
            cute.arch.cp_async_wait_group(min(stages, nch - i) - 1)
            wv = slots[i % stages].load().to(Float32)
            for t in cutlass.range_constexpr(m_tok):
                xv = xs[t].load().to(Float32)
                if cutlass.const_expr(spec.norm):
                    if cutlass.const_expr(r == 0):
                        ss[t] = ss[t] + (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    xv = xv * gfr.load().to(Float32)
                part = (wv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                acc[r * m_tok + t] = acc[r * m_tok + t] + part
            # The slot's value is consumed above; refill it with the chunk `stages` ahead.
            if cutlass.const_expr(i + stages < nch):
                c2, r2 = divmod(i + stages, rw)
                src = cute.local_tile(mW[row0 + r2, None], (8,), (c2 * 32 + lane,))
                cute.copy(casync, src, slots[i % stages])
                cute.arch.cp_async_commit_group()
        for t in cutlass.range_constexpr(m_tok):
            scale = Float32(1.0)
            if cutlass.const_expr(spec.norm):
                tot = cute.arch.warp_reduction_sum(ss[t])
                scale = cute.math.rsqrt(tot * Float32(inv_k) + Float32(spec.eps))
                if cutlass.const_expr(spec.write_rs):  # noqa: SIM102 (compile-time, then runtime)
                    if bidx == 0 and warp == 0 and lane == 0:
                        mRs[t] = scale
            for r in cutlass.range_constexpr(rw):
                v = cute.arch.warp_reduction_sum(acc[r * m_tok + t])
                if lane == 0:
                    v = v * scale
                    row = row0 + r
                    if cutlass.const_expr(spec.resid):
                        v = v + mR[t, row].to(Float32)
                    mY[t, spec.out_offset + row] = v.to(out_t)
        pdl_done()

    @cute.jit
    def host(mW: cute.Tensor, mX: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor,
             mY: cute.Tensor, mRs: cute.Tensor, stream):  # fmt: skip
        kernel(mW, mX, mG, mR, mY, mRs).launch(
            grid=[grid, 1, 1], block=[threads, 1, 1], smem=smem_bytes, stream=stream,
            use_pdl=True, min_blocks_per_mp=per_sm, preferred_smem_carveout=carveout,
        )  # fmt: skip

    return host


def compile_gemv_stream(spec: GemvSpec) -> Any:
    """Compile once for `spec`; called exactly as `gemv.compile_gemv`'s result."""
    g_len = spec.k if spec.norm else 8
    r_shape = (spec.m, spec.n) if spec.resid else (1, 8)
    return compile_tvm_ffi(
        build_gemv_stream(spec),
        fake(BFloat16, (spec.n, spec.k)),
        fake(BFloat16, (spec.m, spec.x_cols)),
        fake(BFloat16, (g_len,)),
        fake(BFloat16, r_shape),
        fake(Float32 if spec.out_f32 else BFloat16, (spec.m, spec.out_cols)),
        fake(Float32, (spec.m,)),
    )

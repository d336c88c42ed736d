"""moe_up on the tensor cores: the batch > 4 variant of the specialized MoE's first kernel.

Above batch 4 the SIMT moe_up is bound by instruction issue: per token and weight element it
converts, multiplies and reduces across lanes. Here the weights sit on the MMA M side
(`mma.sync.m16n8k16`, bf16 in, fp32 accumulate): an item is (segment of <= 8 tokens, block of
8 intermediate rows); A rows 0-7 are those gate rows and rows 8-15 the matching up rows, so one
thread ends with gate and up of the same row; B columns are the segment's tokens (columns past
its length hold a repeated token and are dropped). The 8 warps split the hidden dim (896
columns each, 28 steps of 32 columns; each lane streams 16 bytes of its gate row, its up row and
its token per step, `UNROLL` steps in flight), then sum their partials in shared memory.

Only the k order inside a step is ours to choose: a lane's 8 consecutive columns feed the k
slots {2c, 2c+1, 2c+8, 2c+9} of two MMAs (c = lane % 4), and its token's chunk feeds the same
slots of B, so each product pairs the same columns. The tokens arrive RMS-normalized (times
gamma) in bf16, as the path's router input; the routing prologue and the work list are the SIMT
kernel's (`moe_routing.route_and_publish`, shared expert first), so `moe_down` reads the same
lists.

CTA b takes items b, b + grid, ...: at any moment the grid streams neighbouring row blocks of
one expert; the weights bypass L1 (L1::no_allocate), which the tokens keep.
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentab.kernels.cute.common import carveout_for
from agentab.kernels.cute.moe_routing import (
    N_SMS,
    SEG,
    WARPS,
    MoeSpec,
    route_and_publish,
    routing_smem,
    routing_smem_bytes,
    up_host,
    weight_atom,
)
from agentab.kernels.cute.pdl import pdl_done, pdl_wait

RB = 8  # gate rows (and as many up rows) per item: the MMA's M = 16
STEP_COLS = 32  # columns per warp step: 4 lanes x 8
UNROLL = 14  # steps whose loads are in flight together (divides 28)
CTAS_PER_SM = 1  # one CTA of 8 warps per SM, each warp with UNROLL steps of loads in flight


def build_moe_up_mma(spec: MoeSpec) -> Any:
    """Trace the tensor-core moe_up (prenormalized tokens), one CTA per SM; its arguments are
    the SIMT `moe.build_moe_up`'s (`moe_routing.up_host`)."""
    grid = CTAS_PER_SM * N_SMS
    unroll, per_sm = UNROLL, CTAS_PER_SM
    hid, inter, k = spec.hidden, spec.inter, spec.top_k
    if SEG != 8:
        raise ValueError("the MMA's N is 8: segments of 8 tokens")
    kw = hid // WARPS  # columns per warp
    if hid % (WARPS * STEP_COLS) or (kw // STEP_COLS) % unroll or inter % RB:
        raise ValueError(f"hidden {hid} / inter {inter}: no whole steps of the MMA plan")
    n_steps = kw // STEP_COLS
    tiles = inter // RB
    red_n = WARPS * 32 * 4  # one half of the partial-sum buffer
    smem_bytes = routing_smem_bytes(spec) + 4 * 2 * red_n + 1024
    carveout = carveout_for(per_sm * (smem_bytes + 1024))

    @cute.jit
    def mma_step(atom, acc, w, u, x):
        """Two m16n8k16 MMAs over one lane's 8 columns: k slots (2c, 2c+1, 2c+8, 2c+9) take
        columns 0-3 in the first and 4-7 in the second."""
        for h in cutlass.range_constexpr(2):
            a = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, 1)), BFloat16)
            b = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), BFloat16)
            o = 4 * h
            # A values: (row g, k 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1), then k + 8.
            a[0] = w[o]
            a[1] = w[o + 1]
            a[2] = u[o]
            a[3] = u[o + 1]
            a[4] = w[o + 2]
            a[5] = w[o + 3]
            a[6] = u[o + 2]
            a[7] = u[o + 3]
            # B values: (k 2c, token g), (2c+1, g), (2c+8, g), (2c+9, g).
            for i in cutlass.range_constexpr(4):
                b[i] = x[o + i]
            cute.gemm(atom, acc, a, b, acc)

    @cute.kernel
    def kernel(m: Int32, mLogits: cute.Tensor, mBias: cute.Tensor, mX: cute.Tensor,
               mGamma: cute.Tensor, mW13: cute.Tensor, mAct: cute.Tensor, mIds: cute.Tensor,
               mWts: cute.Tensor, mSorted: cute.Tensor, mSegs: cute.Tensor, mSelW: cute.Tensor,
               mRs: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4
        c = lane % 4
        alloc = cutlass.memory.SmemAllocator()
        rsm = routing_smem(alloc, spec)
        sorted_a, seg_e, seg_start, seg_len = rsm[5], rsm[6], rsm[7], rsm[8]
        red = alloc.allocate_tensor(Float32, cute.make_layout(2 * red_n), byte_alignment=16)
        pdl_wait()
        outs = (mIds, mWts, mSelW, mSorted, mSegs)
        n_seg = route_and_publish(spec, m, mLogits, mBias, rsm, outs, tidx, warp, lane, bidx)
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        w_atom = weight_atom(True)
        x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        n_items = n_seg * tiles
        col0 = warp * (kw // 8) + c  # in 16-byte chunks of a row
        for item in range(bidx, n_items, grid):
            s = item // tiles
            jb = item % tiles
            e = seg_e[s]
            start = seg_start[s]
            ln = seg_len[s]
            j = g
            if j >= ln:  # columns past the segment repeat its last token (dropped below)
                j = ln - 1
            a_id = sorted_a[start + j]
            tok = a_id // k
            if a_id >= m * k:
                tok = a_id - m * k
            row = jb * RB + g
            acc = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), Float32)
            for i in cutlass.range_constexpr(4):
                acc[i] = Float32(0.0)
            for o in cutlass.range_constexpr(n_steps // unroll):
                ws = []
                us = []
                xs = []
                for t in cutlass.range_constexpr(unroll):
                    ck = col0 + (o * unroll + t) * 4
                    wf = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
                    uf = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
                    xf = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
                    cute.copy(w_atom, cute.local_tile(mW13[e, row, None], (8,), (ck,)), wf)
                    cute.copy(w_atom, cute.local_tile(mW13[e, inter + row, None], (8,), (ck,)), uf)
                    cute.copy(x_atom, cute.local_tile(mX[tok, None], (8,), (ck,)), xf)
                    ws.append(wf)
                    us.append(uf)
                    xs.append(xf)
                for t in cutlass.range_constexpr(unroll):
                    mma_step(atom, acc, ws[t], us[t], xs[t])
            # acc: (gate row g, tokens 2c, 2c+1), (up row g, tokens 2c, 2c+1), this warp's part
            rb = (((item - bidx) // grid) % 2) * red_n
            for i in cutlass.range_constexpr(4):
                red[rb + (warp * 32 + lane) * 4 + i] = acc[i]
            cute.arch.sync_threads()
            if tidx < RB * SEG:
                r = tidx // SEG
                n = tidx % SEG
                if n < ln:
                    src = r * 4 + n // 2  # the lane that held (row r, token n)
                    gsum = Float32(0.0)
                    usum = Float32(0.0)
                    for wi in cutlass.range_constexpr(WARPS):
                        gsum = gsum + red[rb + (wi * 32 + src) * 4 + n % 2]
                        usum = usum + red[rb + (wi * 32 + src) * 4 + 2 + n % 2]
                    act = gsum / (Float32(1.0) + cute.math.exp(-gsum)) * usum
                    mAct[start + n, jb * RB + r] = act.to(BFloat16)
        pdl_done()

    return up_host(kernel, grid, smem_bytes, per_sm, carveout)

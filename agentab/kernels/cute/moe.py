"""The MoE of the specialized path: routing + shared and routed experts, in two CuTe DSL kernels.

`moe_up`: every CTA builds the step's work list (`moe_routing.route_and_publish`), then walks
the (segment, intermediate rows) items and writes SiLU(gate) * up per token. At batch 1..4 it is
the SIMT kernel here (persistent grid, two CTAs per SM): four warps split the hidden dim of each
gate/up row pair and issue all their 128-bit weight loads before touching the tokens, and the
post-attention RMSNorm is applied to the tokens on the fly (x * gamma from shared memory *
1/rms). Above batch 4 it is `moe_mma`'s tensor-core kernel on the router's RMS-normalized
tokens, since there the SIMT kernel is bound by instruction issue.

`moe_down` (one CTA per 16 output rows): the work list is staged in shared memory, the warps take
the segments in turn, stream the expert's down rows for the CTA's slice, and sum routing weight x
result per token into per-warp slices of shared memory; the epilogue adds the slices in a fixed
order and the residual. No atomics, so the sum over shared and routed experts is deterministic.
Together they read each touched expert's weights once per step (once per segment when more than
8 tokens chose an expert: the shared expert at batch > 8).
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentab.kernels.cute.common import compile_tvm_ffi, fake
from agentab.kernels.cute.moe_mma import build_moe_up_mma
from agentab.kernels.cute.moe_routing import (
    N_SMS,
    SEG,
    THREADS,
    WARPS,
    MoeSpec,
    route_and_publish,
    routing_smem,
    routing_smem_bytes,
    up_host,
    weight_atom,
)
from agentab.kernels.cute.pdl import pdl_done, pdl_wait


def build_moe_up(spec: MoeSpec, grid: int) -> Any:
    """Trace the SIMT moe_up over `grid` CTAs (tokens normalized per item).

    Items are (segment, `rslots` intermediate rows); CTA b takes items b, b + grid, ... The
    norm weight is a constant, so it is staged in shared memory before the PDL wait; 1/rms (from
    the router GEMV) is read right after it.
    """
    hid, inter, k = spec.hidden, spec.inter, spec.top_k
    ch = hid // 256  # 16-byte chunks per lane
    kq = 4 if ch % 4 == 0 else 1  # warps splitting the hidden dim of one row pair
    chq = ch // kq
    rslots = WARPS // kq  # intermediate rows per item
    if hid % 256 or inter % rslots or spec.n_experts % 32:
        raise ValueError("hidden % 256, inter % row slots and n_experts % 32 must be 0")
    tiles = inter // rslots
    n_red = rslots * SEG * kq * 2
    smem_bytes = routing_smem_bytes(spec) + 4 * 2 * n_red + 4 * spec.m_max + 2 * hid + 1024
    carveout = 50

    @cute.jit
    def load_rows(mW13: cute.Tensor, e, ii, c0, lane, gw: list, uw: list):
        """Issue the 16-byte loads of one warp's part of gate row ii and up row inter + ii."""
        atom = weight_atom(False)
        for c in cutlass.range_constexpr(chq):
            kc = (c0 + c) * 32 + lane
            cute.copy(atom, cute.local_tile(mW13[e, ii, None], (8,), (kc,)), gw[c])
            cute.copy(atom, cute.local_tile(mW13[e, inter + ii, None], (8,), (kc,)), uw[c])

    def frags() -> list:
        return [cute.make_rmem_tensor(cute.make_layout(8), BFloat16) for _ in range(chq)]

    @cute.jit
    def do_item(item, rb, start, ln, gw: list, uw: list, m, mX: cute.Tensor, mAct: cute.Tensor,
                sorted_a: cute.Tensor, red: cute.Tensor, rs_s: cute.Tensor, gam_s: cute.Tensor,
                tidx, slot, q, c0, lane):  # fmt: skip
        """One (segment, rslots rows) item (segment rows start.. start + ln) whose weights are in
        gw/uw (loads in flight)."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        for j in cutlass.range_constexpr(SEG):
            if j < ln:
                a = sorted_a[start + j]
                t = a // k
                if a >= m * k:
                    t = a - m * k
                xs = []
                for c in cutlass.range_constexpr(chq):
                    kc = (c0 + c) * 32 + lane
                    xsrc = cute.local_tile(mX[t, None], (8,), (kc,))
                    xfr = cute.make_fragment_like(xsrc)
                    cute.copy(atom, xsrc, xfr)
                    xs.append(xfr)
                ag = Float32(0.0)
                au = Float32(0.0)
                for c in cutlass.range_constexpr(chq):
                    kc = (c0 + c) * 32 + lane
                    xv = xs[c].load().to(Float32)
                    xv = xv * cute.local_tile(gam_s, (8,), (kc,)).load().to(Float32)
                    ag = ag + (gw[c].load().to(Float32) * xv).reduce(
                        cute.ReductionOp.ADD, Float32(0.0), 0
                    )
                    au = au + (uw[c].load().to(Float32) * xv).reduce(
                        cute.ReductionOp.ADD, Float32(0.0), 0
                    )
                ag = cute.arch.warp_reduction_sum(ag)
                au = cute.arch.warp_reduction_sum(au)
                if lane == 0:
                    red[rb + ((slot * SEG + j) * kq + q) * 2] = ag
                    red[rb + ((slot * SEG + j) * kq + q) * 2 + 1] = au
        cute.arch.sync_threads()
        if tidx < rslots * SEG:
            sl = tidx // SEG
            j = tidx % SEG
            if j < ln:
                g = Float32(0.0)
                u = Float32(0.0)
                for p in cutlass.range_constexpr(kq):
                    g = g + red[rb + ((sl * SEG + j) * kq + p) * 2]
                    u = u + red[rb + ((sl * SEG + j) * kq + p) * 2 + 1]
                a = sorted_a[start + j]
                t = a // k
                if a >= m * k:
                    t = a - m * k
                r = rs_s[t]
                g = g * r
                u = u * r
                act = g / (Float32(1.0) + cute.math.exp(-g)) * u
                mAct[start + j, (item % tiles) * rslots + sl] = act.to(BFloat16)

    @cute.kernel
    def kernel(m: Int32, mLogits: cute.Tensor, mBias: cute.Tensor, mX: cute.Tensor,
               mGamma: cute.Tensor, mW13: cute.Tensor, mAct: cute.Tensor, mIds: cute.Tensor,
               mWts: cute.Tensor, mSorted: cute.Tensor, mSegs: cute.Tensor, mSelW: cute.Tensor,
               mRs: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        alloc = cutlass.memory.SmemAllocator()
        rsm = routing_smem(alloc, spec)
        seg_e, seg_start, seg_len = rsm[6], rsm[7], rsm[8]
        sorted_a = rsm[5]
        red = alloc.allocate_tensor(Float32, cute.make_layout(2 * n_red), byte_alignment=16)
        rs_s = alloc.allocate_tensor(Float32, cute.make_layout(spec.m_max), byte_alignment=16)
        gam_s = alloc.allocate_tensor(BFloat16, cute.make_layout(hid), byte_alignment=16)
        # Items are (segment, rslots intermediate rows); the kq warps of a row slot split the
        # hidden dim, each issuing all its gate/up loads before touching x.
        slot = warp // kq
        q = warp % kq
        c0 = q * chq
        for i in range(tidx, hid // 8, THREADS):
            gsrc = cute.local_tile(mGamma, (8,), (i,))
            gdst = cute.local_tile(gam_s, (8,), (i,))
            cute.autovec_copy(gsrc, gdst)
        pdl_wait()
        if tidx < m:
            rs_s[tidx] = mRs[tidx]
        outs = (mIds, mWts, mSelW, mSorted, mSegs)
        n_seg = route_and_publish(spec, m, mLogits, mBias, rsm, outs, tidx, warp, lane, bidx)
        n_items = n_seg * tiles
        for item in range(bidx, n_items, grid):
            # Partial sums alternate between two halves of `red`, so one barrier per item is
            # enough: item i+2 reuses a half only after every thread passed item i+1's barrier.
            rb = (((item - bidx) // grid) % 2) * n_red
            s = item // tiles
            ii = (item % tiles) * rslots + slot
            e = seg_e[s]
            start = seg_start[s]
            ln = seg_len[s]
            gw = frags()
            uw = frags()
            load_rows(mW13, e, ii, c0, lane, gw, uw)
            do_item(item, rb, start, ln, gw, uw, m, mX, mAct, sorted_a, red, rs_s, gam_s, tidx,
                    slot, q, c0, lane)  # fmt: skip
        pdl_done()

    return up_host(kernel, grid, smem_bytes, 2, carveout)


def build_moe_down(spec: MoeSpec, rows_per_cta: int) -> Any:
    """Each CTA owns `rows_per_cta` output rows; its warps take the segments in turn.

    After the PDL wait the work list, the sorted assignments and the routing weights are staged
    in shared memory once, so the segment loop waits only on weight loads. A warp issues the
    16-byte loads of all its rows of the expert's down projection and of the segment's
    activations at once, then reduces; each warp sums into its own slice of shared memory and
    the epilogue adds the slices in a fixed order, so the result is deterministic.
    """
    hid, inter, k = spec.hidden, spec.inter, spec.top_k
    if inter != 256:
        raise ValueError("moe_down maps one 16-byte chunk per lane: inter must be 256")
    if hid % rows_per_cta:
        raise ValueError("rows_per_cta must divide hidden")
    rpc, mm = rows_per_cta, spec.m_max
    grid = hid // rpc
    nseg_max, ns = spec.max_segments, spec.n_assign
    smem_bytes = 4 * (WARPS * mm * rpc + 3 * nseg_max + spec.rows_act + ns) + 256

    @cute.jit
    def do_seg(start, ln, wv: list, m, mAct: cute.Tensor, srt: cute.Tensor, sw: cute.Tensor,
               acc: cute.Tensor, lane):  # fmt: skip
        """One segment (rows start.. start + ln of the activations) of one expert whose `rpc`
        weight rows are in wv (loads in flight)."""
        tx, _, _ = cute.arch.thread_idx()
        base = (tx // 32) * mm * rpc
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        av = []
        for j in cutlass.range_constexpr(SEG):
            jj = j
            if jj >= ln:
                jj = 0
            asrc = cute.local_tile(mAct[start + jj, None], (8,), (lane,))
            afr = cute.make_fragment_like(asrc)
            cute.copy(atom, asrc, afr)
            av.append(afr)
        for j in cutlass.range_constexpr(SEG):
            if j < ln:
                a = srt[start + j]
                t = a // k
                w = Float32(1.0)
                if a >= m * k:
                    t = a - m * k
                else:
                    w = sw[a]
                x = av[j].load().to(Float32)
                for r in cutlass.range_constexpr(rpc):
                    p = (wv[r].load().to(Float32) * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    p = cute.arch.warp_reduction_sum(p)
                    if lane == 0:
                        acc[base + t * rpc + r] = acc[base + t * rpc + r] + w * p

    def frags() -> list:
        return [cute.make_rmem_tensor(cute.make_layout(8), BFloat16) for _ in range(rpc)]

    @cute.jit
    def load_rows(mW2: cute.Tensor, e, d0, lane, wv: list):
        atom = weight_atom(False)
        for r in cutlass.range_constexpr(rpc):
            cute.copy(atom, cute.local_tile(mW2[e, d0 + r, None], (8,), (lane,)), wv[r])

    @cute.jit
    def seg(s, d0, m, mW2: cute.Tensor, mAct: cute.Tensor, segs: cute.Tensor, srt: cute.Tensor,
            sw: cute.Tensor, acc: cute.Tensor, lane):  # fmt: skip
        """Segment s: its list entry, its expert's rows (loads issued), then `do_seg`."""
        e = segs[3 * s]
        start = segs[3 * s + 1]
        ln = segs[3 * s + 2]
        wv = frags()
        load_rows(mW2, e, d0, lane, wv)
        do_seg(start, ln, wv, m, mAct, srt, sw, acc, lane)

    @cute.kernel
    def kernel(m_arg: Int32, mW2: cute.Tensor, mAct: cute.Tensor, mSorted: cute.Tensor,
               mSegs: cute.Tensor, mSelW: cute.Tensor, mRes: cute.Tensor,
               mOut: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        alloc = cutlass.memory.SmemAllocator()
        acc = alloc.allocate_tensor(Float32, cute.make_layout(WARPS * mm * rpc), byte_alignment=16)
        segs = alloc.allocate_tensor(Int32, cute.make_layout(3 * nseg_max), byte_alignment=16)
        srt = alloc.allocate_tensor(Int32, cute.make_layout(spec.rows_act), byte_alignment=16)
        sw = alloc.allocate_tensor(Float32, cute.make_layout(ns), byte_alignment=16)
        for i in range(tidx, WARPS * mm * rpc, THREADS):
            acc[i] = Float32(0.0)
        d0 = bidx * rpc
        pdl_wait()
        n_seg = mSegs[spec.max_segments, 0]
        m = mSegs[spec.max_segments, 1]
        # The work list is small: stage it in shared memory once, so the segment loop waits
        # only on the weight loads.
        for i in range(tidx, n_seg, THREADS):
            segs[3 * i] = mSegs[i, 0]
            segs[3 * i + 1] = mSegs[i, 1]
            segs[3 * i + 2] = mSegs[i, 2]
        for i in range(tidx, m * k + m, THREADS):
            srt[i] = mSorted[i]
        for i in range(tidx, m * k, THREADS):
            sw[i] = mSelW[i]
        cute.arch.sync_threads()
        for s in range(warp, n_seg, WARPS):
            seg(s, d0, m, mW2, mAct, segs, srt, sw, acc, lane)
        cute.arch.sync_threads()
        for i in range(tidx, m * rpc, THREADS):
            t = i // rpc
            r = i % rpc
            v = mRes[t, d0 + r].to(Float32)
            for wi in cutlass.range_constexpr(WARPS):
                v = v + acc[wi * mm * rpc + i]
            mOut[t, d0 + r] = v.to(BFloat16)
        pdl_done()

    @cute.jit
    def host(m_arg: Int32, mW2: cute.Tensor, mAct: cute.Tensor, mSorted: cute.Tensor,
             mSegs: cute.Tensor, mSelW: cute.Tensor, mRes: cute.Tensor, mOut: cute.Tensor,
             stream):  # fmt: skip
        # Two CTAs per SM come from the compiler's 128 registers; no occupancy hint is given.
        kernel(m_arg, mW2, mAct, mSorted, mSegs, mSelW, mRes, mOut).launch(
            grid=[grid, 1, 1],
            block=[THREADS, 1, 1],
            smem=smem_bytes,
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=0,
        )

    return host


@dataclass
class MoeBuffers:
    """Device buffers the two kernels share (sized for m_max tokens)."""

    act: Any  # (rows_act, inter) bf16
    sorted_a: Any  # (rows_act,) int32
    segs: Any  # (max_segments + 1, 3) int32; row max_segments holds (n_seg, m, 0)
    sel_w: Any  # (n_assign,) fp32


def alloc_buffers(spec: MoeSpec, device: Any) -> MoeBuffers:
    import torch

    return MoeBuffers(
        act=torch.zeros(spec.rows_act, spec.inter, device=device, dtype=torch.bfloat16),
        sorted_a=torch.zeros(spec.rows_act, device=device, dtype=torch.int32),
        segs=torch.zeros(spec.max_segments + 1, 3, device=device, dtype=torch.int32),
        sel_w=torch.zeros(spec.n_assign, device=device, dtype=torch.float32),
    )


def compile_moe(spec: MoeSpec, tensor_cores: bool, rows_per_cta: int = 16) -> tuple:
    """(moe_up, moe_down) compiled; see `SpecializedPath.step` for the argument order.

    `tensor_cores`: moe_up is `moe_mma`'s tensor-core kernel, which reads RMS-normalized tokens
    (the path's router input above batch 4), instead of the SIMT kernel over two CTAs per SM,
    which normalizes the raw tokens itself. Both write the same work list for moe_down."""
    e1 = spec.n_experts + 1
    up = compile_tvm_ffi(
        build_moe_up_mma(spec) if tensor_cores else build_moe_up(spec, 2 * N_SMS),
        Int32(1),
        fake(Float32, (spec.m_max, spec.n_experts)),
        fake(Float32, (spec.n_experts,)),
        fake(BFloat16, (spec.m_max, spec.hidden)),
        fake(BFloat16, (spec.hidden,)),
        fake(BFloat16, (e1, 2 * spec.inter, spec.hidden)),
        fake(BFloat16, (spec.rows_act, spec.inter)),
        fake(Int32, (spec.m_max, spec.top_k)),
        fake(Float32, (spec.m_max, spec.top_k)),
        fake(Int32, (spec.rows_act,)),
        fake(Int32, (spec.max_segments + 1, 3)),
        fake(Float32, (spec.n_assign,)),
        fake(Float32, (spec.m_max,)),
        key=(spec, "mma" if tensor_cores else f"simt grid {2 * N_SMS}"),
    )
    down = compile_tvm_ffi(
        build_moe_down(spec, rows_per_cta),
        Int32(1),
        fake(BFloat16, (e1, spec.hidden, spec.inter)),
        fake(BFloat16, (spec.rows_act, spec.inter)),
        fake(Int32, (spec.rows_act,)),
        fake(Int32, (spec.max_segments + 1, 3)),
        fake(Float32, (spec.n_assign,)),
        fake(BFloat16, (spec.m_max, spec.hidden)),
        fake(BFloat16, (spec.m_max, spec.hidden)),
        key=(spec, rows_per_cta),
    )
    return up, down

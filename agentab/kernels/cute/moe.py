"""The MoE of the specialized path: routing + shared and routed experts, in two CuTe DSL kernels.

`moe_up` (persistent grid, two CTAs per SM): every CTA first turns the router logits into the
step's work list in shared memory (sigmoid + correction bias, top-k by warp argmax, renormalized
weights; tokens grouped by expert in a deterministic order, the shared expert appended as expert
E that every token visits with weight 1; each expert's tokens cut into segments of at most 8).
Recomputing this small list in every CTA costs no grid synchronisation; CTA 0 also publishes it
(and the chosen ids/weights) for `moe_down`. Then the CTAs walk the (segment, 2 intermediate
rows) items: four warps split the hidden dim of each gate/up row pair and issue all their 128-bit
weight loads before touching the tokens, the post-attention RMSNorm is applied to the tokens on
the fly (x * gamma from shared memory * 1/rms), and SiLU(gate) * up is written per token.

`moe_down` (one CTA per 16 output rows): the work list is staged in shared memory, the warps take
the segments in turn, stream the expert's down rows for the CTA's slice, and sum routing weight x
result per token into per-warp slices of shared memory; the epilogue adds the slices in a fixed
order and the residual. No atomics, so the sum over shared and routed experts is deterministic.
Together they read each touched expert's weights once per step (once per segment when more than
8 tokens chose an expert: the shared expert at batch > 8). Routing supports n_group == 1
(Kimi-K2's config); the grouped variant runs in the standard path and the reference.
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentab.kernels.config import LayerConfig
from agentab.kernels.cute.common import carveout_for, compile_tvm_ffi, fake
from agentab.kernels.cute.pdl import pdl_done, pdl_wait

SEG = 8  # tokens per segment
WARPS = 8
THREADS = 32 * WARPS
N_SMS = 132
# Diagnostics, read at trace time (scripts/gpu/explore.py sets them; results are then wrong):
# False skips moe_up's item loop / moe_down's segment loop, so a layer timed with it shows what
# the prologues (PDL wait, routing, list staging) and the launches cost on their own.
UP_WORK = True
DOWN_WORK = True
# True: thread 0 of CTAs 0-127 records %globaltimer_lo (ns) at its start, after the PDL wait,
# after the routing / list staging and at its end, into unused entries of the work-list buffers
# (moe_up: sorted[64 + 4 b + j]; moe_down version 8: segs flattened, [300 + 4 b + j]); valid
# while m * (top_k + 1) <= 64 (batch <= 7). Read back by scripts/gpu/explore.py (EXPLORE_TRACE).
TRACE = False
TRACE_CTAS = 128
# moe_down version 8's min_blocks_per_mp launch hint (0: none, the compiler's 128 registers
# leave 2 CTAs per SM, so 448 CTAs run in 1.7 waves); a plan knob explore.py times.
DOWN_MIN_BLOCKS = 0


@cute.jit
def _stamp(trace: bool, dst: cute.Tensor, idx, bidx, tidx):
    """dst[idx] = %globaltimer_lo by thread 0 of CTAs < TRACE_CTAS, when tracing."""
    if cutlass.const_expr(trace):  # noqa: SIM102 (compile-time, then runtime)
        if tidx == 0 and bidx < TRACE_CTAS:
            dst[idx] = cute.arch.globaltimer_lo()


@dataclass(frozen=True)
class MoeSpec:
    """Compile-time shapes of the MoE kernels (the token count m is a runtime argument <= m_max)."""

    hidden: int
    inter: int
    n_experts: int
    top_k: int
    routed_scaling: float
    m_max: int = 64
    eps: float = 1e-6

    @staticmethod
    def from_config(cfg: LayerConfig, m_max: int = 64) -> "MoeSpec":
        if cfg.n_group != 1:
            raise ValueError("the specialized MoE kernels implement n_group == 1 routing")
        if cfg.n_shared != 1 or cfg.shared_inter != cfg.moe_inter:
            raise ValueError("the specialized MoE needs one shared expert shaped like the others")
        return MoeSpec(
            cfg.hidden, cfg.moe_inter, cfg.n_experts, cfg.top_k, cfg.routed_scaling, m_max,
            cfg.rms_eps,
        )  # fmt: skip

    @property
    def n_assign(self) -> int:
        return self.m_max * self.top_k

    @property
    def max_segments(self) -> int:
        # every routed assignment its own segment at worst, plus the shared expert's segments
        return self.n_assign + (self.m_max + SEG - 1) // SEG

    @property
    def rows_act(self) -> int:
        return self.n_assign + self.m_max


def _weight_atom(stream_hint: bool) -> Any:
    """The 128-bit load of expert weights; with `stream_hint` (version 9) it does not allocate in
    L1: each weight byte is read once, and the activations that are re-read keep the L1."""
    if stream_hint:
        op = cute.nvgpu.CopyG2ROp()
        return cute.make_copy_atom(
            op, BFloat16, num_bits_per_copy=128,
            l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE,
        )  # fmt: skip
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)


@cute.jit
def _warp_argmax(val: Float32, idx: Int32, aux: Float32) -> tuple:
    """Warp-wide max of val (ties -> lower idx), carrying idx and aux along."""
    for s in (16, 8, 4, 2, 1):
        ov = cute.arch.shuffle_sync_bfly(val, offset=s)
        oi = cute.arch.shuffle_sync_bfly(idx, offset=s)
        oa = cute.arch.shuffle_sync_bfly(aux, offset=s)
        take = (ov > val) | ((ov == val) & (oi < idx))
        if take:
            val = ov
            idx = oi
            aux = oa
    return val, idx, aux


def routing_smem(alloc: Any, spec: MoeSpec) -> tuple:
    """The routing prologue's shared-memory arrays, in the order `_routing` takes them:
    (sel_e, sel_w, cnt, off, segoff, sorted_a, seg_e, seg_start, seg_len)."""
    ns, n_exp, nseg = spec.n_assign, spec.n_experts, spec.max_segments

    def arr(dtype: Any, n: int) -> Any:
        return alloc.allocate_tensor(dtype, cute.make_layout(n), byte_alignment=16)

    return (arr(Int32, ns), arr(Float32, ns), arr(Int32, n_exp + 2), arr(Int32, n_exp + 2),
            arr(Int32, n_exp + 2), arr(Int32, spec.rows_act), arr(Int32, nseg), arr(Int32, nseg),
            arr(Int32, nseg))  # fmt: skip


def routing_smem_bytes(spec: MoeSpec) -> int:
    """Bytes of `routing_smem` (16-byte alignment padding aside)."""
    return 4 * (2 * spec.n_assign + 3 * (spec.n_experts + 2) + spec.rows_act
                + 3 * spec.max_segments)  # fmt: skip


@cute.jit
def _route_and_publish(spec: MoeSpec, shared_first: bool, m, mLogits, mBias, smem: tuple,
                       outs: tuple, tidx, warp, lane, bidx,
                       small_list: bool = False):  # fmt: skip
    """Build the work list in the `routing_smem` arrays (every CTA of both moe_up kernels does),
    CTA 0 publishes it with `_publish` into `outs` = (ids, weights, sel_w, sorted, segs);
    returns the segment count.

    With `shared_first` the shared expert's segments come first (segment 0.. ceil(m/8) - 1), so
    the kernels know before the PDL wait which weights their first work item reads. With
    `small_list` (kernel version 16, shared-first only) batches of m * top_k <= 32 build the
    list in one warp (`_list_small`) instead of `_list_general`'s passes over the experts.
    """
    sel_e, sel_w, segoff = smem[0], smem[1], smem[4]
    off, sorted_a, seg_e, seg_start, seg_len = smem[3], smem[5], smem[6], smem[7], smem[8]
    e_per_lane = spec.n_experts // 32
    k, n_exp = spec.top_k, spec.n_experts
    # 1. top-k per token: one warp per token.
    for t in range(warp, m, WARPS):
        biased = cute.make_rmem_tensor(cute.make_layout(e_per_lane), Float32)
        score = cute.make_rmem_tensor(cute.make_layout(e_per_lane), Float32)
        for j in cutlass.range_constexpr(e_per_lane):
            e = j * 32 + lane
            lg = mLogits[t, e]
            s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-lg))
            score[j] = s
            biased[j] = s + mBias[e]
        total = Float32(0.0)
        for kk in cutlass.range_constexpr(k):
            bv = Float32(-3.0e38)
            bi = Int32(0)
            bs = Float32(0.0)
            for j in cutlass.range_constexpr(e_per_lane):
                if biased[j] > bv:
                    bv = biased[j]
                    bi = Int32(j * 32) + lane
                    bs = score[j]
            bv, bi, bs = _warp_argmax(bv, bi, bs)
            for j in cutlass.range_constexpr(e_per_lane):
                if Int32(j * 32) + lane == bi:
                    biased[j] = Float32(-3.0e38)
            total = total + bs
            if lane == 0:
                sel_e[t * k + kk] = bi
                sel_w[t * k + kk] = bs
        if lane == 0:
            scale = Float32(spec.routed_scaling) / total
            for kk in cutlass.range_constexpr(k):
                sel_w[t * k + kk] = sel_w[t * k + kk] * scale
    cute.arch.sync_threads()
    n_assign = m * k
    if cutlass.const_expr(small_list and shared_first):
        if n_assign <= 32 and m <= SEG:
            _list_small(spec, m, smem, warp, lane)
        else:
            _list_general(spec, shared_first, m, smem, tidx, warp, lane)
    else:
        _list_general(spec, shared_first, m, smem, tidx, warp, lane)
    n_seg = segoff[n_exp + 1]
    if bidx == 0:
        _publish(spec, m, n_seg, sel_e, sel_w, off, sorted_a, seg_e, seg_start, seg_len, *outs,
                 tidx)  # fmt: skip
    return n_seg


@cute.jit
def _list_general(spec: MoeSpec, shared_first: bool, m, smem: tuple, tidx, warp, lane):
    """Steps 2-4 of the routing for any m: counts per expert, prefix sums, scatter; several
    dependent passes over shared memory (7.3 us of moe_up's batch-1 time with step 1, session
    4's trace), which `_list_small` replaces at m * top_k <= 32."""
    sel_e, _, cnt, off, segoff, sorted_a, seg_e, seg_start, seg_len = smem
    k, n_exp = spec.top_k, spec.n_experts
    sh = 0 if shared_first else n_exp
    eoff = 1 if shared_first else 0
    n_assign = m * k
    # 2. tokens per expert (deterministic: a thread scans the assignments in order). Slot v of
    # cnt/off/segoff is the shared expert at v == sh, routed expert v - eoff otherwise.
    for v in range(tidx, n_exp + 1, THREADS):
        c = Int32(0)
        if v == sh:
            c = m
        else:
            for a in range(n_assign):
                if sel_e[a] == v - eoff:
                    c = c + 1
        cnt[v] = c
    cute.arch.sync_threads()
    # 3. exclusive prefix sums of counts and of segment counts (warp 0, 32 lanes x a run each).
    if warp == 0:
        per = (n_exp + 1 + 31) // 32
        lo = lane * per
        s_cnt = Int32(0)
        s_seg = Int32(0)
        for i in range(per):
            e = lo + i
            if e <= n_exp:
                s_cnt = s_cnt + cnt[e]
                s_seg = s_seg + (cnt[e] + (SEG - 1)) // SEG
        inc_cnt = s_cnt
        inc_seg = s_seg
        for sft in (1, 2, 4, 8, 16):
            vc = cute.arch.shuffle_sync_up(inc_cnt, offset=sft)
            vs = cute.arch.shuffle_sync_up(inc_seg, offset=sft)
            if lane >= sft:
                inc_cnt = inc_cnt + vc
                inc_seg = inc_seg + vs
        run_cnt = inc_cnt - s_cnt
        run_seg = inc_seg - s_seg
        for i in range(per):
            e = lo + i
            if e <= n_exp:
                off[e] = run_cnt
                segoff[e] = run_seg
                run_cnt = run_cnt + cnt[e]
                run_seg = run_seg + (cnt[e] + (SEG - 1)) // SEG
        if lane == 31:
            off[n_exp + 1] = inc_cnt
            segoff[n_exp + 1] = inc_seg
    cute.arch.sync_threads()
    # 4. scatter assignments into expert order and cut segments.
    for v in range(tidx, n_exp + 1, THREADS):
        c = cnt[v]
        if c > 0:
            base = off[v]
            e = v - eoff
            if v == sh:
                e = Int32(n_exp)
                for t in range(m):
                    sorted_a[base + t] = n_assign + t
            else:
                pos = Int32(0)
                for a in range(n_assign):
                    if sel_e[a] == e:
                        sorted_a[base + pos] = a
                        pos = pos + 1
            sb = segoff[v]
            for q in range((c + (SEG - 1)) // SEG):
                seg_e[sb + q] = e
                seg_start[sb + q] = base + q * SEG
                rem = c - q * SEG
                ln = Int32(SEG)
                if rem < SEG:
                    ln = rem
                seg_len[sb + q] = ln
    cute.arch.sync_threads()


@cute.jit
def _list_small(spec: MoeSpec, m, smem: tuple, warp, lane):
    """The shared-first work list when every assignment fits one warp (m * top_k <= 32, m <= 8):
    lane a holds assignment a; its place in (expert, assignment) order and its segment come from
    32 shuffles each, with no pass over the experts. The same arrays and order as
    `_list_general`: the shared expert's segment 0 (its m tokens), then one segment per routed
    expert in ascending id, its tokens in assignment order (an expert has at most m <= 8)."""
    sel_e, _, _, off, segoff, sorted_a, seg_e, seg_start, seg_len = smem
    k, n_exp = spec.top_k, spec.n_experts
    n_assign = m * k
    if warp == 0:
        e = Int32(n_exp + 1)  # lanes past the assignments sort last and write nothing
        if lane < n_assign:
            e = sel_e[lane]
        before = Int32(0)  # assignments ahead of this one in (expert, assignment) order
        same_before = Int32(0)
        same = Int32(0)
        for j in cutlass.range_constexpr(32):
            ej = cute.arch.shuffle_sync(e, j)
            if ej < e:
                before = before + 1
            if ej == e:
                same = same + 1
                if lane > j:
                    before = before + 1
                    same_before = same_before + 1
        head = Int32(0)
        if lane < n_assign and same_before == 0:
            head = Int32(1)
        seg = Int32(1)  # segment 0 is the shared expert's
        heads = Int32(0)
        for j in cutlass.range_constexpr(32):
            hj = cute.arch.shuffle_sync(head, j)
            ej = cute.arch.shuffle_sync(e, j)
            heads = heads + hj
            if hj == 1 and ej < e:
                seg = seg + 1
        if lane < n_assign:
            sorted_a[m + before] = lane
        if head == 1:
            seg_e[seg] = e
            seg_start[seg] = m + before
            seg_len[seg] = same
        if lane < m:
            sorted_a[lane] = n_assign + lane
        if lane == 0:
            seg_e[0] = Int32(n_exp)
            seg_start[0] = Int32(0)
            seg_len[0] = m
            off[n_exp + 1] = n_assign + m
            segoff[n_exp + 1] = heads + 1
    cute.arch.sync_threads()


@cute.jit
def _publish(spec: MoeSpec, m, n_seg, sel_e, sel_w, off, sorted_a, seg_e, seg_start, seg_len,
             mIds, mWts, mSelW, mSorted, mSegs, tidx):  # fmt: skip
    """CTA 0 writes the step's choices (ids, weights) and the work list moe_down reads."""
    k, n_exp = spec.top_k, spec.n_experts
    for a in range(tidx, m * k, THREADS):
        mIds[a // k, a % k] = sel_e[a]
        mWts[a // k, a % k] = sel_w[a]
        mSelW[a] = sel_w[a]
    for i in range(tidx, off[n_exp + 1], THREADS):
        mSorted[i] = sorted_a[i]
    for s in range(tidx, n_seg, THREADS):
        mSegs[s, 0] = seg_e[s]
        mSegs[s, 1] = seg_start[s]
        mSegs[s, 2] = seg_len[s]
    if tidx == 0:
        mSegs[spec.max_segments, 0] = n_seg
        mSegs[spec.max_segments, 1] = m


def build_moe_up(
    spec: MoeSpec, grid: int, version: int = 9, prenorm: bool = False, small_list: bool = False
) -> Any:
    """Trace moe_up. Version 8: the work list in expert order, the shared expert last.

    Version 9: the shared expert's segments first, so item b < tiles (segment 0, the shared
    expert, rows b * rslots ..) is known before the PDL wait: those CTAs issue its weight loads
    first and stream them while the router drains and while they build the work list; 1/rms is
    loaded right after the wait instead of after the routing.

    Version 13: version 8's kernel with the shared-first work list (which balances moe_down:
    the shared expert's eight full segments go first, one per warp, instead of last). With
    `prenorm` the tokens arrive RMS-normalized (times gamma, in bf16, as the standard path feeds
    its experts): no gamma staging, no per-item x * gamma * 1/rms. The path uses it above batch
    4, where ncu showed moe_up issue-bound (55% SM throughput) and the normalized tokens already
    exist for the router.
    """
    hid, inter, k = spec.hidden, spec.inter, spec.top_k
    ch = hid // 256  # 16-byte chunks per lane
    kq = 4 if ch % 4 == 0 else 1  # warps splitting the hidden dim of one row pair
    chq = ch // kq
    rslots = WARPS // kq  # intermediate rows per item
    if hid % 256 or inter % rslots or spec.n_experts % 32:
        raise ValueError("hidden % 256, inter % row slots and n_experts % 32 must be 0")
    if version not in (8, 9, 13):
        raise ValueError(f"moe_up version {version}: 8, 9 or 13")
    if prenorm and version != 13:
        raise ValueError("prenorm tokens: moe_up version 13")
    tiles = inter // rslots
    n_exp = spec.n_experts
    trace = TRACE
    n_red = rslots * SEG * kq * 2
    v9 = version == 9
    shared_first = version >= 9
    smem_bytes = routing_smem_bytes(spec) + 4 * 2 * n_red + 4 * spec.m_max + 2 * hid + 1024
    carveout = 50
    if v9:
        smem_bytes += 2 * chq * THREADS * 16 + 128  # the first item's prefetched weights
        # Two CTAs of 89 KB per SM: the 196 KB configuration, which leaves 60 KB of L1 for the
        # activations (228 KB would leave 28 KB).
        carveout = carveout_for(2 * (smem_bytes + 1024))

    @cute.jit
    def load_rows(mW13: cute.Tensor, e, ii, c0, lane, gw: list, uw: list):
        """Issue the 16-byte loads of one warp's part of gate row ii and up row inter + ii."""
        atom = _weight_atom(v9)
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
                    if cutlass.const_expr(not prenorm):
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
                if cutlass.const_expr(not prenorm):
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
        _stamp(trace, mSorted, 64 + 4 * bidx, bidx, tidx)
        lane = tidx % 32
        warp = tidx // 32
        alloc = cutlass.memory.SmemAllocator()
        rsm = routing_smem(alloc, spec)
        seg_e, seg_start, seg_len = rsm[6], rsm[7], rsm[8]
        sorted_a = rsm[5]
        red = alloc.allocate_tensor(Float32, cute.make_layout(2 * n_red), byte_alignment=16)
        rs_s = alloc.allocate_tensor(Float32, cute.make_layout(spec.m_max), byte_alignment=16)
        gam_s = alloc.allocate_tensor(BFloat16, cute.make_layout(hid), byte_alignment=16)
        # Items are (segment, RSLOTS intermediate rows); the KQ warps of a row slot split the
        # hidden dim, each issuing all its gate/up loads before touching x.
        slot = warp // kq if shared_first else None  # version 8 computes these after the routing
        q = warp % kq if shared_first else None
        c0 = q * chq if shared_first else None
        # Version 9: item bidx (< tiles) is the shared expert's (segment 0): its weights are
        # constants, so they are requested before anything else.
        pre = bidx < tiles
        gw0 = []
        uw0 = []
        if cutlass.const_expr(v9):
            # cp.async into this thread's own slots of `pbuf` (no registers held across the
            # routing); the thread reads back only what it copied, so wait_group needs no barrier.
            pbuf = alloc.allocate_tensor(
                BFloat16, cute.make_layout(2 * chq * THREADS * 8), byte_alignment=128
            )
            for c in cutlass.range_constexpr(chq):
                gw0.append(cute.local_tile(pbuf, (8,), ((2 * c) * THREADS + tidx,)))
                uw0.append(cute.local_tile(pbuf, (8,), ((2 * c + 1) * THREADS + tidx,)))
            if pre:
                casync = cute.make_copy_atom(
                    cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.LoadCacheMode.GLOBAL),
                    BFloat16,
                    num_bits_per_copy=128,
                )
                ii0 = bidx * rslots + slot
                for c in cutlass.range_constexpr(chq):
                    kc = (c0 + c) * 32 + lane
                    cute.copy(casync, cute.local_tile(mW13[n_exp, ii0, None], (8,), (kc,)),
                              gw0[c])  # fmt: skip
                    cute.copy(casync, cute.local_tile(mW13[n_exp, inter + ii0, None], (8,), (kc,)),
                              uw0[c])  # fmt: skip
                cute.arch.cp_async_commit_group()
        # The norm weight is a constant: stage it in shared memory before the PDL wait.
        if cutlass.const_expr(not prenorm):
            for i in range(tidx, hid // 8, THREADS):
                gsrc = cute.local_tile(mGamma, (8,), (i,))
                gdst = cute.local_tile(gam_s, (8,), (i,))
                cute.autovec_copy(gsrc, gdst)
        pdl_wait()
        _stamp(trace, mSorted, 64 + 4 * bidx + 1, bidx, tidx)
        if cutlass.const_expr(shared_first and not prenorm):  # noqa: SIM102
            if tidx < m:
                rs_s[tidx] = mRs[tidx]
        outs = (mIds, mWts, mSelW, mSorted, mSegs)
        n_seg = _route_and_publish(spec, shared_first, m, mLogits, mBias, rsm, outs, tidx, warp,
                                   lane, bidx, small_list)  # fmt: skip
        _stamp(trace, mSorted, 64 + 4 * bidx + 2, bidx, tidx)
        if cutlass.const_expr(not shared_first):
            if tidx < m:
                rs_s[tidx] = mRs[tidx]
            cute.arch.sync_threads()
            slot = warp // kq
            q = warp % kq
            c0 = q * chq
        first = bidx
        if cutlass.const_expr(v9):  # noqa: SIM102 (compile-time, then runtime)
            if pre:
                cute.arch.cp_async_wait_group(0)
                do_item(bidx, 0, seg_start[0], seg_len[0], gw0, uw0, m, mX, mAct, sorted_a, red,
                        rs_s, gam_s, tidx, slot, q, c0, lane)  # fmt: skip
                first = bidx + grid
        n_items = n_seg * tiles
        if cutlass.const_expr(not UP_WORK):
            n_items = n_seg * 0
        for item in range(first, n_items, grid):
            # Partial sums alternate between two halves of `red`, so one barrier per item is
            # enough: item i+2 reuses a half only after every thread passed item i+1's barrier.
            rb = (((item - bidx) // grid) % 2) * n_red
            s = item // tiles
            ii = (item % tiles) * rslots + slot
            e = seg_e[s]
            # (the two versions order these smem reads differently; each as checked/measured)
            if cutlass.const_expr(not v9):
                start = seg_start[s]
                ln = seg_len[s]
            gw = frags()
            uw = frags()
            load_rows(mW13, e, ii, c0, lane, gw, uw)
            if cutlass.const_expr(v9):
                start = seg_start[s]
                ln = seg_len[s]
            do_item(item, rb, start, ln, gw, uw, m, mX, mAct, sorted_a, red, rs_s, gam_s, tidx,
                    slot, q, c0, lane)  # fmt: skip
        _stamp(trace, mSorted, 64 + 4 * bidx + 3, bidx, tidx)
        pdl_done()

    return up_host(kernel, grid, smem_bytes, 2, carveout)


def up_host(kernel: Any, grid: int, smem_bytes: int, per_sm: int, carveout: int) -> Any:
    """The host launcher of a moe_up kernel (the SIMT one here, the tensor-core one in
    `moe_mma`): both take the same arguments, so `compile_moe` compiles either the same way."""

    @cute.jit
    def host(m: Int32, mLogits: cute.Tensor, mBias: cute.Tensor, mX: cute.Tensor,
             mGamma: cute.Tensor, mW13: cute.Tensor, mAct: cute.Tensor, mIds: cute.Tensor,
             mWts: cute.Tensor, mSorted: cute.Tensor, mSegs: cute.Tensor, mSelW: cute.Tensor,
             mRs: cute.Tensor, stream):  # fmt: skip
        kernel(m, mLogits, mBias, mX, mGamma, mW13, mAct, mIds, mWts, mSorted, mSegs, mSelW,
               mRs).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes,
                           stream=stream, use_pdl=True, min_blocks_per_mp=per_sm,
                           preferred_smem_carveout=carveout)  # fmt: skip

    return host


def build_moe_down(spec: MoeSpec, rows_per_cta: int, version: int = 9) -> Any:
    """Each CTA owns `rows_per_cta` output rows; its warps take the segments in turn.

    A warp issues the 16-byte loads of all its rows of the expert's down projection and of the
    segment's activations at once, then reduces; each warp sums into its own slice of shared
    memory and the epilogue adds the slices in a fixed order, so the result is deterministic.

    Version 9 (with moe_up's shared-first work list): segment 0 is the shared expert's, so warp
    0 requests its rows (cp.async) before the PDL wait; the work list, routing
    weights and the residual are staged after the wait in one round of independent loads
    (version 8 read the segment count first, then the lists one after another: four dependent
    L2 round trips before the first weight load, one more for the residual at the end).
    """
    hid, inter, k = spec.hidden, spec.inter, spec.top_k
    if inter != 256:
        raise ValueError("moe_down maps one 16-byte chunk per lane: inter must be 256")
    if hid % rows_per_cta:
        raise ValueError("rows_per_cta must divide hidden")
    if version not in (8, 9):
        raise ValueError(f"moe_down version {version}: 8 or 9")
    v9 = version >= 9
    trace = TRACE and not v9
    min_blocks = DOWN_MIN_BLOCKS  # (version 8: a register cap for more resident CTAs; 0: none)
    rpc, mm = rows_per_cta, spec.m_max
    grid = hid // rpc
    nseg_max, ns = spec.max_segments, spec.n_assign
    n_segs_flat = 3 * (nseg_max + 1)
    smem_bytes = 4 * (WARPS * mm * rpc + 3 * nseg_max + spec.rows_act + ns) + 256
    if v9:
        smem_bytes += 4 * 3 + 2 * mm * rpc + 16 * rpc * 32 + 256

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
        atom = _weight_atom(v9)
        for r in cutlass.range_constexpr(rpc):
            cute.copy(atom, cute.local_tile(mW2[e, d0 + r, None], (8,), (lane,)), wv[r])

    @cute.jit
    def seg(s, d0, m, mW2: cute.Tensor, mAct: cute.Tensor, segs: cute.Tensor, srt: cute.Tensor,
            sw: cute.Tensor, acc: cute.Tensor, lane):  # fmt: skip
        """Segment s: its list entry, its expert's rows (loads issued), then `do_seg`."""
        e = segs[3 * s]
        if cutlass.const_expr(not v9):
            start = segs[3 * s + 1]
            ln = segs[3 * s + 2]
        wv = frags()
        load_rows(mW2, e, d0, lane, wv)
        if cutlass.const_expr(v9):
            start = segs[3 * s + 1]
            ln = segs[3 * s + 2]
        do_seg(start, ln, wv, m, mAct, srt, sw, acc, lane)

    @cute.jit
    def stage(src_at, dst: cute.Tensor, n: int, tidx):
        """dst[i] = src_at(i) for i < n (compile-time n): every load issued before any store."""
        rounds = (n + THREADS - 1) // THREADS
        vals = []
        for r in cutlass.range_constexpr(rounds):
            i = tidx + r * THREADS
            if cutlass.const_expr((r + 1) * THREADS > n):  # noqa: SIM102 (compile-time, runtime)
                if i >= n:
                    i = n - 1
            vals.append(src_at(i))
        for r in cutlass.range_constexpr(rounds):
            if cutlass.const_expr((r + 1) * THREADS > n):
                if tidx + r * THREADS < n:
                    dst[tidx + r * THREADS] = vals[r]
            else:
                dst[tidx + r * THREADS] = vals[r]

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
        segs = alloc.allocate_tensor(
            Int32, cute.make_layout(n_segs_flat if v9 else 3 * nseg_max), byte_alignment=16
        )
        srt = alloc.allocate_tensor(Int32, cute.make_layout(spec.rows_act), byte_alignment=16)
        sw = alloc.allocate_tensor(Float32, cute.make_layout(ns), byte_alignment=16)
        for i in range(tidx, WARPS * mm * rpc, THREADS):
            acc[i] = Float32(0.0)
        d0 = bidx * rpc
        tr = cute.make_tensor(mSegs.iterator, cute.make_layout(3 * (nseg_max + 1)))
        _stamp(trace, tr, 300 + 4 * bidx, bidx, tidx)
        if cutlass.const_expr(v9):
            res_s = alloc.allocate_tensor(BFloat16, cute.make_layout(mm * rpc), byte_alignment=16)
            pw = alloc.allocate_tensor(BFloat16, cute.make_layout(rpc * 32 * 8), byte_alignment=128)
            wv0 = [cute.local_tile(pw, (8,), (r * 32 + lane,)) for r in range(rpc)]
            # The shared expert's segments come first, so warp 0 starts with segment 0, whose
            # rows are constants: cp.async them into its own shared-memory slots (no registers
            # held across the wait), read back by the same lanes after wait_group.
            if warp == 0:
                casync = cute.make_copy_atom(
                    cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.LoadCacheMode.GLOBAL),
                    BFloat16,
                    num_bits_per_copy=128,
                )
                for r in cutlass.range_constexpr(rpc):
                    src = cute.local_tile(mW2[spec.n_experts, d0 + r, None], (8,), (lane,))
                    cute.copy(casync, src, wv0[r])
                cute.arch.cp_async_commit_group()
            pdl_wait()
            stage(lambda i: mSegs[i // 3, i % 3], segs, n_segs_flat, tidx)
            stage(lambda i: mSorted[i], srt, spec.rows_act, tidx)
            stage(lambda i: mSelW[i], sw, ns, tidx)
            stage(lambda i: mRes[i // rpc, d0 + i % rpc], res_s, mm * rpc, tidx)
            cute.arch.sync_threads()
            n_seg = segs[3 * nseg_max]
            m = segs[3 * nseg_max + 1]
            if warp == 0:
                cute.arch.cp_async_wait_group(0)
                do_seg(segs[1], segs[2], wv0, m, mAct, srt, sw, acc, lane)
        else:
            pdl_wait()
            _stamp(trace, tr, 300 + 4 * bidx + 1, bidx, tidx)
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
            _stamp(trace, tr, 300 + 4 * bidx + 2, bidx, tidx)
        n_work = n_seg
        if cutlass.const_expr(not DOWN_WORK):
            n_work = n_seg * 0
        for s in range(warp, n_work, WARPS):
            if cutlass.const_expr(v9):
                if s >= 1:  # warp 0 did segment 0 above
                    seg(s, d0, m, mW2, mAct, segs, srt, sw, acc, lane)
            else:
                seg(s, d0, m, mW2, mAct, segs, srt, sw, acc, lane)
        cute.arch.sync_threads()
        for i in range(tidx, m * rpc, THREADS):
            t = i // rpc
            r = i % rpc
            v = Float32(0.0)
            if cutlass.const_expr(v9):  # noqa: SIM108 (a compile-time branch)
                v = res_s[i].to(Float32)
            else:
                v = mRes[t, d0 + r].to(Float32)
            for wi in cutlass.range_constexpr(WARPS):
                v = v + acc[wi * mm * rpc + i]
            mOut[t, d0 + r] = v.to(BFloat16)
        _stamp(trace, tr, 300 + 4 * bidx + 3, bidx, tidx)
        pdl_done()

    @cute.jit
    def host(m_arg: Int32, mW2: cute.Tensor, mAct: cute.Tensor, mSorted: cute.Tensor,
             mSegs: cute.Tensor, mSelW: cute.Tensor, mRes: cute.Tensor, mOut: cute.Tensor,
             stream):  # fmt: skip
        if cutlass.const_expr(v9):
            # Two CTAs per SM, as version 8 got from its 128 registers.
            kernel(m_arg, mW2, mAct, mSorted, mSegs, mSelW, mRes, mOut).launch(
                grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
                use_pdl=True, min_blocks_per_mp=2,
                preferred_smem_carveout=carveout_for(2 * (smem_bytes + 1024)),
            )  # fmt: skip
        else:
            kernel(m_arg, mW2, mAct, mSorted, mSegs, mSelW, mRes, mOut).launch(
                grid=[grid, 1, 1],
                block=[THREADS, 1, 1],
                smem=smem_bytes,
                stream=stream,
                use_pdl=True,
                min_blocks_per_mp=min_blocks,
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


def compile_moe(
    spec: MoeSpec,
    up_grid: int | None = None,
    rows_per_cta: int = 16,
    version: int = 9,
    down_version: int | None = None,
    prenorm: bool = False,
    mma: bool = False,
    small_list: bool = False,
) -> tuple:
    """(moe_up, moe_down) compiled; see `SpecializedPath` for the argument order.

    moe_down runs `down_version` (default: `version`, 8 for moe_up version 13, whose
    shared-first work list both down versions read). With `mma` (prenormalized tokens only),
    moe_up is `moe_mma`'s tensor-core kernel. `small_list`: see `_route_and_publish`."""
    e1 = spec.n_experts + 1
    if up_grid is None and not mma:
        up_grid = 2 * N_SMS
    if down_version is None:
        down_version = 8 if version == 13 else version
    if down_version == 9 and version == 8:
        raise ValueError("moe_down version 9 needs the shared-first work list (moe_up 9 or 13)")
    if mma and not prenorm:
        raise ValueError("the tensor-core moe_up reads prenormalized tokens")
    if mma:
        from agentab.kernels.cute.moe_mma import build_moe_up_mma

        up_host = build_moe_up_mma(spec, up_grid, small_list)
    else:
        up_host = build_moe_up(spec, up_grid, version, prenorm, small_list)
    up = compile_tvm_ffi(
        up_host,
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
    )
    down = compile_tvm_ffi(
        build_moe_down(spec, rows_per_cta, down_version),
        Int32(1),
        fake(BFloat16, (e1, spec.hidden, spec.inter)),
        fake(BFloat16, (spec.rows_act, spec.inter)),
        fake(Int32, (spec.rows_act,)),
        fake(Int32, (spec.max_segments + 1, 3)),
        fake(Float32, (spec.n_assign,)),
        fake(BFloat16, (spec.m_max, spec.hidden)),
        fake(BFloat16, (spec.m_max, spec.hidden)),
    )
    return up, down

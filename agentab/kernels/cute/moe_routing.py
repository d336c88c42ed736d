"""The MoE's shapes, its routing prologue and the launcher both `moe_up` kernels share.

Every CTA of `moe_up` (the SIMT kernel in `moe`, the tensor-core kernel in `moe_mma`) turns the
router logits into the step's work list in shared memory: sigmoid + correction bias, top-k by
warp argmax, renormalized weights times the routed scale; the tokens grouped by expert in a
deterministic order with the shared expert's segment(s) first (expert E, which every token
visits with weight 1), then the routed experts in ascending id, each expert's tokens cut into
segments of at most `SEG`. Recomputing this small list in every CTA costs no grid
synchronisation; CTA 0 also publishes it (and the chosen ids/weights) for `moe_down`. The
shared expert goes first so that `moe_down`'s warps start with its full segments, which
balances the kernel. Routing supports n_group == 1 (Kimi-K2's config); the grouped variant runs
in the standard path and the reference.
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentab.kernels.config import LayerConfig

SEG = 8  # tokens per segment
WARPS = 8
THREADS = 32 * WARPS
N_SMS = 132


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


def weight_atom(no_l1_allocate: bool) -> Any:
    """The 128-bit load of expert weights; with `no_l1_allocate` it does not allocate in L1:
    each weight byte is read once, and the activations that are re-read keep the L1."""
    if no_l1_allocate:
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
def route_and_publish(spec: MoeSpec, m, mLogits, mBias, smem: tuple, outs: tuple, tidx, warp,
                      lane, bidx):  # fmt: skip
    """Build the work list in the `routing_smem` arrays (every CTA of both moe_up kernels does);
    CTA 0 publishes it with `_publish` into `outs` = (ids, weights, sel_w, sorted, segs).
    Returns the segment count.

    The shared expert's segments come first (segments 0 .. ceil(m / 8) - 1). Batches of
    m * top_k <= 32 build the list in one warp (`_list_small`), larger ones with
    `_list_general`'s passes over the experts.
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
    if n_assign <= 32 and m <= SEG:
        _list_small(spec, m, smem, warp, lane)
    else:
        _list_general(spec, m, smem, tidx, warp, lane)
    n_seg = segoff[n_exp + 1]
    if bidx == 0:
        _publish(spec, m, n_seg, sel_e, sel_w, off, sorted_a, seg_e, seg_start, seg_len, *outs,
                 tidx)  # fmt: skip
    return n_seg


@cute.jit
def _list_general(spec: MoeSpec, m, smem: tuple, tidx, warp, lane):
    """Steps 2-4 of the routing for any m: counts per expert, prefix sums, scatter (several
    dependent passes over shared memory, which `_list_small` avoids at m * top_k <= 32)."""
    sel_e, _, cnt, off, segoff, sorted_a, seg_e, seg_start, seg_len = smem
    k, n_exp = spec.top_k, spec.n_experts
    sh = 0  # slot of the shared expert in cnt / off / segoff: the first
    eoff = 1  # routed expert e has slot e + 1
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


def up_host(kernel: Any, grid: int, smem_bytes: int, per_sm: int, carveout: int) -> Any:
    """The host launcher of a moe_up kernel (`moe.build_moe_up`'s SIMT kernel or
    `moe_mma.build_moe_up_mma`'s tensor-core one): both take the same arguments, so
    `moe.compile_moe` compiles either the same way."""

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

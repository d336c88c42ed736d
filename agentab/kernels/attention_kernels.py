"""The Triton kernels of the MLA attention core (imported only where Triton runs: a CUDA
device, or the interpreter in tests). `attention` plans and launches them."""

import triton
import triton.language as tl

from agentab.kernels import triton_interpreter

triton_interpreter.patch()


@triton.jit
def split_kernel(
    q_lat, q_pe, cache, pos, part_o, part_ml, scale, split_len, block_table, split_len_ptr,
    s_qb, s_qh, s_pb, s_ph, s_cb, s_cs, s_ob, s_os, s_oh, s_mb, s_ms, s_bt,
    NH, KVL: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, DYN_SPLIT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    sp = tl.program_id(1)
    n = tl.load(pos + b) + 1
    if DYN_SPLIT:  # set per step on the device, so one captured graph serves any context
        split_len = tl.load(split_len_ptr).to(tl.int32)
    start = sp * split_len
    end = tl.minimum(start + split_len, n)
    offs_h = tl.arange(0, BLOCK_H)
    mh = offs_h < NH
    offs_c = tl.arange(0, KVL)
    offs_r = tl.arange(0, ROPE)
    ql = tl.load(
        q_lat + b * s_qb + offs_h[:, None] * s_qh + offs_c[None, :], mask=mh[:, None], other=0.0
    )
    qp = tl.load(
        q_pe + b * s_pb + offs_h[:, None] * s_ph + offs_r[None, :], mask=mh[:, None], other=0.0
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, KVL], tl.float32)
    for s0 in range(start, end, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        mn = offs_n < end
        if PAGE > 0:  # paged cache: token n lives in block block_table[b, n // PAGE]
            blk = tl.load(block_table + b * s_bt + offs_n // PAGE, mask=mn, other=0)
            row = blk.to(tl.int64) * PAGE + offs_n % PAGE
            base = cache + row[:, None] * s_cs
        else:
            base = cache + b * s_cb + offs_n[:, None] * s_cs
        c = tl.load(base + offs_c[None, :], mask=mn[:, None], other=0.0)
        kp = tl.load(base + KVL + offs_r[None, :], mask=mn[:, None], other=0.0)
        qk = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(kp))
        qk = tl.where(mn[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m = m_new
    o_ptr = part_o + b * s_ob + sp * s_os + offs_h[:, None] * s_oh + offs_c[None, :]
    tl.store(o_ptr, acc, mask=mh[:, None])
    ml = part_ml + b * s_mb + sp * s_ms + offs_h * 2
    tl.store(ml, m, mask=mh)
    tl.store(ml + 1, lsum, mask=mh)


@triton.jit
def combine_kernel(
    part_o, part_ml, out, n_splits,
    s_ob, s_os, s_oh, s_mb, s_ms, s_yb, s_yh,
    KVL: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    ct = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    ms = offs_s < n_splits
    ml = part_ml + b * s_mb + offs_s * s_ms + h * 2
    m = tl.load(ml, mask=ms, other=float("-inf"))
    mx = tl.max(m, 0)
    offs_c = ct * CT + tl.arange(0, CT)
    acc = tl.zeros([CT], tl.float32)
    denom = 0.0
    # Splits in chunks, so a long list of partial outputs never sits in registers at once.
    for s0 in range(0, n_splits, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        mc = offs < n_splits
        mlc = part_ml + b * s_mb + offs * s_ms + h * 2
        mm = tl.load(mlc, mask=mc, other=float("-inf"))
        ll = tl.load(mlc + 1, mask=mc, other=0.0)
        wgt = tl.where(mm > float("-inf"), tl.exp(mm - mx), 0.0)
        denom += tl.sum(wgt * ll, 0)
        o = tl.load(
            part_o + b * s_ob + offs[:, None] * s_os + h * s_oh + offs_c[None, :],
            mask=mc[:, None],
            other=0.0,
        )
        acc += tl.sum(o * wgt[:, None], 0)
    tl.store(out + b * s_yb + h * s_yh + offs_c, (acc / denom).to(out.dtype.element_ty))

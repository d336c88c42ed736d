"""The attention core's combine folded into the value projection: an alternative to the
specialized path's split + combine + value GEMV at batch 1-4 (NOTES.md, 2026-12-02), timed
against it by `uv_tail.py`. The production path keeps the separate kernels, which measured
faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentab.kernels import triton_interpreter
from agentab.kernels.attention import PagedKV, split_partials
from agentab.kernels.config import LayerConfig

triton_interpreter.patch()


@triton.jit
def combine_uv_kernel(
    part_o, part_ml, w_uv, y, pos, split_len, split_len_ptr,
    s_ob, s_os, s_oh, s_mb, s_ms, s_yb,
    KVL: tl.constexpr, VH: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
    SC: tl.constexpr, CT: tl.constexpr, DYN_SPLIT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    offs_r = t * ROWS + tl.arange(0, ROWS)
    if DYN_SPLIT:
        split_len = tl.load(split_len_ptr).to(tl.int32)
    n_splits = tl.cdiv(tl.load(pos + b) + 1, split_len)  # this row's non-empty splits
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_s = tl.arange(0, BLOCK_S)
    ml = part_ml + b * s_mb + h * 2
    m = tl.load(ml + offs_s * s_ms, mask=offs_s < n_splits, other=float("-inf"))
    mx = tl.max(m, 0)
    wgt = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)
    lsum = tl.load(ml + offs_s * s_ms + 1, mask=offs_s < n_splits, other=0.0)
    inv = 1.0 / tl.sum(wgt * lsum, 0)
    acc = tl.zeros([ROWS], tl.float32)
    # Channels in chunks of CT, unrolled so every chunk's loads can be in flight at once: the
    # chunk's latent output (all splits in one load when they fit in SC, else SC at a time),
    # then its slice of the value rows.
    for c0 in tl.static_range(0, KVL, CT):
        offs_c = c0 + tl.arange(0, CT)
        if BLOCK_S <= SC:
            mc = offs_s < n_splits
            o = tl.load(
                part_o + b * s_ob + offs_s[:, None] * s_os + h * s_oh + offs_c[None, :],
                mask=mc[:, None],
                other=0.0,
            )
            lat = tl.sum(o * wgt[:, None], 0)
        else:
            lat = tl.zeros([CT], tl.float32)
            for s0 in range(0, n_splits, SC):
                offs = s0 + tl.arange(0, SC)
                mc = offs < n_splits
                mm = tl.load(ml + offs * s_ms, mask=mc, other=float("-inf"))
                wc = tl.where(mm > float("-inf"), tl.exp(mm - mx), 0.0)
                o = tl.load(
                    part_o + b * s_ob + offs[:, None] * s_os + h * s_oh + offs_c[None, :],
                    mask=mc[:, None],
                    other=0.0,
                )
                lat += tl.sum(o * wc[:, None], 0)
        w = tl.load(w_uv + (h * VH + offs_r)[:, None] * KVL + offs_c[None, :])
        acc += tl.sum(w.to(tl.float32) * (lat * inv)[None, :], 1)
    tl.store(y + b * s_yb + h * VH + offs_r, acc.to(y.dtype.element_ty))


def uv_rows(batch: int, n_heads: int, v_head: int, n_sms: int = 132) -> int:
    """Value-projection rows per program of the fused combine: halved from a whole head down
    to 16 while the grid stays within one program per SM (batch 1 with 16 heads of 128 rows:
    16 rows, 128 programs; batch 4: 64 rows, 128 programs). Each program re-reads its head's
    partial outputs, so more programs also mean more L2 traffic."""
    rows = v_head
    while rows > 16 and batch * n_heads * (v_head // rows) * 2 <= n_sms:
        rows //= 2
    return rows


def mla_decode_uv(
    cfg: LayerConfig,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    w_uv: torch.Tensor,
    out: torch.Tensor,
    paged: PagedKV | None = None,
    rows: int | None = None,
    split_chunk: int = 64,
    channels: int = 64,
    pdl: bool | None = None,
) -> None:
    """The attention core followed by the value projection, in two kernels (GPU, batch 1-4).

    The split kernel is `mla_decode`'s; the combine of its partial outputs is folded into the
    value projection (each program combines its head's splits in fp32 and multiplies them
    with `rows` rows of `w_uv`), so the latent output never goes through memory and one
    kernel boundary goes away. With `pdl` (default: on CUDA tensors) the fused kernel is a
    programmatic dependent of the split kernel. `w_uv`: (heads, v_head, kv_lora) bf16;
    `out`: (batch, heads * v_head) bf16, written in place.
    """
    b, nh, kvl = q_lat.shape
    vh = w_uv.shape[1]
    if w_uv.shape != (nh, vh, kvl) or not w_uv.is_contiguous():
        raise ValueError(f"w_uv: expected a contiguous ({nh}, v_head, {kvl}) tensor")
    if out.shape != (b, nh * vh) or out.stride(1) != 1:
        raise ValueError(f"out: expected ({b}, {nh * vh}) with unit column stride")
    pdl = q_lat.is_cuda if pdl is None else pdl
    rows = uv_rows(b, nh, vh) if rows is None else rows
    if vh % rows:
        raise ValueError(f"rows: {rows} does not divide v_head {vh}")
    p = split_partials(cfg, q_lat, q_pe, cache, positions, paged)
    launch = {"launch_pdl": True} if pdl else {}
    combine_uv_kernel[(b, nh, vh // rows)](
        p.o, p.ml, w_uv, out, positions, p.split_len, p.split_ptr,
        p.o.stride(0), p.o.stride(1), p.o.stride(2), p.ml.stride(0), p.ml.stride(1),
        out.stride(0),
        KVL=kvl, VH=vh, ROWS=rows, BLOCK_S=max(2, 1 << (p.n_splits - 1).bit_length()),
        SC=split_chunk, CT=channels, DYN_SPLIT=paged is not None, GDC=pdl, num_warps=4,
        **launch,
    )  # fmt: skip

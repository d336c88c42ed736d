"""The MLA attention core over the latent cache: ONE implementation shared by both decode paths.

In the absorbed form every head attends over the same latent cache (kv_lora compressed values
plus the qk_rope rope key per token), so this core is identical in both paths and is not where
they differ: the standard path and the specialized path both call `mla_decode`. vLLM's standard
decode runs a fused MLA decode kernel here too (FlashMLA or its Triton MLA decode), so sharing
one fused core keeps the comparison fair.

On CUDA it is a split-KV flash-decoding kernel pair in Triton (partial softmax per split of the
sequence, all heads of a token in one program so each cache tile is read once, then a combine);
on CPU (tests) the same math in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agentab.kernels.config import LayerConfig


def mla_decode_torch(
    cfg: LayerConfig,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Attention in torch, graph-capturable: masks positions past each sequence's token.

    Computed in fp32, or in the queries' dtype where that is wider; the output is bf16 like the
    GPU kernel's unless `out_dtype` says otherwise (the CPU engine keeps its fp32 / fp64)."""
    kvl = cfg.kv_lora
    ct = torch.promote_types(q_lat.dtype, torch.float32)
    kv = cache.to(ct)
    s = torch.einsum("bhc,bsc->bhs", q_lat.to(ct), kv[..., :kvl])
    s = s + torch.einsum("bhr,bsr->bhs", q_pe.to(ct), kv[..., kvl:])
    s = s * cfg.softmax_scale
    idx = torch.arange(cache.shape[1], device=cache.device)
    s = s.masked_fill((idx[None, :] > positions[:, None].long())[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhs,bsc->bhc", p, kv[..., :kvl]).to(out_dtype)


# The split kernel's plan: cache rows per tile, the fewest tiles per split, warps, pipeline
# stages. 64-row tiles with one tile per split allowed give a batch-1 step about two programs
# per SM at contexts from 4096 tokens; 4 warps cover a 16-head x 64-row tile.
BLOCK_N = 64
MIN_TILES_PER_SPLIT = 1
SPLIT_WARPS = 4
SPLIT_STAGES = 2


def split_config() -> tuple[int, int, int, int]:
    """(rows per tile, fewest tiles per split, warps, pipeline stages) of the split kernel."""
    return BLOCK_N, MIN_TILES_PER_SPLIT, SPLIT_WARPS, SPLIT_STAGES


def split_plan(batch: int, max_len: int, n_sms: int = 132) -> tuple[int, int]:
    """(number of splits, tokens per split): about two programs per SM over the whole batch,
    each split a whole number of tiles (at least `MIN_TILES_PER_SPLIT`)."""
    blocks = max(1, math.ceil(max_len / BLOCK_N))
    want = max(1, math.ceil(2 * n_sms / batch))
    n_splits = min(max(1, blocks // MIN_TILES_PER_SPLIT), want)
    split_len = math.ceil(blocks / n_splits) * BLOCK_N
    n_splits = math.ceil(max_len / split_len)
    return n_splits, split_len


def paged_splits(batch: int, max_len: int, n_sms: int = 132) -> int:
    """The split grid that covers `split_plan(batch, n)` for every n <= max_len.

    split_plan never plans more than min(blocks, two programs per SM over the batch) splits, and
    rounding the split length up only lowers the count, so this bound holds for every length.
    """
    return max(1, min(math.ceil(max_len / BLOCK_N), math.ceil(2 * n_sms / batch)))


def combine_tile(batch: int, n_heads: int, kvl: int, n_sms: int = 132) -> int:
    """Channels per combine program: 128, halved down to 32 until there are two programs per SM
    (batch 1 with 16 heads reads its partials with 256 programs instead of 64)."""
    ct = min(128, kvl)
    while ct > 32 and batch * n_heads * (kvl // ct) < 2 * n_sms:
        ct //= 2
    return ct


@dataclass
class PagedKV:
    """Where a batch's latent cache lives when it is paged (the local engine's KV cache).

    `cache` is one layer's (slots, kv_width) bf16 slots; sequence b's token n is in slot
    `block_table[b, n // block_size] * block_size + n % block_size`, and this step's new token
    goes to `new_slots[b]` (also row 1 of `positions_and_slots`, the CuTe preparation's form).
    `max_len` bounds every sequence's length (it sizes the split grid); `split_len` is a
    one-element int32 device tensor with the tokens per split for this step (`split_plan` of
    the step's longest sequence), so a graph captured once serves any length.
    """

    cache: torch.Tensor
    block_table: torch.Tensor  # (batch, max blocks) int32
    new_slots: torch.Tensor  # (batch,) int64
    # (2, batch) int32: positions, then new_slots; None where no CuTe preparation reads it
    positions_and_slots: torch.Tensor | None
    block_size: int
    max_len: int
    split_len: torch.Tensor  # (1,) int32


@dataclass
class Partials:
    """The split kernel's per-split outputs and how the splits were laid out."""

    o: torch.Tensor  # (batch, grid splits, heads, kv_lora) fp32, unnormalised
    ml: torch.Tensor  # (batch, grid splits, heads, 2) fp32: running max, sum of exponentials
    n_splits: int  # the grid's splits (some may be empty for shorter rows)
    split_len: int  # tokens per split, or 0 when it is read from `split_ptr` on the device
    split_ptr: torch.Tensor


def split_partials(
    cfg: LayerConfig,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    paged: PagedKV | None = None,
) -> Partials:
    """The split kernel alone: each split's unnormalised output and softmax statistics."""
    from agentab.kernels.attention_kernels import split_kernel  # Triton only where it runs

    b, nh, kvl = q_lat.shape
    block_n, _min_tiles, warps, stages = split_config()
    if paged is None:
        n_splits, split_len = split_plan(b, cache.shape[1])
        table, split_ptr, page, s_bt = positions, positions, 0, 0
        s_cb, s_cs = cache.stride(0), cache.stride(1)
    else:  # enough programs for the most splits any length up to max_len plans
        n_splits, split_len = paged_splits(b, paged.max_len), 0
        table, split_ptr, page = paged.block_table, paged.split_len, paged.block_size
        s_bt = table.stride(0)
        s_cb, s_cs = 0, cache.stride(0)  # (slots, width): a token's row is its slot
    part_o = torch.empty(b, n_splits, nh, kvl, device=q_lat.device, dtype=torch.float32)
    part_ml = torch.empty(b, n_splits, nh, 2, device=q_lat.device, dtype=torch.float32)
    block_h = max(16, 1 << (nh - 1).bit_length())
    split_kernel[(b, n_splits)](
        q_lat, q_pe, cache, positions, part_o, part_ml, cfg.softmax_scale, split_len, table,
        split_ptr,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), s_cb, s_cs,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_ml.stride(0), part_ml.stride(1),
        s_bt, nh, KVL=kvl, ROPE=cfg.qk_rope, BLOCK_H=block_h, BLOCK_N=block_n, PAGE=page,
        DYN_SPLIT=paged is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return Partials(part_o, part_ml, n_splits, split_len, split_ptr)


def mla_decode_triton(
    cfg: LayerConfig,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    paged: PagedKV | None = None,
) -> torch.Tensor:
    """Split-KV flash decoding on the GPU; two kernels (split, combine)."""
    from agentab.kernels.attention_kernels import combine_kernel

    b, nh, kvl = q_lat.shape
    p = split_partials(cfg, q_lat, q_pe, cache, positions, paged)
    out = torch.empty(b, nh, kvl, device=q_lat.device, dtype=torch.bfloat16)
    ct = combine_tile(b, nh, kvl)
    combine_kernel[(b, nh, kvl // ct)](
        p.o, p.ml, out, p.n_splits,
        p.o.stride(0), p.o.stride(1), p.o.stride(2), p.ml.stride(0), p.ml.stride(1),
        out.stride(0), out.stride(1),
        KVL=kvl, BLOCK_S=max(2, 1 << (p.n_splits - 1).bit_length()), CHUNK=2048 // ct, CT=ct,
        num_warps=4,
    )  # fmt: skip
    return out


def mla_decode(
    cfg: LayerConfig,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    paged: PagedKV | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """o_lat (batch, n_heads, kv_lora) for the absorbed queries; the cache holds the new token.

    q_lat: (batch, n_heads, kv_lora) bf16, q_pe: (batch, n_heads, qk_rope) bf16 (already rotated),
    cache: (batch, max_len, kv_width) bf16, or with `paged` its (slots, kv_width) layer slots;
    positions: (batch,) int32. On the CPU the inputs may be fp32 / fp64 and `out_dtype` keeps
    that precision (`mla_decode_torch`); the GPU kernel's output is bf16.
    """
    if q_lat.is_cuda:
        return mla_decode_triton(cfg, q_lat, q_pe, cache, positions, paged).to(out_dtype)
    if paged is not None:
        # each row's slots up to its own position (later ones repeat its last, and are masked),
        # so only block-table entries the row owns are read
        idx = torch.arange(paged.max_len, device=cache.device)
        pos = torch.minimum(idx[None, :], positions.long()[:, None])
        table = paged.block_table.long().gather(1, pos // paged.block_size)
        cache = cache[table * paged.block_size + pos % paged.block_size]  # (batch, max_len, width)
    return mla_decode_torch(cfg, q_lat, q_pe, cache, positions, out_dtype)

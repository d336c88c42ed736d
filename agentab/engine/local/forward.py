"""One engine step through the model: the standard forward for any step, and the CPU
implementation of the specialized decode for pure-decode steps.

The standard forward takes the step as vLLM's model runner does: every scheduled token of every
row in one flat batch (prefill chunks, decode tokens, mixed), each layer writing the new tokens'
latent entries into the paged cache first, then attending. As in vLLM's MLA, the step's decode
rows (one token each) attend together in one batched call per layer in the absorbed form, reading
the paged cache through their block tables (on the GPU the paged Triton MLA decode the CUDA
graphs run), and each prefill chunk attends over its own cached context, causal within the
chunk, in the expanded form. The MoE routes every token with the same grouped top-k as the
kernels' standard path.

`specialized_decode_cpu` is what the `latency_specialized` backend runs on a machine without a
GPU: the fused decoder's math as `agentab.kernels.reference` defines it (the fp32 oracle every
CuTe DSL kernel is checked against), one decode token per row. It is a different implementation
of the same layer (per-sequence attention loop, per-expert dispatch, fp32 throughout), so the
routing, fallback and token-equality tests exercise two code paths; its speed means nothing and
the manifest labels it `cpu-torch`, never as the fused decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from agentab.engine.local.config import ModelConfig
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.local.tensor_parallel import TPGroup
from agentab.engine.outputs import StepInputs
from agentab.kernels import reference
from agentab.kernels.attention import PagedKV, mla_decode, split_plan
from agentab.kernels.config import LayerConfig
from agentab.kernels.standard import StandardPath, grouped_topk
from agentab.kernels.weights import DecodeState, LayerWeights

PREFILL_QUERY_SLICE = 2048
# On the GPU, prefill attention must run in a fused kernel: an error rather than a silent
# fallback to the math kernel (fp32 scores, an order of magnitude slower).
FUSED_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
ANY_SDPA = [*FUSED_SDPA, SDPBackend.MATH]
SINGLE = TPGroup()  # one rank: every collective is a no-op


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device: a blocking copy would first
    drain the stream, so under async scheduling the host would sit out the step in flight and
    the device then wait for the host (the CUDA driver stages a pageable source at once)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)


@dataclass
class DecodeRows:
    """A step's decoding tokens (one-token rows, and every token of a verify row) as the
    batched decode attention reads them, one query each, built once per step and read by every
    layer (the per-layer work is then one call, with no host loop)."""

    tokens: torch.Tensor  # (queries,) int64: each query token's index in the flat batch
    positions: torch.Tensor  # (queries,) int32: the token's position (its context: position + 1)
    block_table: torch.Tensor  # (queries, max blocks) int64: its row's
    new_slots: torch.Tensor  # (queries,) int64: where the token's latent entry was written
    positions_and_slots: torch.Tensor  # (2, queries) int32: `PagedKV`'s form of the two above
    block_size: int
    max_len: int  # the longest context among the queries
    split_len: torch.Tensor  # (1,) int64: the Triton decode's tokens per split for this step

    @staticmethod
    def of(
        inputs: StepInputs, tokens: np.ndarray, rows: np.ndarray, device: torch.device
    ) -> DecodeRows:
        """The step's tokens `tokens` (flat indices) of rows `rows` (the row of each), each
        attended as a query of its own over its row's context up to its own position, on
        `device`. A verify row's tokens are such queries: the layer writes all of the step's
        latent entries before it attends, so each sees the row's earlier tokens and no later
        one."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return to_device(a, device)

        positions = inputs.positions[tokens]
        max_len = int(positions.max()) + 1
        new_slots = inputs.slot_mapping[tokens]
        pos_slots = dev(np.stack([positions, new_slots]).astype(np.int32))
        return DecodeRows(
            tokens=dev(tokens),
            positions=pos_slots[0],
            block_table=dev(inputs.block_tables[rows]),
            new_slots=dev(new_slots),
            positions_and_slots=pos_slots,
            block_size=inputs.block_size,
            max_len=max_len,
            split_len=dev(np.array([split_plan(len(rows), max_len)[1]], dtype=np.int64)),
        )

    def paged(self, kv: torch.Tensor) -> PagedKV:
        """The rows over one layer's cache slots, as the CUDA graphs hand them to `mla_decode`."""
        return PagedKV(
            cache=kv,
            block_table=self.block_table,
            new_slots=self.new_slots,
            positions_and_slots=self.positions_and_slots,
            block_size=self.block_size,
            max_len=self.max_len,
            split_len=self.split_len,
        )


@dataclass
class DeviceBatch:
    """StepInputs as device tensors, plus the host-side row bounds the prefill loop needs."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    starts: list[int]
    context_lens: list[int]
    last_token: torch.Tensor  # (rows,) index of each row's last token in the flat batch
    block_size: int
    decode: DecodeRows | None  # one-token and verify rows' tokens, attended in one batched call
    prefill_rows: list[int]  # the prefill chunks of several tokens, attended one by one
    # what every layer of the step reads the same (the rotary angles of its positions, a
    # prefill row's context slots), computed once on first use: an eager step is bound by its
    # host launches, and recomputing these in each of 61 layers was a tenth of them
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def rope(self, cfg: LayerConfig, heads: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, (tokens, 1, half) for per-head queries when
        `heads`, else (tokens, half)."""
        if "rope" not in self._memo:  # one model config per step: every layer's is the same
            cos, sin = reference.rope_cos_sin(cfg, self.positions)
            self._memo["rope"] = ((cos, sin), (cos[:, None], sin[:, None]))
        return self._memo["rope"][heads]  # type: ignore[index]

    def context_slots(self, row: int) -> torch.Tensor:
        """The cache slots of a prefill row's whole context (its cached prefix and this chunk)."""
        key = ("slots", row)
        if key not in self._memo:
            self._memo[key] = PagedLatentCache.slots(
                self.block_tables[row], self.context_lens[row], self.block_size
            )
        return self._memo[key]  # type: ignore[return-value]

    @staticmethod
    def of(
        inputs: StepInputs, device: torch.device, last_sampled: torch.Tensor | None = None
    ) -> DeviceBatch:
        """The step on `device`; tokens the previous step was still sampling when this one was
        scheduled (`inputs.prev_rows`) are taken from `last_sampled`, where it left them."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return to_device(a, device)

        token_ids = dev(inputs.token_ids)
        prev = inputs.prev_rows
        if prev is not None and (prev >= 0).any():
            if last_sampled is None:
                raise ValueError("the step names pending tokens but no sampled-ids buffer")
            rows = dev(prev)
            taken = last_sampled.index_select(0, rows.clamp(min=0))
            token_ids = torch.where(rows >= 0, taken, token_ids)
        counts = np.diff(inputs.starts)
        # one-token rows and verify rows (a decoding row's token and its drafts) attend in
        # the batched absorbed form, one query per token, as the decode graphs run them;
        # expanding a verify row's whole context into per-head keys, as a prefill chunk's
        # is, cost more than the rest of a mixed step's work at long contexts
        batched = (counts == 1) | inputs.is_decode
        decode = np.flatnonzero(batched)
        tokens = np.flatnonzero(np.repeat(batched, counts))  # the batched rows' tokens
        return DeviceBatch(
            token_ids=token_ids,
            positions=dev(inputs.positions),
            slot_mapping=dev(inputs.slot_mapping),
            block_tables=dev(inputs.block_tables),
            starts=inputs.starts.tolist(),
            context_lens=inputs.context_lens.tolist(),
            last_token=dev(inputs.starts[1:] - 1),
            block_size=inputs.block_size,
            decode=(
                DecodeRows.of(inputs, tokens, np.repeat(decode, counts[decode]), device)
                if len(decode)
                else None
            ),
            prefill_rows=np.flatnonzero(~batched).tolist(),
        )


def embed(
    cfg: ModelConfig, w: ModelWeights, token_ids: torch.Tensor, tp: TPGroup = SINGLE
) -> torch.Tensor:
    """Embedding lookup (an id maps to row id mod vocab_rows); with tensor parallelism each
    rank holds a block of rows and the all-reduce adds the one rank that had the row."""
    rows = token_ids % cfg.vocab_rows
    if not tp.active:
        return w.embed.index_select(0, rows)
    local = rows - tp.rank * cfg.rank_vocab_rows
    mine = (local >= 0) & (local < cfg.rank_vocab_rows)
    x = w.embed.index_select(0, local.clamp(0, cfg.rank_vocab_rows - 1))
    return tp.all_reduce(x * mine[:, None].to(x.dtype))


def greedy(
    cfg: ModelConfig, w: ModelWeights, x: torch.Tensor, tp: TPGroup = SINGLE
) -> torch.Tensor:
    """Final norm, LM head over the vocabulary shard (fp32 logits), argmax: (rows,) int64.
    With tensor parallelism the ranks' logits are gathered first, so every rank samples the
    same ids."""
    h = F.rms_norm(x.float(), (x.shape[-1],), w.final_norm.float(), cfg.layer.rms_eps)
    logits = tp.all_gather_last(h @ w.lm_head.float().t())
    return logits.argmax(dim=-1)


def standard_attention(
    cfg: LayerConfig,
    w: LayerWeights,
    x: torch.Tensor,
    b: DeviceBatch,
    kv: torch.Tensor,
    tp: TPGroup = SINGLE,
) -> torch.Tensor:
    """Input norm, MLA over the paged cache (`rows_attention`), output projection, residual.

    Three parts, so that the piecewise graphs (engine.local.piecewise) run the very same code:
    `attention_in` and `attention_out` depend only on the step's tokens, `rows_attention` on
    each row's context."""
    # cos and sin come shaped to broadcast (`DeviceBatch.rope`), computed once per step
    rope_q, rope_k = b.rope(cfg, heads=True), b.rope(cfg, heads=False)
    q, q_pe = attention_in(cfg, w, x, rope_q, rope_k, b.slot_mapping, kv)
    o = rows_attention(cfg, w, q[..., : cfg.qk_nope], q_pe, kv, b)
    return attention_out(cfg, w, x, o, tp)


def attention_in(
    cfg: LayerConfig,
    w: LayerWeights,
    x: torch.Tensor,
    rope_q: tuple[torch.Tensor, torch.Tensor],
    rope_k: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    kv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention needs of the tokens `x`: input norm, qkv_a, the latent norms, q_b and
    RoPE, and each token's latent entry written into the cache at `slots`. Returns the queries
    (tokens, n_heads, qk_head; their nope part is read) and the roped q_pe (tokens, n_heads,
    qk_rope). `rope_q` / `rope_k`: cos and sin of the tokens' positions, shaped for the
    per-head queries and for the shared key."""
    t, nh, kvl, eps = x.shape[0], cfg.n_heads, cfg.kv_lora, cfg.rms_eps
    dt = x.dtype
    hn = F.rms_norm(x, (cfg.hidden,), w.attn_norm.to(dt), eps)
    qkv = F.linear(hn, w.w_qkv_a.to(dt))
    q_c, kv_c, k_pe = qkv.split([cfg.q_lora, kvl, cfg.qk_rope], dim=-1)
    q_c = F.rms_norm(q_c, (cfg.q_lora,), w.q_a_norm.to(dt), eps)
    kv_c = F.rms_norm(kv_c, (kvl,), w.kv_a_norm.to(dt), eps)
    q = F.linear(q_c, w.w_q_b.to(dt)).view(t, nh, cfg.qk_head)
    q_pe = reference.apply_rope(q[..., cfg.qk_nope :], *rope_q).to(dt)
    k_pe = reference.apply_rope(k_pe, *rope_k).to(dt)
    # index_copy_, as the decode graphs write: no host sync, so the piecewise graphs capture it
    kv.index_copy_(0, slots, torch.cat([kv_c, k_pe], dim=-1).to(kv.dtype))
    return q, q_pe


def attention_out(
    cfg: LayerConfig, w: LayerWeights, x: torch.Tensor, o: torch.Tensor, tp: TPGroup = SINGLE
) -> torch.Tensor:
    """The attention output `o` (tokens, n_heads, v_head) projected by W_O onto the residual
    `x`."""
    t, dt = x.shape[0], x.dtype
    return x + tp.all_reduce(F.linear(o.reshape(t, cfg.n_heads * cfg.v_head), w.w_o.to(dt)))


def rows_attention(
    cfg: LayerConfig,
    w: LayerWeights,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    b: DeviceBatch,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every row's attention over its cached context (which holds this step's entries):
    (tokens, n_heads, v_head), written into `out` where given (the piecewise graphs' static
    buffer, read by the next captured piece).

    As vLLM runs MLA: the decoding tokens (one-token rows, and each token of a verify row at its
    own position) attend together in the absorbed form (`decode_rows_attention`), so a mixed
    step pays one decode call per layer however many rows decode or verify beside its prefill;
    a prefill chunk expands its cached latents into per-head keys and values and runs fused
    attention (`prefill_attention`), which is compute-efficient where the absorbed form would
    multiply every query by the 576-wide latents (and wasteful for a verify row's few queries,
    which would expand its whole context for them).
    """
    dt = q_nope.dtype
    o = out if out is not None else q_nope.new_empty((*q_nope.shape[:2], cfg.v_head))
    if b.decode is not None:
        tok = b.decode.tokens
        o[tok] = decode_rows_attention(cfg, w, q_nope[tok], q_pe[tok], kv, b.decode)
    for i in b.prefill_rows:
        first, last = b.starts[i], b.starts[i + 1]
        ctx = kv[b.context_slots(i)].to(dt)
        o[first:last] = prefill_attention(cfg, w, q_nope[first:last], q_pe[first:last], ctx)
    return o


def decode_rows_attention(
    cfg: LayerConfig,
    w: LayerWeights,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    rows: DecodeRows,
) -> torch.Tensor:
    """All decode rows' attention in the absorbed form, in one call: (rows, n_heads, v_head).

    The queries are absorbed (q_lat = q_nope W_UK) and the latent output projected through W_UV
    by one batched GEMM each, as the standard decode layer does. On the GPU the latent attention
    is the paged Triton MLA decode the CUDA graphs run (`mla_decode` over the block table, no
    gather of the rows' caches); on the CPU the same call's torch form, in the step's dtype.
    """
    dt = q_nope.dtype
    q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk_t.to(dt).transpose(1, 2)).transpose(0, 1)
    o_lat = mla_decode(cfg, q_lat, q_pe, kv, rows.positions, rows.paged(kv), out_dtype=dt)
    return torch.bmm(o_lat.transpose(0, 1), w.w_uv.to(dt).transpose(1, 2)).transpose(0, 1)


def decode_attention(
    cfg: LayerConfig, w: LayerWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor
) -> torch.Tensor:
    """One token's attention in the absorbed form over its whole context: (n_heads, v_head).

    The definition the batched decode (`decode_rows_attention`) and the expanded prefill form
    (`prefill_attention`) are checked against, one row at a time."""
    kvl, dt = cfg.kv_lora, q_nope.dtype
    q_lat = torch.einsum("hd,hcd->hc", q_nope, w.w_uk_t.to(dt))
    s = (q_lat @ ctx[:, :kvl].t() + q_pe @ ctx[:, kvl:].t()) * cfg.softmax_scale
    p = torch.softmax(s.to(torch.promote_types(dt, torch.float32)), dim=-1).to(dt)
    return torch.einsum("hc,hvc->hv", p @ ctx[:, :kvl], w.w_uv.to(dt))


def prefill_attention(
    cfg: LayerConfig,
    w: LayerWeights,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ctx: torch.Tensor,
    query_slice: int | None = None,
) -> torch.Tensor:
    """A chunk of queries over the sequence's cache, with per-head keys and values expanded
    from the latents (k = [W_UK c | k_pe], v = W_UV c): (n, n_heads, v_head).

    The chunk is the last n tokens of `ctx` (the cached prefix and earlier chunks come first),
    so query i sees keys 0..len(ctx)-n+i: a causal mask aligned to the lower right, which
    `scaled_dot_product_attention` runs in its flash and memory-efficient kernels without
    materializing a mask or the scores (given 4-D inputs; with 3-D ones it falls back to a math
    kernel that upcasts to fp32 and was measured 10x slower on the H200). The values are
    zero-padded to the query/key head width because the flash kernel wants one width for all
    three (as vLLM pads them for MLA prefill).
    On the CPU, whose kernel materializes the scores, queries go in slices of `query_slice`.
    """
    kvl, nh, dt = cfg.kv_lora, cfg.n_heads, q_nope.dtype
    n, total = q_nope.shape[0], ctx.shape[0]
    c, rope = ctx[:, :kvl], ctx[:, kvl:]
    k_nope = torch.einsum("lc,hcd->hld", c, w.w_uk_t.to(dt))
    k = torch.cat([k_nope, rope.unsqueeze(0).expand(nh, -1, -1)], dim=-1)
    v = F.pad(torch.einsum("lc,hvc->hlv", c, w.w_uv.to(dt)), (0, cfg.qk_head - cfg.v_head))
    qh = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # (n_heads, n, qk_head)
    step = query_slice or (n if ctx.is_cuda else PREFILL_QUERY_SLICE)
    slices = []
    with sdpa_kernel(FUSED_SDPA if ctx.is_cuda else ANY_SDPA):
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            seen = total - n + hi  # keys visible to the slice's last query
            o = _sdpa(qh[:, lo:hi], k[:, :seen], v[:, :seen], cfg.softmax_scale)
            slices.append(o[..., : cfg.v_head])
    # one slice (the GPU's case) needs no copy into an output buffer
    out = slices[0] if len(slices) == 1 else torch.cat(slices, dim=1)
    return out.transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right causal attention of (heads, n, d) queries over (heads, m, d) keys, as a
    batch of one: the fused kernels take 4-D inputs only."""
    mask = causal_lower_right(q.shape[1], k.shape[1])
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]


def standard_moe(
    cfg: LayerConfig,
    w: LayerWeights,
    h1: torch.Tensor,
    grouped: StandardPath | None = None,
    tp: TPGroup = SINGLE,
) -> torch.Tensor:
    """Post-attention norm, router (fp32 logits), grouped top-k, shared + routed experts.

    With `grouped` (the GPU) the experts run as the kernels' standard path runs them (tokens
    sorted by expert, grouped GEMMs); on the CPU one expert at a time.
    """
    dt = h1.dtype
    hn = F.rms_norm(h1, (cfg.hidden,), w.ffn_norm.to(dt), cfg.rms_eps)
    if grouped is not None:
        logits = torch.mm(hn, w.w_gate.t(), out_dtype=torch.float32)
        ids, weights = grouped_topk(cfg, logits, w.gate_bias)
        return h1 + tp.all_reduce(grouped.moe(hn, ids, weights))
    logits = hn.float() @ w.w_gate.float().t()
    ids, weights = grouped_topk(cfg, logits, w.gate_bias.float())
    out = torch.zeros_like(hn)
    for s in range(cfg.n_shared):
        out += _swiglu(hn, w.ws13[s], w.ws2[s])
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = _swiglu(hn[tok], w.w13_all[e], w.w2_all[e])
        out.index_add_(0, tok, y * weights[tok, slot][:, None].to(dt))
    return h1 + tp.all_reduce(out)


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    inter = w13.shape[0] // 2
    gu = F.linear(x, w13.to(x.dtype))
    return F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], w2.to(x.dtype))


def standard_forward(
    cfg: ModelConfig,
    w: ModelWeights,
    cache: PagedLatentCache,
    b: DeviceBatch,
    dtype: torch.dtype,
    grouped: list[StandardPath] | None = None,
    tp: TPGroup = SINGLE,
    *,
    num_layers: int | None = None,
    out_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Any step (prefill, mixed, decode, verify) on the standard path: the hidden states of the
    tokens `out_index` (default: each row's last token).

    `grouped`: the weight sets' `StandardPath`s, whose grouped MoE the GPU uses; `num_layers`:
    run only the first layers (the early-exit drafter, engine.local.spec)."""
    layer_cfg = cfg.rank_layer
    x = embed(cfg, w, b.token_ids, tp).to(dtype)
    for layer in range(cfg.num_layers if num_layers is None else num_layers):
        lw = w.layer(layer)
        h1 = standard_attention(layer_cfg, lw, x, b, cache.layer(layer), tp)
        path = None if grouped is None else grouped[layer % len(grouped)]
        x = standard_moe(layer_cfg, lw, h1, path, tp)
    return x.index_select(0, b.last_token if out_index is None else out_index)


def specialized_decode_cpu(
    cfg: ModelConfig,
    w: ModelWeights,
    cache: PagedLatentCache,
    b: DeviceBatch,
    tp: TPGroup = SINGLE,
    *,
    out_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode or verify step through the reference layer, fp32: the hidden states of the
    tokens `out_index` (default: each row's last token).

    The reference attends one query per sequence, so every token of the step is a query of its
    own at its position, over the cached context before it. A verify row's q tokens are causal
    within the step: before a layer attends, it writes all of the step's latent entries of that
    layer, so query j of a row reads the entries of the row's queries 0..j-1 (the reference puts
    the query's own entry last itself, computed the same way).

    With tensor parallelism the reference runs on the rank's slice, whose attention and MoE
    outputs are partial sums: each is all-reduced before its residual add."""
    layer_cfg = cfg.rank_layer
    x = embed(cfg, w, b.token_ids, tp).float()
    pos = b.positions.to(torch.int32)
    row_of = np.repeat(np.arange(len(b.context_lens)), np.diff(b.starts))
    positions = pos.tolist()
    multi = len(positions) > len(b.context_lens)  # some row has several queries (verify)
    width = max(positions) + 1
    earlier = [
        PagedLatentCache.slots(b.block_tables[r], p, b.block_size)
        for r, p in zip(row_of.tolist(), positions, strict=True)
    ]
    for layer in range(cfg.num_layers):
        lw = w.layer(layer)
        kv = cache.layer(layer)
        if multi:  # this step's entries first: later queries of a row attend to earlier ones
            kv[b.slot_mapping] = latent_entries(layer_cfg, lw, x, pos)
        ctx = torch.zeros(len(earlier), width, cache.kv_width, dtype=kv.dtype)
        for i, sl in enumerate(earlier):
            ctx[i, : len(sl)] = kv[sl]
        a = reference.attention_stage(layer_cfg, lw, x, DecodeState(cache=ctx, positions=pos))
        kv[b.slot_mapping] = a.cache_entry
        h1 = x + tp.all_reduce(a.h1 - x) if tp.active else a.h1
        out = reference.moe_stage(layer_cfg, lw, h1).out
        x = h1 + tp.all_reduce(out - h1) if tp.active else out
    return x.index_select(0, b.last_token if out_index is None else out_index)


def latent_entries(
    cfg: LayerConfig, w: LayerWeights, x: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The latent cache entries ([kv_c | roped k_pe], bf16) of tokens `x` at `positions`, as
    `reference.attention_stage` computes its `cache_entry`."""
    kvl = cfg.kv_lora
    hn = reference.rms_norm(x.float(), w.attn_norm, cfg.rms_eps)
    qkv = hn @ w.w_qkv_a.float().t()  # the reference's very product, so the same rounding
    kv_c = reference.rms_norm(qkv[:, cfg.q_lora : cfg.q_lora + kvl], w.kv_a_norm, cfg.rms_eps)
    k_pe = reference.apply_rope(qkv[:, cfg.q_lora + kvl :], *reference.rope_cos_sin(cfg, positions))
    return torch.cat([kv_c, k_pe], dim=-1).to(torch.bfloat16)

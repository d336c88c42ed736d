"""The oracle: the layer's exact math in torch with fp32 activations and accumulation.

Both decode paths are checked against these functions. Weights stay bf16 (they are the model);
every activation is fp32 and every product accumulates in fp32; the one rounding the math itself
prescribes is the latent cache, which holds bf16, so the new token's entry is rounded to bf16
before attention reads it (both paths store and read the same bf16 entry).

The layer is split in two stages with the residual stream `h1` between them, so a check can
feed a path's own `h1` into `moe_stage` and compare expert choices on identical router inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import DecodeState, LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32: x / sqrt(mean(x^2) + eps) * weight."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_cos_sin(cfg: LayerConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (batch, qk_rope // 2), for the half-split (NeoX) rotary layout."""
    half = cfg.qk_rope // 2
    inv = cfg.rope_theta ** (
        -torch.arange(half, device=positions.device, dtype=torch.float32) * 2.0 / cfg.qk_rope
    )
    ang = positions.float()[:, None] * inv[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of x (..., qk_rope) as halves [x1 | x2] (the NeoX layout), in fp32.

    cos and sin are (..., qk_rope // 2) and broadcast over the head dims x has beyond them
    (callers that pass them pre-shaped skip the unsqueezes). The one RoPE of every decode path:
    the reference, the eager and the torch.compile standard paths and the local engine call
    it, so they cannot drift apart; it is plain tensor ops, which torch.compile traces.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    while cos.dim() < x1.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class Routing:
    """The router's decision for each token: top-k expert ids and their final weights."""

    ids: torch.Tensor  # (batch, top_k) int64, sorted by biased score, best first
    weights: torch.Tensor  # (batch, top_k) fp32, renormalized and scaled
    biased_scores: torch.Tensor  # (batch, n_experts) fp32: sigmoid + bias (what selection ranks)
    masked_scores: torch.Tensor  # (batch, n_experts) fp32: biased, -inf outside kept groups


def route(cfg: LayerConfig, logits: torch.Tensor, bias: torch.Tensor) -> Routing:
    """DeepSeek-V3 routing: sigmoid scores, + correction bias, grouped top-k, renormalize.

    Groups are ranked by the sum of their two best biased scores; the experts of the best
    `topk_group` groups compete for the `top_k` slots; the weights are the *unbiased* sigmoid
    scores of the winners, divided by their sum, times `routed_scaling`.
    """
    scores = torch.sigmoid(logits.float())
    biased = scores + bias.float()[None, :]
    b, e = biased.shape
    if cfg.n_group > 1:
        grouped = biased.view(b, cfg.n_group, e // cfg.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_score.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros(b, cfg.n_group, dtype=torch.bool, device=biased.device)
        mask.scatter_(1, keep, True)
        masked = biased.masked_fill(~mask.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
    else:
        masked = biased
    ids = masked.topk(cfg.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling
    return Routing(ids=ids, weights=w, biased_scores=biased, masked_scores=masked)


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert in fp32: w2 @ (silu(gate x) * (up x)); w13 stacks [gate; up]."""
    inter = w13.shape[0] // 2
    gu = x @ w13.float().t()
    return (torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]) @ w2.float().t()


@dataclass
class AttentionOut:
    h1: torch.Tensor  # (batch, hidden) fp32: residual stream after attention
    cache_entry: torch.Tensor  # (batch, kv_width) bf16: what the step wrote into the cache


def attention_stage(
    cfg: LayerConfig, w: LayerWeights, x: torch.Tensor, state: DecodeState
) -> AttentionOut:
    """Input RMSNorm, MLA decode in the absorbed form, output projection, residual add."""
    b = x.shape[0]
    nh, nope, kvl = cfg.n_heads, cfg.qk_nope, cfg.kv_lora
    xf = x.float()
    hn = rms_norm(xf, w.attn_norm, cfg.rms_eps)
    qkv = hn @ w.w_qkv_a.float().t()
    q_c = rms_norm(qkv[:, : cfg.q_lora], w.q_a_norm, cfg.rms_eps)
    kv_c = rms_norm(qkv[:, cfg.q_lora : cfg.q_lora + kvl], w.kv_a_norm, cfg.rms_eps)
    k_pe = qkv[:, cfg.q_lora + kvl :]
    cos, sin = rope_cos_sin(cfg, state.positions)
    k_pe = apply_rope(k_pe, cos, sin)
    entry = torch.cat([kv_c, k_pe], dim=-1).to(torch.bfloat16)

    q = (q_c @ w.w_q_b.float().t()).view(b, nh, cfg.qk_head)
    q_nope, q_pe = q[..., :nope], apply_rope(q[..., nope:], cos, sin)
    q_lat = torch.einsum("bhd,hcd->bhc", q_nope, w.w_uk_t.float())  # (b, nh, kv_lora)

    outs = []
    for i in range(b):
        n = int(state.positions[i]) + 1
        kv = state.cache[i, :n].float().clone()
        kv[n - 1] = entry[i].float()
        s = (q_lat[i] @ kv[:, :kvl].t() + q_pe[i] @ kv[:, kvl:].t()) * cfg.softmax_scale
        p = torch.softmax(s, dim=-1)  # (nh, n)
        outs.append(p @ kv[:, :kvl])  # (nh, kv_lora)
    o_lat = torch.stack(outs)
    o = torch.einsum("bhc,hvc->bhv", o_lat, w.w_uv.float()).reshape(b, nh * cfg.v_head)
    h1 = xf + o @ w.w_o.float().t()
    return AttentionOut(h1=h1, cache_entry=entry)


@dataclass
class MoeOut:
    out: torch.Tensor  # (batch, hidden) fp32: the layer's output
    routing: Routing


def moe_stage(
    cfg: LayerConfig, w: LayerWeights, h1: torch.Tensor, ids: torch.Tensor | None = None
) -> MoeOut:
    """Post-attention RMSNorm, router, shared + routed SwiGLU experts, residual add.

    With `ids` given (a path's own expert choices, already checked against `route`), those
    experts are used and only their weights come from the fp32 scores: a check then measures
    the experts' arithmetic without a near-tie flipping one expert for another.
    """
    h1 = h1.float()
    hn = rms_norm(h1, w.ffn_norm, cfg.rms_eps)
    logits = hn @ w.w_gate.float().t()
    r = route(cfg, logits, w.gate_bias)
    if ids is not None:
        ids = ids.long()
        sc = torch.sigmoid(logits).gather(1, ids)
        r = Routing(
            ids=ids,
            weights=sc / sc.sum(-1, keepdim=True) * cfg.routed_scaling,
            biased_scores=r.biased_scores,
            masked_scores=r.masked_scores,
        )
    moe = torch.zeros_like(h1)
    for s in range(cfg.n_shared):
        moe += swiglu_expert(hn, w.ws13[s], w.ws2[s])
    for e in torch.unique(r.ids).tolist():
        tok, slot = (r.ids == e).nonzero(as_tuple=True)
        y = swiglu_expert(hn[tok], w.w13_all[e], w.w2_all[e])
        moe.index_add_(0, tok, y * r.weights[tok, slot][:, None])
    return MoeOut(out=h1 + moe, routing=r)


@dataclass
class LayerOut:
    out: torch.Tensor  # (batch, hidden) fp32
    h1: torch.Tensor  # (batch, hidden) fp32
    cache_entry: torch.Tensor  # (batch, kv_width) bf16
    routing: Routing


def forward(cfg: LayerConfig, w: LayerWeights, x: torch.Tensor, state: DecodeState) -> LayerOut:
    """One decode step of the layer for a batch of one new token per sequence."""
    with torch.no_grad():
        a = attention_stage(cfg, w, x, state)
        m = moe_stage(cfg, w, a.h1)
    return LayerOut(out=m.out, h1=a.h1, cache_entry=a.cache_entry, routing=m.routing)

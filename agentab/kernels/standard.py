"""The eager standard decode path (`standard-eager`): a general engine's ops, one by one.

The path named `standard` is this layer under torch.compile (`standard_torch_compile.py`), as vLLM
runs it; this eager version stays as a reference point and runs prefill-sized MoE batches.
It mirrors vLLM's standard DeepSeek-V3 / Kimi-K2 decode (the `auto` backend) op for op:

- `F.rms_norm` (torch's fused kernel): vLLM's RMSNorm custom op.
- one `F.linear` over stacked q_a and kv_a: `fused_qkv_a_proj`.
- two `F.rms_norm` (q_a_layernorm, kv_a_layernorm): the same two RMSNorms.
- `F.linear` q_b: `q_b_proj` (cuBLAS).
- rotary on q_pe and k_pe from a cos/sin table: `rotary_emb` with its cos_sin_cache.
- index_put of the new latent entry: `concat_and_cache_mla`.
- `torch.bmm` with W_UK^T and W_UV: MLA's absorbed `W_UK_T` / `W_UV` bmm calls.
- `attention.mla_decode` (shared with the specialized path): FlashMLA / Triton MLA decode.
- `F.linear` o_proj, residual add, `F.rms_norm`: `o_proj` + `fused_add_rms_norm`.
- fp32 router GEMM, then sigmoid / bias / grouped top-k as torch ops: gate + `grouped_topk`.
- sort tokens by expert, grouped GEMM (gate/up), SiLU*mul, grouped GEMM (down), weighted sum:
  `moe_align_block_size`, `fused_moe_kernel`, `silu_and_mul`, `fused_moe_kernel`, `moe_sum`.
- shared expert: linear, SiLU*mul, linear: the shared_experts MLP.

The routed experts run through `torch._grouped_mm` (CUTLASS grouped GEMM on sm90) over the
tokens sorted by expert with offsets computed on the GPU, so it needs no host sync, captures in a
graph, and reads only the touched experts' weights: a grouped MoE like vLLM's, not a dense loop
over all experts. The router logits are fp32 (vLLM's are bf16 in some configs); fp32 keeps expert
choices comparable with the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentab.kernels.attention import mla_decode
from agentab.kernels.config import LayerConfig
from agentab.kernels.reference import apply_rope, rope_cos_sin
from agentab.kernels.weights import DecodeState, LayerWeights

# Routed rows go back to their tokens by an atomic index_add_ for decode-sized batches (one
# kernel), and by a gather and a sum over the k choices for prefill-sized ones, where the
# atomics took a third of an 8,192-token chunk on the H200 (benchmarks/kernels/NOTES.md).
GATHER_COMBINE_TOKENS = 256


@dataclass
class StepOut:
    """What one decode step of a path returns (all device tensors)."""

    out: torch.Tensor  # (batch, hidden) bf16: the layer's output
    h1: torch.Tensor  # (batch, hidden) bf16: residual stream after attention
    ids: torch.Tensor  # (batch, top_k) int: chosen experts
    weights: torch.Tensor  # (batch, top_k) fp32: their final weights
    router_in: torch.Tensor  # what the router GEMM read: (batch, hidden)
    router_in_normed: bool  # True: router_in is already RMS-normalized; False: it is h1


def router_logits(hn: torch.Tensor, w_gate: torch.Tensor) -> torch.Tensor:
    """fp32 router logits, as vLLM computes them: on the GPU a bf16 GEMM with an fp32 output
    (no fp32 copy of the gate), on the CPU in fp32."""
    if hn.is_cuda:
        return torch.mm(hn, w_gate.t(), out_dtype=torch.float32)
    return hn.float() @ w_gate.float().t()


def grouped_topk(
    cfg: LayerConfig, logits: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's grouped_topk as torch ops: (ids int64, weights fp32)."""
    scores = logits.sigmoid()
    biased = scores + bias[None, :]
    b, e = biased.shape
    if cfg.n_group > 1:
        g = biased.view(b, cfg.n_group, e // cfg.n_group)
        gscore = g.topk(2, dim=-1).values.sum(-1)
        keep = gscore.topk(cfg.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore).scatter_(1, keep, 1.0)
        emask = gmask.unsqueeze(-1).expand(b, cfg.n_group, e // cfg.n_group).reshape(b, e)
        biased = biased.masked_fill(emask == 0, float("-inf"))
    ids = biased.topk(cfg.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling
    return ids, w


class StandardPath:
    """Modular torch ops, eager (`standard-eager`); `step` allocates nothing on the host side
    and captures in a graph. `standard_torch_compile.TorchCompileStandardPath` is the same
    layer under torch.compile (`standard`); this one stays as the reference and for
    prefill-sized batches."""

    name = "standard-eager"
    impl = "torch-eager"

    def __init__(self, cfg: LayerConfig, weights: LayerWeights, max_position: int) -> None:
        self.cfg = cfg
        self.w = weights
        pos = torch.arange(max_position + 1, device=weights.w_o.device)
        cos, sin = rope_cos_sin(cfg, pos)
        self.cos_sin = torch.cat([cos, sin], dim=-1)  # vLLM's cos_sin_cache, fp32
        self.w13 = weights.w13_all[: cfg.n_experts].transpose(1, 2)  # (E, hidden, 2I)
        self.w2 = weights.w2_all[: cfg.n_experts].transpose(1, 2)  # (E, I, hidden)

    def attention(self, x: torch.Tensor, state: DecodeState) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        b, nh, eps = x.shape[0], cfg.n_heads, cfg.rms_eps
        hn = F.rms_norm(x, (cfg.hidden,), w.attn_norm, eps)
        qkv = F.linear(hn, w.w_qkv_a)
        q_c, kv_c, k_pe = qkv.split([cfg.q_lora, cfg.kv_lora, cfg.qk_rope], dim=-1)
        q_c = F.rms_norm(q_c, (cfg.q_lora,), w.q_a_norm, eps)
        kv_c = F.rms_norm(kv_c, (cfg.kv_lora,), w.kv_a_norm, eps)
        q = F.linear(q_c, w.w_q_b).view(b, nh, cfg.qk_head)
        cs = self.cos_sin.index_select(0, state.positions)
        half = cfg.qk_rope // 2
        cos, sin = cs[:, :half], cs[:, half:]
        q_pe = apply_rope(q[..., cfg.qk_nope :], cos[:, None], sin[:, None]).to(x.dtype)
        k_pe = apply_rope(k_pe, cos, sin).to(x.dtype)
        entry = torch.cat([kv_c, k_pe], dim=-1)
        if state.paged is None:
            rows = torch.arange(b, device=x.device)
            state.cache[rows, state.positions.long()] = entry
        else:  # the serving engine's paged cache: the slot its scheduler assigned
            state.cache.index_copy_(0, state.paged.new_slots, entry.to(state.cache.dtype))
        q_lat = torch.bmm(q[..., : cfg.qk_nope].transpose(0, 1), w.w_uk_t.transpose(1, 2))
        o_lat = mla_decode(  # (in the step's dtype: bf16 on the GPU, the CPU's fp32 in tests)
            cfg,
            q_lat.transpose(0, 1),
            q_pe,
            state.cache,
            state.positions,
            state.paged,
            out_dtype=x.dtype,
        )
        o = torch.bmm(o_lat.transpose(0, 1), w.w_uv.transpose(1, 2))  # (nh, b, v_head)
        attn = F.linear(o.transpose(0, 1).reshape(b, nh * cfg.v_head), w.w_o)
        return x + attn

    def moe(self, hn: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        k, inter = cfg.top_k, cfg.moe_inter
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(cfg.n_experts, device=hn.device, dtype=torch.int32)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // k
        xs = hn.index_select(0, tok)
        gu = torch._grouped_mm(xs, self.w13, offs=offs)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = torch._grouped_mm(act, self.w2, offs=offs)
        y = y * weights.flatten().index_select(0, order)[:, None].to(y.dtype)
        if hn.shape[0] < GATHER_COMBINE_TOKENS:
            routed = torch.zeros_like(hn).index_add_(0, tok, y)
        else:  # back to (token, choice) order, then a sum over the k choices
            unsort = torch.empty_like(order)
            unsort[order] = torch.arange(order.numel(), device=order.device)
            routed = y.index_select(0, unsort).view(-1, k, hn.shape[-1]).sum(1)
        shared = torch.zeros_like(hn)
        for s in range(cfg.n_shared):
            gs = F.linear(hn, w.ws13[s])
            shared = shared + F.linear(
                F.silu(gs[:, : cfg.shared_inter]) * gs[:, cfg.shared_inter :], w.ws2[s]
            )
        return routed + shared

    def step(self, x: torch.Tensor, state: DecodeState) -> StepOut:
        cfg, w = self.cfg, self.w
        with torch.no_grad():
            h1 = self.attention(x, state)
            hn = F.rms_norm(h1, (cfg.hidden,), w.ffn_norm, cfg.rms_eps)
            ids, weights = grouped_topk(cfg, router_logits(hn, w.w_gate), w.gate_bias)
            out = h1 + self.moe(hn, ids, weights)
        return StepOut(
            out=out, h1=h1, ids=ids, weights=weights, router_in=hn, router_in_normed=True
        )

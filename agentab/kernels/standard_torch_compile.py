"""The standard decode path as vLLM runs it: the layer under torch.compile, two opaque ops.

vLLM compiles its model with inductor and captures CUDA graphs around the compiled pieces; the
attention is left out of the compiled graphs (its piecewise split) and the fused MoE is a custom
op. This path does the same for one decoder layer:

- inductor compiles everything else: the RMSNorms (written out in torch, so inductor fuses the
  residual add into the post-attention norm: vLLM's `fused_add_rms_norm`), the two low-rank
  norms, rotary embedding from the cos/sin table, the cache entry's concatenation, the router's
  sigmoid / bias / top-k / renormalization, the shared expert's SiLU * up, and the sum over the
  k routed outputs together with the shared expert and the residual; the GEMMs and bmms go to
  cuBLAS as inductor's extern kernels.
- `agentab::mla_attention` (opaque): the cache write (one index_copy_, as vLLM's
  `concat_and_cache_mla`), the shared MLA decode core (`attention.mla_decode`: split-KV
  flash decoding in Triton) and the up-projection through W_UV, the op vLLM's attention
  backend runs between its graph pieces. The up-projection is a bmm over heads that writes
  straight into the (batch, heads * v_head) rows o_proj reads, as vLLM's `_v_up_proj` does;
  left to inductor, the heads-major bmm result needs a transposing copy from batch 2 up.
- `agentab::fused_moe` (opaque): the routed experts through `triton_moe` (alignment, gate/up
  with SiLU * up, down with the router weight).

The layer function takes every weight as an argument, so one compiled graph serves every layer
and weight set of the same shape; the batch dimension becomes dynamic after the first new batch
size (dynamo's automatic dynamic shapes), batch 1 keeps its own specialized graph.

The eager op-by-op version of the same math is `standard.StandardPath` (`standard-eager`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentab.kernels.attention import PagedKV, mla_decode
from agentab.kernels.config import LayerConfig
from agentab.kernels.reference import apply_rope, rope_cos_sin
from agentab.kernels.standard import StepOut, grouped_topk, router_logits
from agentab.kernels.weights import DecodeState, LayerWeights

IMPL = "torch-compile+triton-moe"  # what manifests record for this path


@dataclass(frozen=True)
class _MlaShape:
    """The three fields of LayerConfig that `mla_decode` reads (a custom op takes no config)."""

    kv_lora: int
    qk_rope: int
    softmax_scale: float


@torch.library.custom_op("agentab::mla_attention", mutates_args=("cache",))
def mla_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    entry: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor | None,
    split_len: torch.Tensor | None,
    block_size: int,
    max_len: int,
    kv_lora: int,
    qk_rope: int,
    softmax_scale: float,
    w_uv: torch.Tensor,
) -> torch.Tensor:
    """Write the new latent entries at `slots` of the cache seen as (rows, width), attend, and
    up-project each head's latent output through `w_uv` (heads, v_head, kv_lora): the
    (batch, heads * v_head) input of o_proj.

    Unpaged (`block_table` None): `cache` is (batch, max_len, width) and slot b * max_len + pos;
    paged: `cache` is the layer's (slots, width) and the block table addresses the context.
    """
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, entry)
    shape = _MlaShape(kv_lora, qk_rope, softmax_scale)
    paged = None
    if block_table is not None:
        assert split_len is not None
        paged = PagedKV(cache=cache, block_table=block_table, new_slots=slots,
                        positions_and_slots=None, block_size=block_size, max_len=max_len,
                        split_len=split_len)  # fmt: skip
    # the attention kernels take any batch / head strides but a unit stride within a head
    q_lat, q_pe = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_lat, q_pe))
    o_lat = mla_decode(shape, q_lat, q_pe, cache, positions, paged)  # type: ignore[arg-type]
    b, nh, v_head = o_lat.shape[0], w_uv.shape[0], w_uv.shape[1]
    out = o_lat.new_empty(b, nh, v_head)
    torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out.view(b, nh * v_head)


@mla_attention.register_fake
def _mla_attention_fake(q_lat, q_pe, entry, cache, positions, slots, block_table, split_len,
                        block_size, max_len, kv_lora, qk_rope, softmax_scale, w_uv):  # type: ignore[no-untyped-def]  # fmt: skip
    return q_lat.new_empty(q_lat.shape[0], w_uv.shape[0] * w_uv.shape[1], dtype=torch.bfloat16)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


_WEIGHTS = (
    "attn_norm", "w_qkv_a", "q_a_norm", "kv_a_norm", "w_q_b", "w_uk_t", "w_uv", "w_o",
    "ffn_norm", "w_gate", "gate_bias", "w13_all", "w2_all", "ws13", "ws2",
)  # fmt: skip


def decode_layer(
    cfg: LayerConfig,
    weights: tuple[torch.Tensor, ...],
    cos_sin: torch.Tensor,
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor | None,
    block_table: torch.Tensor | None,
    split_len: torch.Tensor | None,
    block_size: int,
    max_len: int,
) -> tuple[torch.Tensor, ...]:
    """One decode step of the layer (what torch.compile traces): out, h1, ids, weights, hn."""
    (attn_norm, w_qkv_a, q_a_norm, kv_a_norm, w_q_b, w_uk_t, w_uv, w_o, ffn_norm, w_gate,
     gate_bias, w13_all, w2_all, ws13, ws2) = weights  # fmt: skip
    b, nh, eps = x.shape[0], cfg.n_heads, cfg.rms_eps
    hn0 = _rms(x, attn_norm, eps)
    qkv = F.linear(hn0, w_qkv_a)
    q_c, kv_c, k_pe = qkv.split([cfg.q_lora, cfg.kv_lora, cfg.qk_rope], dim=-1)
    q_c = _rms(q_c, q_a_norm, eps)
    kv_c = _rms(kv_c, kv_a_norm, eps)
    q = F.linear(q_c, w_q_b).view(b, nh, cfg.qk_head)
    cs = cos_sin.index_select(0, positions)
    half = cfg.qk_rope // 2
    cos, sin = cs[:, :half], cs[:, half:]
    q_pe = apply_rope(q[..., cfg.qk_nope :], cos[:, None], sin[:, None]).to(x.dtype)
    entry = torch.cat([kv_c, apply_rope(k_pe, cos, sin).to(x.dtype)], dim=-1)
    if slots is None:  # unpaged (batch, max_len, width): row b * max_len + position
        slots = torch.arange(b, device=x.device) * cache.shape[1] + positions.long()
    q_lat = torch.bmm(q[..., : cfg.qk_nope].transpose(0, 1), w_uk_t.transpose(1, 2))
    o = torch.ops.agentab.mla_attention(
        q_lat.transpose(0, 1), q_pe, entry, cache, positions, slots, block_table, split_len,
        block_size, max_len, cfg.kv_lora, cfg.qk_rope, cfg.softmax_scale, w_uv,
    )  # fmt: skip  # (b, nh * v_head)
    h1 = x + F.linear(o, w_o)
    hn = _rms(h1, ffn_norm, eps)  # inductor fuses the residual add into this norm
    ids, topk_w = grouped_topk(cfg, router_logits(hn, w_gate), gate_bias)
    ids = ids.to(torch.int32)
    routed = torch.ops.agentab.fused_moe(hn, w13_all, w2_all, ids, topk_w, cfg.n_experts)
    shared = torch.zeros_like(hn, dtype=torch.float32)
    for s in range(cfg.n_shared):
        gs = F.linear(hn, ws13[s])
        act = F.silu(gs[:, : cfg.shared_inter]) * gs[:, cfg.shared_inter :]
        shared = shared + F.linear(act, ws2[s]).float()
    # the k routed rows added one by one: a pointwise kernel. As `sum(1)` this is a reduction
    # over a strided axis whose tile inductor tunes per process, measured at 35 or 280 us at
    # batch 64 in two processes of the same code; the unrolled adds have no such choice.
    acc = h1.float() + shared
    for j in range(routed.shape[1]):
        acc = acc + routed[:, j].float()
    out = acc.to(x.dtype)
    return out, h1, ids, topk_w, hn


_compiled: Any = None


def compiled_decode_layer() -> Any:
    """The process's one compiled `decode_layer` (fullgraph: a graph break is an error)."""
    global _compiled
    if _compiled is None:
        import agentab.kernels.triton_moe  # noqa: F401  (registers agentab::fused_moe)

        _compiled = torch.compile(decode_layer, fullgraph=True)
    return _compiled


class TorchCompileStandardPath:
    """`standard`: the layer under torch.compile with attention and the MoE as opaque ops."""

    name = "standard"
    impl = IMPL

    def __init__(self, cfg: LayerConfig, weights: LayerWeights, max_position: int) -> None:
        self.cfg = cfg
        self.w = weights
        self.weights = tuple(getattr(weights, n) for n in _WEIGHTS)
        pos = torch.arange(max_position + 1, device=weights.w_o.device)
        cos, sin = rope_cos_sin(cfg, pos)
        self.cos_sin = torch.cat([cos, sin], dim=-1)  # vLLM's cos_sin_cache, fp32
        self.layer = compiled_decode_layer()

    def step(self, x: torch.Tensor, state: DecodeState) -> StepOut:
        paged = state.paged
        with torch.no_grad():
            if paged is None:
                outs = self.layer(self.cfg, self.weights, self.cos_sin, x, state.positions,
                                  state.cache, None, None, None, 0, 0)  # fmt: skip
            else:
                assert isinstance(paged, PagedKV)
                outs = self.layer(self.cfg, self.weights, self.cos_sin, x, state.positions,
                                  paged.cache, paged.new_slots, paged.block_table,
                                  paged.split_len, paged.block_size, paged.max_len)  # fmt: skip
        out, h1, ids, weights, hn = outs
        return StepOut(out=out, h1=h1, ids=ids, weights=weights, router_in=hn,
                       router_in_normed=True)  # fmt: skip

"""The specialized decode path: CuTe DSL kernels for one layer, captured in one CUDA graph.

Batch 1..4 (`SMALL`), ten kernels per layer, every weight streamed with 128-bit loads and
the first chunks prefetched before the PDL wait (numbered by step; 3 and 4 share a launch):
  1. input RMSNorm + q_a/kv_a projection                 (gemv, norm fused)          (a)
  2. q_a RMSNorm + q_b projection                         (gemv, norm fused)          (b)
  3+4. absorbed key projection q_nope -> q_lat per head  (gemv, grouped)             (b)
     and, in extra CTAs of the same launch, kv_a RMSNorm + RoPE + cache write and RoPE of q_pe
     (mla_prep.prep_body)
  5-6. attention over the latent cache                    (attention.mla_decode, SHARED with
                                                            the standard path: Triton)
  7. value projection o_lat -> o per head                 (gemv, grouped)
  8. o_proj + residual add                                (gemv, residual fused)      (c)
  9. post-attention RMSNorm + router GEMM (fp32 logits), 1/rms kept for the experts  (c)+(d)
 10. routing (sigmoid, bias, top-k, renormalize, scale) + shared & routed gate/up    (d)+(e)
 11. shared & routed down projections + weighted sum + residual add                  (e)
Batch 5..64: the attention half is the standard path's (cuBLAS uses tensor cores there, where
the SIMT GEMV stops paying, docs/kernels.md) and the MoE half is kernels 10-11, whose
per-expert token count stays small at these batch sizes.

Each GEMV shape is compiled once per batch size (1..4); the MoE kernels once for batch 1..4
(SIMT moe_up) and once for batch 5..64 (tensor-core moe_up), each for up to 64 tokens (the token
count is a kernel argument).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentab.kernels.config import LayerConfig
from agentab.kernels.reference import rope_cos_sin
from agentab.kernels.standard import StandardPath, StepOut
from agentab.kernels.weights import DecodeState, LayerWeights

SMALL = 4
M_MAX = 64
DOWN_ROWS = 16  # moe_down's output rows per CTA
_compiled: dict[Any, Any] = {}


def _cached(key: Any, make: Any) -> Any:
    """One compile per key in this process (every path instance of a shape shares it)."""
    if key not in _compiled:
        _compiled[key] = make()
    return _compiled[key]


def prenorm_tokens(batch: int) -> bool:
    """Whether moe_up reads RMS-normalized tokens: above batch 4, where the attention half
    already computes them for the router and moe_up runs on the tensor cores."""
    return batch > SMALL


def gemv_specs(cfg: LayerConfig, batch: int) -> dict[str, Any]:
    """The five projections of the attention half and the router, as GEMV specs."""
    from agentab.kernels.cute.gemv import GemvSpec

    h, nh = cfg.hidden, cfg.n_heads
    qkv_cols = cfg.q_lora + cfg.kv_width
    q_cols = nh * cfg.qk_head
    eps = cfg.rms_eps
    return {
        "qkv_a": GemvSpec(n=qkv_cols, k=h, m=batch, x_cols=h, out_cols=qkv_cols, norm=True,
                          eps=eps),
        "q_b": GemvSpec(n=q_cols, k=cfg.q_lora, m=batch, x_cols=qkv_cols, out_cols=q_cols,
                        norm=True, eps=eps),
        "absorb": GemvSpec(n=nh * cfg.kv_lora, k=cfg.qk_nope, m=batch, x_cols=q_cols,
                           out_cols=nh * cfg.kv_lora, groups=nh, x_group_stride=cfg.qk_head),
        "uv": GemvSpec(n=nh * cfg.v_head, k=cfg.kv_lora, m=batch, x_cols=nh * cfg.kv_lora,
                       out_cols=nh * cfg.v_head, groups=nh, x_group_stride=cfg.kv_lora),
        "o_proj": GemvSpec(n=h, k=nh * cfg.v_head, m=batch, x_cols=nh * cfg.v_head, out_cols=h,
                           resid=True),
        "router": GemvSpec(n=cfg.n_experts, k=h, m=batch, x_cols=h, out_cols=cfg.n_experts,
                           norm=True, out_f32=True, write_rs=True, eps=eps),
    }  # fmt: skip


def compile_all(
    cfg: LayerConfig, batch: int, max_len: int, max_pos: int, paged: bool = False
) -> dict[str, Any]:
    """Compile (or fetch) every CuTe DSL kernel the path needs at this batch size (`paged`:
    the MLA preparation writes a paged cache of `max_len` slots, see `cute.mla_prep`)."""
    from agentab.kernels.cute.gemv import compile_gemv
    from agentab.kernels.cute.mla_prep import PrepSpec
    from agentab.kernels.cute.moe import compile_moe
    from agentab.kernels.cute.moe_routing import MoeSpec

    out: dict[str, Any] = {}
    moe_spec = MoeSpec.from_config(cfg, M_MAX)
    out["moe_spec"] = moe_spec
    prenorm = prenorm_tokens(batch)
    out["prenorm"] = prenorm
    out["moe"] = _cached(
        ("moe", moe_spec, prenorm, DOWN_ROWS),
        lambda: compile_moe(moe_spec, tensor_cores=prenorm, rows_per_cta=DOWN_ROWS),
    )
    if batch <= SMALL:
        # the MLA preparation runs in extra CTAs of the absorbed-query GEMV
        pspec = PrepSpec.from_config(cfg, batch, max_len, max_pos, paged)
        for name, spec in gemv_specs(cfg, batch).items():
            if name == "absorb":
                fn = _cached(("gemv+prep", spec, pspec), lambda s=spec: compile_gemv(s, pspec))
            else:
                fn = _cached(("gemv", spec), lambda s=spec: compile_gemv(s))
            out[name] = (spec, fn)
    return out


class SpecializedPath:
    """One layer's specialized decode step for a fixed batch size; buffers are preallocated."""

    name = "specialized"

    def __init__(
        self,
        cfg: LayerConfig,
        weights: LayerWeights,
        max_position: int,
        batch: int,
        max_len: int,
        paged: bool = False,
    ) -> None:
        """`paged`: steps get a DecodeState with `paged` set (a serving engine's block-table
        cache of `max_len` slots per layer) instead of one contiguous cache per sequence."""
        from agentab.kernels.cute.moe import alloc_buffers

        if not weights.shared_fused:
            raise ValueError("the specialized path needs the shared expert stored with the others")
        if not 1 <= batch <= M_MAX:
            raise ValueError(f"batch {batch}: the specialized path serves 1..{M_MAX}")
        self.cfg, self.w, self.b = cfg, weights, batch
        dev = weights.w_o.device
        self.k = compile_all(cfg, batch, max_len, max_position + 1, paged)
        bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
        nh, h = cfg.n_heads, cfg.hidden
        pos = torch.arange(max_position + 1, device=dev)
        cos, sin = rope_cos_sin(cfg, pos)
        self.cos_sin = torch.cat([cos, sin], dim=-1).contiguous()
        self.qkv = torch.empty(batch, cfg.q_lora + cfg.kv_width, device=dev, dtype=bf16)
        self.q = torch.empty(batch, nh * cfg.qk_head, device=dev, dtype=bf16)
        self.q_pe = torch.empty(batch, nh, cfg.qk_rope, device=dev, dtype=bf16)
        self.q_lat = torch.empty(batch, nh * cfg.kv_lora, device=dev, dtype=bf16)
        self.o = torch.empty(batch, nh * cfg.v_head, device=dev, dtype=bf16)
        self.h1 = torch.zeros(M_MAX, h, device=dev, dtype=bf16)
        self.logits = torch.zeros(M_MAX, cfg.n_experts, device=dev, dtype=f32)
        self.rs = torch.zeros(M_MAX, device=dev, dtype=f32)
        self.ids = torch.zeros(M_MAX, cfg.top_k, device=dev, dtype=i32)
        self.wts = torch.zeros(M_MAX, cfg.top_k, device=dev, dtype=f32)
        self.out = torch.zeros(M_MAX, h, device=dev, dtype=bf16)
        self.moe_buf = alloc_buffers(self.k["moe_spec"], dev)
        self.dummy_bf16 = torch.zeros(1, 8, device=dev, dtype=bf16)
        self.dummy_vec = torch.zeros(8, device=dev, dtype=bf16)
        self.dummy_rs = torch.zeros(batch, device=dev, dtype=f32)
        self.router_in_normed = batch > SMALL
        # (M_MAX rows: moe_up takes the normalized tokens at its compiled shape when prenorm)
        self.hn_full = torch.zeros(M_MAX, h, device=dev, dtype=bf16)
        self.hn = self.hn_full[:batch]
        self.prenorm = self.k["prenorm"]
        if batch > SMALL:
            self.standard = StandardPath(cfg, weights, max_position)

    def outputs(self) -> StepOut:
        """The step's outputs (views of the preallocated buffers)."""
        b = self.b
        router_in = self.hn if self.router_in_normed else self.h1[:b]
        return StepOut(
            self.out[:b], self.h1[:b], self.ids[:b], self.wts[:b], router_in, self.router_in_normed
        )

    def _attention_small(self, x: torch.Tensor, state: DecodeState) -> None:
        from agentab.kernels.attention import mla_decode

        cfg, w, k, b = self.cfg, self.w, self.k, self.b
        dv, dr = self.dummy_vec, self.dummy_bf16

        def gemv(name: str, wt: torch.Tensor, x_: torch.Tensor, g: Any, r: Any, y: Any) -> None:
            _spec, fn = k[name]
            fn(wt, x_, g, r, y, self.dummy_rs)

        gemv("qkv_a", w.w_qkv_a, x, w.attn_norm, dr, self.qkv)
        gemv("q_b", w.w_q_b, self.qkv, w.q_a_norm, dr, self.q)
        w_uk = w.w_uk_t.view(-1, cfg.qk_nope)
        # the preparation's positions: (2, batch) positions and slots for a paged cache
        pos = state.positions if state.paged is None else state.paged.positions_and_slots
        assert pos is not None  # the local engine's paged batches carry them
        _spec, absorb = k["absorb"]
        absorb(w_uk, self.q, dv, dr, self.q_lat, self.dummy_rs, self.qkv, pos,
               w.kv_a_norm, self.cos_sin, state.cache, self.q_pe)  # fmt: skip
        o_lat = mla_decode(
            cfg, self.q_lat.view(b, cfg.n_heads, cfg.kv_lora), self.q_pe, state.cache,
            state.positions, state.paged,
        )  # fmt: skip
        gemv("uv", w.w_uv.view(-1, cfg.kv_lora), o_lat.view(b, -1), dv, dr, self.o)
        gemv("o_proj", w.w_o, self.o, dv, x, self.h1[:b])
        _spec, router = k["router"]
        router(w.w_gate, self.h1[:b], w.ffn_norm, dr, self.logits[:b], self.rs[:b])

    def _attention_large(self, x: torch.Tensor, state: DecodeState) -> None:
        cfg, w, b = self.cfg, self.w, self.b
        h1 = self.standard.attention(x, state)
        self.h1[:b].copy_(h1)
        hn = F.rms_norm(h1, (cfg.hidden,), w.ffn_norm, cfg.rms_eps)
        self.hn.copy_(hn)
        self.logits[:b].copy_(torch.mm(hn, w.w_gate.t(), out_dtype=torch.float32))
        if not self.prenorm:
            self.rs[:b].copy_(torch.rsqrt(h1.float().pow(2).mean(-1) + cfg.rms_eps))

    def step(self, x: torch.Tensor, state: DecodeState) -> StepOut:
        w, b, mb = self.w, self.b, self.moe_buf
        with torch.no_grad():
            if b <= SMALL:
                self._attention_small(x, state)
            else:
                self._attention_large(x, state)
            up, down = self.k["moe"]
            tokens = self.hn_full if self.prenorm else self.h1
            up(b, self.logits, w.gate_bias, tokens, w.ffn_norm, w.w13_all, mb.act, self.ids,
               self.wts, mb.sorted_a, mb.segs, mb.sel_w, self.rs)  # fmt: skip
            down(b, w.w2_all, mb.act, mb.sorted_a, mb.segs, mb.sel_w, self.h1, self.out)
        return self.outputs()

"""The specialized decode path: CuTe DSL kernels for one layer, captured in one CUDA graph.

Batch 1..4 (`SMALL`), ten kernels per layer, every weight streamed with 128-bit loads and
the first chunks prefetched before the PDL wait (numbered as in the eleven-kernel version):
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
the SIMT GEMV stops paying: measured 1.3 TB/s at M=8 against cuBLAS's 2.8) and the MoE half is
kernels 10-11, whose per-expert token count stays small at these batch sizes.

Each GEMV shape is compiled once per batch size (1..4); the MoE kernels once per kernel version
(`config.kernels_version()`), for up to 64 tokens (the token count is a kernel argument).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentab.kernels.config import LayerConfig, kernels_version
from agentab.kernels.reference import rope_cos_sin
from agentab.kernels.standard import StandardPath, StepOut
from agentab.kernels.weights import DecodeState, LayerWeights

SMALL = 4
M_MAX = 64
# The MLA preparation runs as extra CTAs of the absorbed-query GEMV (one launch fewer); set
# AGENTAB_KERNELS_FUSE_PREP=0 to launch it as its own kernel.
FUSE_PREP = os.environ.get("AGENTAB_KERNELS_FUSE_PREP", "1") != "0"
# Kernel version 10 streams these projections with `cute/gemv_stream.py` (cp.async rings).
STREAMED = ("qkv_a", "q_b", "o_proj")


@dataclass(frozen=True)
class MoePlan:
    """Which MoE kernels a kernel version builds (NOTES.md says what each measured)."""

    up: int  # moe_up version
    down: int  # moe_down version
    prenorm: bool = False  # above batch 4, moe_up reads the router's RMS-normalized tokens
    mma: bool = False  # above batch 4, moe_up runs on the tensor cores (needs prenorm)
    small_list: bool = False  # the one-warp work list at m * top_k <= 32


# 10 changed only the dense GEMVs and 17-18 only the attention plan; 13 pairs moe_up 13 with
# moe_down 8. Versions 11-12 (a cp.async ring in moe_up) and 15 (bulk L2 prefetch), measured
# slower, were removed: commits df509fb and e42f017 have them.
MOE_PLANS = {
    8: MoePlan(8, 8),
    9: MoePlan(9, 9),
    10: MoePlan(9, 9),
    13: MoePlan(13, 8, prenorm=True),
    14: MoePlan(13, 8, prenorm=True, mma=True),
    16: MoePlan(13, 8, prenorm=True, mma=True, small_list=True),
    17: MoePlan(13, 8, prenorm=True, mma=True, small_list=True),
    18: MoePlan(13, 8, prenorm=True, mma=True, small_list=True),
}
# moe_down's output rows per CTA (a plan knob, read at compile time; explore.py times others)
DOWN_ROWS = 16
UP_GRID = 0  # moe_up's CTAs (SIMT kernel; 0: two per SM)
_compiled: dict[Any, Any] = {}


def _cached(key: Any, make: Any) -> Any:
    from agentab.kernels.cute.common import pdl_mode

    key = (key, pdl_mode())  # the PDL trigger placement is traced into every kernel
    if key not in _compiled:
        _compiled[key] = make()
    return _compiled[key]


def prenorm_tokens(version: int, batch: int) -> bool:
    """Whether moe_up reads RMS-normalized tokens (from version 13 above batch 4, where the
    attention half already computes them for the router) instead of normalizing them per item."""
    return MOE_PLANS[version].prenorm and batch > SMALL


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
    from agentab.kernels.cute.gemv_stream import compile_gemv_stream, stream_plan
    from agentab.kernels.cute.mla_prep import PrepSpec, compile_prep
    from agentab.kernels.cute.moe import MoeSpec, compile_moe

    out: dict[str, Any] = {}
    moe_spec = MoeSpec.from_config(cfg, M_MAX)
    version = kernels_version()
    out["moe_spec"] = moe_spec
    plan = MOE_PLANS[version]
    up_v, down_v, small_list = plan.up, plan.down, plan.small_list
    prenorm = prenorm_tokens(version, batch)
    mma = prenorm and plan.mma
    out["prenorm"] = prenorm
    out["moe"] = _cached(
        ("moe", moe_spec, up_v, down_v, prenorm, mma, small_list, DOWN_ROWS, UP_GRID),
        lambda: compile_moe(
            moe_spec,
            up_grid=UP_GRID or None,
            rows_per_cta=DOWN_ROWS,
            version=up_v,
            down_version=down_v,
            prenorm=prenorm,
            mma=mma,
            small_list=small_list,
        ),
    )
    if batch <= SMALL:
        pspec = PrepSpec.from_config(cfg, batch, max_len, max_pos, paged)
        for name, spec in gemv_specs(cfg, batch).items():
            if name == "absorb" and FUSE_PREP:
                fn = _cached(("gemv+prep", spec, pspec), lambda s=spec: compile_gemv(s, pspec))
            elif version == 10 and name in STREAMED and stream_plan(spec) is not None:
                fn = _cached(("gemv-stream", spec), lambda s=spec: compile_gemv_stream(s))
            else:
                fn = _cached(("gemv", spec), lambda s=spec: compile_gemv(s))
            out[name] = (spec, fn)
        if not FUSE_PREP:
            out["prep"] = _cached(("prep", pspec), lambda: compile_prep(pspec))
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
        if FUSE_PREP:
            _spec, absorb = k["absorb"]
            absorb(w_uk, self.q, dv, dr, self.q_lat, self.dummy_rs, self.qkv, pos,
                   w.kv_a_norm, self.cos_sin, state.cache, self.q_pe)  # fmt: skip
        else:
            k["prep"](
                self.qkv, self.q, pos, w.kv_a_norm, self.cos_sin, state.cache, self.q_pe,
            )  # fmt: skip
            gemv("absorb", w_uk, self.q, dv, dr, self.q_lat)
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

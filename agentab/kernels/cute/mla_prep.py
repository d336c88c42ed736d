"""MLA step preparation: everything between the q_b projection and attention, for one token.

`prep_body` runs in extra CTAs of the absorbed-query GEMV (`gemv.build_gemv` with a
`PrepSpec`), one per token, so the preparation costs no launch of its own. Per token: RMSNorm
of the compressed kv (kv_a_layernorm), RoPE of the shared rope key, both written as the token's
latent cache entry; RoPE of every head's q_pe into the attention input. The standard path
spends about ten torch kernels on the same work.

With `paged` the cache is a serving engine's paged one: `mCache` is one layer's
(slots, kv_width) slots and `mPos` is (2, batch) int32, row 0 the tokens' positions (for RoPE)
and row 1 the slots their entries go to (the engine's block table decides them).
"""

# No `from __future__ import annotations`: CuTe DSL evaluates kernel annotations at trace time.
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentab.kernels.config import LayerConfig
from agentab.kernels.cute.common import fake


@dataclass(frozen=True)
class PrepSpec:
    batch: int
    q_lora: int
    kv_lora: int
    rope: int
    n_heads: int
    qk_nope: int
    max_len: int  # cache rows per sequence (paged: slots in the layer's cache)
    max_pos: int  # rows of the cos/sin table
    eps: float
    paged: bool = False

    @staticmethod
    def from_config(cfg: LayerConfig, batch: int, max_len: int, max_pos: int,
                    paged: bool = False) -> "PrepSpec":  # fmt: skip
        return PrepSpec(batch, cfg.q_lora, cfg.kv_lora, cfg.qk_rope, cfg.n_heads, cfg.qk_nope,
                        max_len, max_pos, cfg.rms_eps, paged)  # fmt: skip

    def cache_shape(self) -> tuple[int, ...]:
        width = self.kv_lora + self.rope
        return (self.max_len, width) if self.paged else (self.batch, self.max_len, width)

    def positions_shape(self) -> tuple[int, ...]:
        return (2, self.batch) if self.paged else (self.batch,)


@cute.jit
def prep_body(spec: PrepSpec, nthreads: int, b, tidx, mQkv: cute.Tensor, mQ: cute.Tensor,
              mPos: cute.Tensor, mNorm: cute.Tensor, mCS: cute.Tensor, mCache: cute.Tensor,
              mQpe: cute.Tensor, red: cute.Tensor):  # fmt: skip
    """One token's preparation by one CTA of `nthreads` threads (`red`: nthreads/32 floats)."""
    kvl, rope, nh = spec.kv_lora, spec.rope, spec.n_heads
    half = rope // 2
    qkh = spec.qk_nope + rope
    per_thread = kvl // nthreads
    nwarps = nthreads // 32
    qkv_cols = spec.q_lora + kvl + rope
    pairs = (nh + 1) * half
    lane = tidx % 32
    warp = tidx // 32
    if cutlass.const_expr(spec.paged):
        pos = mPos[0, b]
        slot = mPos[1, b]
    else:
        pos = mPos[b]
        slot = pos
    ss = Float32(0.0)
    for i in cutlass.range_constexpr(per_thread):
        v = mQkv[b, spec.q_lora + tidx * per_thread + i].to(Float32)
        ss = ss + v * v
    ss = cute.arch.warp_reduction_sum(ss)
    if lane == 0:
        red[warp] = ss
    cute.arch.sync_threads()
    tot = Float32(0.0)
    for w in cutlass.range_constexpr(nwarps):
        tot = tot + red[w]
    rs = cute.math.rsqrt(tot / Float32(kvl) + Float32(spec.eps))
    for i in cutlass.range_constexpr(per_thread):
        c = tidx * per_thread + i
        v = mQkv[b, spec.q_lora + c].to(Float32) * rs * mNorm[c].to(Float32)
        if cutlass.const_expr(spec.paged):
            mCache[slot, c] = v.to(BFloat16)
        else:
            mCache[b, pos, c] = v.to(BFloat16)
    for p in range(tidx, pairs, nthreads):
        vec = p // half
        i = p % half
        cos = mCS[pos, i]
        sin = mCS[pos, half + i]
        if vec == nh:
            x1 = mQkv[b, qkv_cols - rope + i].to(Float32)
            x2 = mQkv[b, qkv_cols - rope + half + i].to(Float32)
            r1 = (x1 * cos - x2 * sin).to(BFloat16)
            r2 = (x2 * cos + x1 * sin).to(BFloat16)
            if cutlass.const_expr(spec.paged):
                mCache[slot, kvl + i] = r1
                mCache[slot, kvl + half + i] = r2
            else:
                mCache[b, pos, kvl + i] = r1
                mCache[b, pos, kvl + half + i] = r2
        else:
            base = vec * qkh + spec.qk_nope
            x1 = mQ[b, base + i].to(Float32)
            x2 = mQ[b, base + half + i].to(Float32)
            mQpe[b, vec, i] = (x1 * cos - x2 * sin).to(BFloat16)
            mQpe[b, vec, half + i] = (x2 * cos + x1 * sin).to(BFloat16)


def check_prep(spec: PrepSpec, nthreads: int) -> None:
    if spec.kv_lora % nthreads or nthreads % 32:
        raise ValueError(f"kv_lora must be a multiple of the {nthreads} threads")


def prep_fakes(spec: PrepSpec) -> list:
    """Fake tensors of the preparation's own arguments, in the fused GEMV's order
    (qkv, positions, kv_a_norm, cos_sin, cache, q_pe_out; q is the GEMV's input)."""
    b, kvl, rope = spec.batch, spec.kv_lora, spec.rope
    return [
        fake(BFloat16, (b, spec.q_lora + kvl + rope)),
        fake(Int32, spec.positions_shape()),
        fake(BFloat16, (kvl,)),
        fake(Float32, (spec.max_pos, rope)),
        fake(BFloat16, spec.cache_shape()),
        fake(BFloat16, (b, spec.n_heads, rope)),
    ]

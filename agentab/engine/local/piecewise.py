"""Prefill and mixed steps on the GPU in piecewise CUDA graphs (vLLM's design).

An eager prefill or mixed step is bound by the host: each of the model's layers issues a few
hundred kernel launches, most of them for work that depends only on how many tokens the step
has (norms, projections, RoPE, the MoE). Only attention depends on each row's context (its
length, its blocks, decode rows beside prefill chunks), and that is what keeps the step out of
a whole-step graph. So, as vLLM does, the forward is cut at attention: everything between two
attention calls is captured once per padded token count (a bucket) and replayed, and only
`rows_attention` (the batched decode rows' `mla_decode` and each prefill chunk's
`prefill_attention`) runs eagerly between the pieces.

For a model of L layers a bucket has L + 1 pieces:

- piece 0: embedding, the step's rotary angles, layer 0's `attention_in` (norms, qkv_a, q_b,
  RoPE, the cache write);
- piece l (1 <= l < L): layer l-1's `attention_out` (output projection, residual) and MoE,
  then layer l's `attention_in`;
- piece L: the last layer's `attention_out` and MoE.

The pieces read and write one set of static buffers (`PieceBuffers`) sized for the largest
bucket; a bucket's pieces use its leading rows. The step's tokens, positions and cache slots
are copied in before piece 0; padding rows (a step of n tokens runs at the bucket T >= n)
embed token 0 at position 0 and write their latent entries to the scratch slot, which no
request owns, as the decode graphs' padding rows do. Every operation in a piece is row-wise
(the MoE's grouped GEMMs included), so padding rows change neither the real rows' results
nor any real slot of the cache.

All buckets' graphs share one memory pool: every piece's result is copied into the static
buffers, so nothing a graph allocated outlives its replay, and the pieces replay in capture
order within a step. Buckets are captured at engine start, largest first (vLLM's order, so
the smaller ones reuse the pool), so no timed step pays a capture or a Triton autotune.

Steps larger than the largest bucket (`max_num_batched_tokens`, at most `MAX_BUCKET_TOKENS`)
run eagerly (`standard_forward`), and the executor counts them. With `capture` False (the CPU)
each piece runs eagerly: the same code and buffers, which the tests compare with
`standard_forward`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agentab.engine.local.config import ModelConfig
from agentab.engine.local.forward import (
    SINGLE,
    DeviceBatch,
    attention_in,
    attention_out,
    embed,
    rows_attention,
    standard_moe,
)
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.local.tensor_parallel import TPGroup
from agentab.engine.paths import graph_size
from agentab.kernels import reference
from agentab.kernels.harness import warm_up

SMALLEST_BUCKET = 16
LINEAR_FROM = 256  # above this, buckets grow by this much, not by doubling
# Steps of more tokens run eagerly: their device work (hundreds of ms at 2,048 tokens on the
# full-depth shard) dwarfs the eager step's launches, and every bucket costs L + 1 captures
# and its share of start-up (vLLM caps its capture sizes the same way).
MAX_BUCKET_TOKENS = 2048


def token_buckets(max_tokens: int, limit: int = MAX_BUCKET_TOKENS) -> list[int]:
    """The padded token counts captured for steps of up to `max_tokens` tokens (at most
    `limit`): powers of two from 16 to 256, then multiples of 256, then the top itself. Why
    not vLLM's finer steps: each bucket is L + 1 graphs (62 on the full-depth shard), and a
    padded step costs at most 2x its tokens' row-wise work below 256 tokens, under 1.34x
    above it."""
    top = min(max_tokens, limit)
    sizes: set[int] = set()
    b = SMALLEST_BUCKET
    while b < min(top, LINEAR_FROM):
        sizes.add(b)
        b *= 2
    b = LINEAR_FROM
    while b < top:
        sizes.add(b)
        b += LINEAR_FROM
    sizes.add(top)
    return sorted(sizes)


@dataclass
class PieceBuffers:
    """The static tensors the pieces read and write (rows: tokens, for the largest bucket)."""

    token_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slots: torch.Tensor  # (T,) int64: where each token's latent entry goes
    cos: torch.Tensor  # (T, qk_rope / 2) fp32: the tokens' rotary angles, made by piece 0
    sin: torch.Tensor
    x: torch.Tensor  # (T, hidden): the residual stream between pieces
    q: torch.Tensor  # (T, n_heads, qk_head): the layer's queries (their nope part is read)
    q_pe: torch.Tensor  # (T, n_heads, qk_rope): roped
    o: torch.Tensor  # (T, n_heads, v_head): the eager attention's output

    @staticmethod
    def of(cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device,
           scratch_slot: int) -> PieceBuffers:  # fmt: skip
        """Zeroed buffers whose slots all name the scratch slot, so a warm-up run before the
        first step writes no request's cache."""
        c = cfg.rank_layer

        def z(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        half = c.qk_rope // 2
        return PieceBuffers(
            token_ids=z(rows, dt=torch.int64),
            positions=z(rows, dt=torch.int64),
            slots=torch.full((rows,), scratch_slot, dtype=torch.int64, device=device),
            cos=z(rows, half, dt=torch.float32),
            sin=z(rows, half, dt=torch.float32),
            x=z(rows, c.hidden),
            q=z(rows, c.n_heads, c.qk_head),
            q_pe=z(rows, c.n_heads, c.qk_rope),
            o=z(rows, c.n_heads, c.v_head),
        )

    def rows(self, t: int) -> PieceBuffers:
        """The first t rows of every buffer (a bucket's view)."""
        return PieceBuffers(*(getattr(self, f)[:t] for f in self.__dataclass_fields__))


def run_piece(
    cfg: ModelConfig,
    w: ModelWeights,
    cache: PagedLatentCache,
    v: PieceBuffers,
    k: int,
    grouped: list[Any] | None,
    tp: TPGroup = SINGLE,
) -> None:
    """Piece k of the forward over the buffers `v` (one bucket's rows), results written back
    into them: layer k-1's output projection and MoE (k > 0; the embedding when k = 0), then
    layer k's `attention_in` (k < L). The same functions `standard_forward` calls, in order."""
    c = cfg.rank_layer
    dt = v.x.dtype
    if k == 0:
        x = embed(cfg, w, v.token_ids, tp).to(dt)
        cos, sin = reference.rope_cos_sin(c, v.positions)
        v.cos.copy_(cos)
        v.sin.copy_(sin)
    else:
        lw = w.layer(k - 1)
        h1 = attention_out(c, lw, v.x, v.o, tp)
        path = None if grouped is None else grouped[(k - 1) % len(grouped)]
        x = standard_moe(c, lw, h1, path, tp)
    v.x.copy_(x)
    if k == cfg.num_layers:
        return
    rope_q = (v.cos[:, None], v.sin[:, None])
    q, q_pe = attention_in(c, w.layer(k), x, rope_q, (v.cos, v.sin), v.slots, cache.layer(k))
    v.q.copy_(q)
    v.q_pe.copy_(q_pe)


class PiecewiseGraphs:
    """The standard forward's pieces, captured per token bucket (or run eagerly: `capture`
    False), and the step that replays them around the eager attention."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        cache: PagedLatentCache,
        dtype: torch.dtype,
        buckets: list[int],
        scratch_slot: int,
        grouped: list[Any] | None,
        *,
        capture: bool = True,
        tp: TPGroup = SINGLE,
    ) -> None:
        """`grouped`: the weight sets' `StandardPath`s, whose grouped MoE (no host syncs) the
        captured pieces run; None runs the CPU's per-expert MoE (`capture` False only)."""
        if capture and grouped is None:
            raise ValueError("captured pieces need the grouped MoE (the CPU's syncs the host)")
        self.cfg, self.w, self.cache, self.grouped, self.tp = cfg, weights, cache, grouped, tp
        self.buckets = sorted(buckets)
        self.scratch_slot = scratch_slot
        self.capture = capture
        device = cache.data.device
        self.buf = PieceBuffers.of(cfg, self.buckets[-1], dtype, device, scratch_slot)
        # per bucket, its pieces in order: each a graph's replay, or the piece itself when
        # nothing is captured (bound to the same buffer views either way)
        self.graphs: dict[int, list[Callable[[], Any]]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        with torch.inference_mode():  # as the executor runs them
            for t in reversed(self.buckets):  # largest first: the smaller reuse the pool
                self._build(t)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket that holds a step of `tokens` tokens (None: too large)."""
        return graph_size(tokens, self.buckets)

    def _build(self, t: int) -> None:
        v = self.buf.rows(t)
        cfg, w, cache, grouped, tp = self.cfg, self.w, self.cache, self.grouped, self.tp
        pieces: list[Callable[[], Any]] = [
            functools.partial(run_piece, cfg, w, cache, v, k, grouped, tp)
            for k in range(cfg.num_layers + 1)
        ]
        if not self.capture:
            self.graphs[t] = pieces
            return
        warm_up(lambda: [piece() for piece in pieces])
        replays: list[Callable[[], Any]] = []
        for piece in pieces:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                piece()
            replays.append(g.replay)
        self.graphs[t] = replays

    def load(self, b: DeviceBatch, t: int) -> PieceBuffers:
        """The step's tokens, positions and slots into bucket t's rows; padding rows take
        token 0 at position 0 and the scratch slot, and their attention output is zeroed
        (attention writes only real rows), so a step's padding is the same whatever ran
        before: the MoE groups tokens by expert, and the padding rows' routing must not make
        a step's rounding depend on the previous step."""
        n = b.starts[-1]
        v = self.buf.rows(t)
        for dst, src, pad in ((v.token_ids, b.token_ids, 0), (v.positions, b.positions, 0),
                              (v.slots, b.slot_mapping, self.scratch_slot)):  # fmt: skip
            dst[:n].copy_(src)
            dst[n:].fill_(pad)
        v.o[n:].zero_()
        return v

    def forward(
        self, b: DeviceBatch, t: int, out_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step `b` (at most t tokens) through the pieces of bucket t: the hidden states
        of the tokens `out_index` (default: each row's last token), as `standard_forward`."""
        n = b.starts[-1]
        v = self.load(b, t)
        nope = self.cfg.rank_layer.qk_nope
        for k in range(self.cfg.num_layers + 1):
            if k > 0:  # layer k-1's attention, eager: it depends on every row's context
                layer = k - 1
                c, lw, kv = self.cfg.rank_layer, self.w.layer(layer), self.cache.layer(layer)
                rows_attention(c, lw, v.q[:n, :, :nope], v.q_pe[:n], kv, b, out=v.o[:n])
            self.graphs[t][k]()
        return v.x.index_select(0, b.last_token if out_index is None else out_index)

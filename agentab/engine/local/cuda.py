"""Decode steps on the GPU: the whole model's decode for one padded batch size in a CUDA graph.

A pure-decode step (every row one token) runs as one graph replay: embedding, every layer on
the step's path (`agentab.kernels.standard.StandardPath` or `specialized.SpecializedPath`, the
very layers `agentab kernels bench` times), final norm, LM head and argmax. Graphs are captured
at engine start for each padded batch size up to the engine's largest batch (vLLM's sizes: 1,
2, 4, then multiples of 8), so no step pays a capture. A step's rows are copied into the graph's
static inputs; padding rows decode a dummy token into a scratch block that no request owns.

Attention reads the paged latent cache through the block table (`kernels.attention.PagedKV`);
the split length is written per step on the device, so one graph serves every context length.

A graph's rows are tokens, each with its own position, cache slot and block table, so the same
graphs serve speculative decoding's verify steps: a row verifying d drafts is 1 + d token rows
at consecutive positions sharing its block table. Every layer writes all rows' latent entries
before it attends, so a verify row's query j reads the entries of its queries 0..j-1: causal
within the step with no mask of its own (engine.local.spec). The early-exit drafter's graphs
are the same class over its first layers, writing each draft where the verify step reads it.

Tokens come from one device buffer, the token pool: `[last sampled | drafts | scratch]`. A row
whose token was not known when the step was scheduled (the previous step was still sampling
it, or it is a draft made on the device) names its place in the pool; every graph writes its
sampled ids back into the pool at the places the host names (`GraphInputs.dest`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from agentab.engine.local.config import ModelConfig
from agentab.engine.local.forward import greedy
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.outputs import StepInputs
from agentab.engine.paths import padded_tokens
from agentab.kernels.attention import PagedKV, split_plan
from agentab.kernels.harness import capture
from agentab.kernels.weights import DecodeState


def greedy_cuda(cfg: ModelConfig, w: ModelWeights, x: torch.Tensor) -> torch.Tensor:
    """Final norm, LM head (bf16 weights, fp32 logits), argmax: (rows,) int64."""
    h = F.rms_norm(x, (x.shape[-1],), w.final_norm, cfg.layer.rms_eps)
    return torch.mm(h, w.lm_head.t(), out_dtype=torch.float32).argmax(dim=-1)


def graph_sizes(max_batch: int, graph_max: int = 512) -> list[int]:
    """The padded batch sizes a step of 1..max_batch rows runs at."""
    return sorted({padded_tokens(n, graph_max) for n in range(1, max_batch + 1)})


class TokenPool:
    """The device buffer every graph takes its pending tokens from and writes its ids into:
    `[last sampled (size) | drafts (size) | scratch (1)]`, one int64 each.

    `last` is what the next step reads of this one's rows (row i at i); `drafts` holds a verify
    step's draft tokens at their index in the step's flat batch (plus `draft_base`); padding
    rows of a graph write to the scratch entry, which nothing reads."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.data = torch.zeros(2 * size + 1, dtype=torch.int64, device=device)
        self.last = self.data[:size]
        self.draft_base = size
        self.scratch = 2 * size


class GraphInputs:
    """A graph's inputs as one int64 buffer: [tokens | positions | slots | split | prev | dest |
    drafts | table], a row per token.

    The host fills a pinned copy and one copy moves it to the device before each replay (the
    fewest launches on the host's critical path); the graph itself derives the int32 forms
    the kernels read. `prev`: -1, or where in the token pool the row's token is; `dest`: where
    the row's sampled id goes in the pool; `drafts`: a drafter graph's drafts for the row.

    The copy is asynchronous, so the host must not rewrite a pinned buffer the device has not
    read yet: fills rotate over `HOST_RING` pinned buffers, each waiting for its previous copy
    to have run (an event), which it has in all but back-to-back fills of one graph.
    """

    HOST_RING = 4

    def __init__(self, b: int, max_blocks: int, device: torch.device) -> None:
        self.b, self.max_blocks = b, max_blocks
        total = 6 * b + 1 + b * max_blocks
        self.cuda = torch.device(device).type == "cuda"  # pinned host memory needs a GPU
        self.hosts = [
            torch.zeros(total, dtype=torch.int64, pin_memory=self.cuda)
            for _ in range(self.HOST_RING)
        ]
        self.copied: list[Any] = [None] * self.HOST_RING  # each buffer's copy's event
        self.turn = 0
        self.dev = torch.zeros(total, dtype=torch.int64, device=device)
        d = self.dev
        self.token_ids = d[:b]
        self.pos_slots64 = d[b : 3 * b].view(2, b)  # positions, then new slots
        self.new_slots = d[2 * b : 3 * b]
        self.split_len = d[3 * b : 3 * b + 1]
        self.prev_rows = d[3 * b + 1 : 4 * b + 1]  # -1, or the token's place in the pool
        self.dest = d[4 * b + 1 : 5 * b + 1]  # where the row's sampled id goes in the pool
        self.drafts = d[5 * b + 1 : 6 * b + 1]  # a drafter graph's drafts per row
        self.block_table = d[6 * b + 1 :].view(b, max_blocks)
        self.out: torch.Tensor | None = None  # (B,) int64 sampled ids

    @property
    def np(self) -> np.ndarray:
        """The pinned buffer the next fill writes (after its previous copy has run)."""
        ev = self.copied[self.turn]
        if ev is not None:
            ev.synchronize()
        return self.hosts[self.turn].numpy()

    def fill(self, inputs: StepInputs | None, scratch_slot: int, scratch_block: int,
             split_len: int, pool_scratch: int = 0) -> None:  # fmt: skip
        """A pure-decode step (a token per row): row i's id goes to the pool's entry i, where
        the next step finds it."""
        if inputs is None:
            self.fill_rows(None, scratch_slot, scratch_block, split_len, pool_scratch)
            return
        n = inputs.num_rows
        prev = np.full(n, -1, dtype=np.int64) if inputs.prev_rows is None else inputs.prev_rows
        rows = TokenRows(inputs.token_ids, inputs.positions, inputs.slot_mapping, prev,
                         np.arange(n, dtype=np.int64), inputs.block_tables)  # fmt: skip
        self.fill_rows(rows, scratch_slot, scratch_block, split_len, pool_scratch)

    def load(self, rows: TokenRows, max_context: int, scratch_slot: int, scratch_block: int,
             pool_scratch: int) -> None:  # fmt: skip
        """Token rows (a verify step's, a draft's) as `fill_rows` takes them, the split length
        planned for this graph's padded size and `max_context`, the longest context any row
        attends over."""
        split = split_plan(self.b, max_context)[1]
        self.fill_rows(rows, scratch_slot, scratch_block, split, pool_scratch)

    def layer_state(self, cache: torch.Tensor, block_size: int, max_len: int,
                    new_slots: torch.Tensor, pos_slots: torch.Tensor) -> DecodeState:  # fmt: skip
        """What one layer's path steps over: its paged cache `cache` (slots, width) addressed
        through this graph's block table and split length; `new_slots` where each row's entry
        goes and `pos_slots` the (2, B) int32 positions and slots (the CuTe preparation's
        form), both made on the device (from `pos_slots64`, or a drafter's own)."""
        paged = PagedKV(
            cache=cache,
            block_table=self.block_table,
            new_slots=new_slots,
            positions_and_slots=pos_slots,
            block_size=block_size,
            max_len=max_len,
            split_len=self.split_len,
        )
        return DecodeState(cache=paged.cache, positions=pos_slots[0], paged=paged)

    def fill_rows(self, rows: TokenRows | None, scratch_slot: int, scratch_block: int,
                  split_len: int, pool_scratch: int) -> None:  # fmt: skip
        """Token rows first; padding rows decode token 0 at position 0 into the scratch
        block's first slot, draft nothing and write their id to the pool's scratch entry."""
        b, m, h = self.b, self.max_blocks, self.np
        n = 0 if rows is None else len(rows.token_ids)
        table = h[6 * b + 1 :].reshape(b, m)
        prev = h[3 * b + 1 : 4 * b + 1]
        dest = h[4 * b + 1 : 5 * b + 1]
        drafts = h[5 * b + 1 : 6 * b + 1]
        if rows is not None:
            h[:n] = rows.token_ids
            h[b : b + n] = rows.positions
            h[2 * b : 2 * b + n] = rows.slots
            prev[:n] = rows.prev
            dest[:n] = rows.dest
            drafts[:n] = 0 if rows.drafts is None else rows.drafts
            width = rows.block_tables.shape[1]
            if width > m:
                raise RuntimeError(f"a sequence needs {width} blocks; graphs hold {m}")
            table[:n, :width] = rows.block_tables
        h[n:b] = 0
        h[b + n : 2 * b] = 0
        h[2 * b + n : 3 * b] = scratch_slot
        prev[n:] = -1
        dest[n:] = pool_scratch
        drafts[n:] = 0
        table[n:, 0] = scratch_block
        h[3 * b] = split_len
        self.dev.copy_(self.hosts[self.turn], non_blocking=True)
        if self.cuda:
            ev = self.copied[self.turn] or torch.cuda.Event()
            ev.record()
            self.copied[self.turn] = ev
        self.turn = (self.turn + 1) % self.HOST_RING


@dataclass
class TokenRows:
    """A graph step's rows, one token each, as the host fills them in."""

    token_ids: np.ndarray  # (n,) the token, where known on the host
    positions: np.ndarray  # (n,)
    slots: np.ndarray  # (n,) where the token's latent entry goes
    prev: np.ndarray  # (n,) -1, or the token's place in the pool
    dest: np.ndarray  # (n,) where the sampled id goes in the pool
    block_tables: np.ndarray  # (n, blocks) the row's sequence's blocks
    drafts: np.ndarray | None = None  # (n,) a drafter graph's drafts per row


def verify_token_rows(inputs: StepInputs, prev: np.ndarray, dest: np.ndarray) -> TokenRows:
    """A step's every token as a graph row: a verify row of 1 + d tokens is 1 + d rows at
    consecutive positions (`inputs.positions`), each writing its own slot and carrying its
    row's block table; `prev` and `dest` as `TokenRows` takes them."""
    row_of = np.repeat(np.arange(inputs.num_rows), np.diff(inputs.starts))
    return TokenRows(inputs.token_ids, inputs.positions, inputs.slot_mapping, prev, dest,
                     inputs.block_tables[row_of])  # fmt: skip


class DecodeGraphs:
    """One decode path's graphs, by padded batch size (token rows).

    `num_layers` runs the model's first layers only and `draft_steps` = k makes each graph the
    early-exit drafter's k steps in one replay (`_draft_loop`); `capture` False runs each
    replay eagerly, the same code without a graph (the CPU, where tests check the GPU's step
    logic)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        cache: PagedLatentCache,
        path: str,
        sizes: list[int],
        max_len: int,
        scratch_block: int,
        standard_paths: list[Any],
        pool: TokenPool,
        *,
        num_layers: int | None = None,
        draft_steps: int = 0,
        capture: bool = True,
    ) -> None:
        self.cfg, self.w, self.cache, self.path = cfg, weights, cache, path
        self.max_len = max_len
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * cache.block_size
        self.max_blocks = math.ceil(max_len / cache.block_size)
        self.num_layers = cfg.num_layers if num_layers is None else num_layers
        self.capture = capture
        self.draft_steps = draft_steps
        self.layers_by_size: dict[int, list[Any]] = {}
        self.static: dict[int, GraphInputs] = {}
        self.graphs: dict[int, Any] = {}  # a CUDAGraph, or the step's function when eager
        self._standard = standard_paths
        self.pool = pool
        for b in sizes:
            self._capture(b)

    # -- building ---------------------------------------------------------------------------
    def _paths(self, batch: int) -> list[Any]:
        """The weight sets' layer paths at this batch size (layer l uses entry l mod D)."""
        layer = self.cfg.layer
        if self.path == "standard":
            return self._standard
        from agentab.kernels.specialized import SpecializedPath

        slots = self.cache.num_blocks * self.cache.block_size
        return [
            SpecializedPath(layer, w, self.max_len, batch, slots, paged=True) for w in self.w.sets
        ]

    def _capture(self, b: int) -> None:
        st = GraphInputs(b, self.max_blocks, self.cache.data.device)
        st.fill(None, self.scratch_slot, self.scratch_block, split_plan(b, 1)[1], self.pool.scratch)
        paths = self._paths(b)
        cfg, w, cache, layers = self.cfg, self.w, self.cache, self.num_layers
        pool = self.pool.data

        def forward(tokens: torch.Tensor, slots: torch.Tensor, pos_slots: torch.Tensor) -> Any:
            """The greedy ids after `tokens` at `pos_slots` (int32: positions, new slots)."""
            x = w.embed.index_select(0, tokens % cfg.vocab_rows)
            for layer in range(layers):
                state = st.layer_state(cache.layer(layer), cache.block_size, self.max_len, slots,
                                       pos_slots)  # fmt: skip
                x = paths[layer % len(paths)].step(x, state).out
            return greedy_cuda(cfg, w, x) if x.is_cuda else greedy(cfg, w, x)

        def run() -> torch.Tensor:
            taken = pool.index_select(0, st.prev_rows.clamp(min=0))
            tokens = torch.where(st.prev_rows >= 0, taken, st.token_ids)
            if self.draft_steps:
                return self._draft_loop(st, tokens, forward)
            # the CuTe preparation's (2, B) int32 form
            ids = forward(tokens, st.new_slots, st.pos_slots64.to(torch.int32))
            # where the next step (or the verify step) finds them
            pool.index_copy_(0, st.dest, ids)
            return ids

        self.layers_by_size[b] = paths
        self.static[b] = st
        if not self.capture:
            self.graphs[b] = run
            return
        self.graphs[b], st.out = capture(run)

    def _draft_loop(self, st: GraphInputs, tokens: torch.Tensor, forward: Any) -> torch.Tensor:
        """The drafter's k steps in one graph: step j runs each row's token at position p + j
        (its first token, then its draft j - 1) and writes draft j at `dest + j` in the pool.
        A row takes part in step j only while j < its `drafts`; past them it writes the
        scratch slot and the pool's scratch entry, so it never touches cache slots the
        scheduler did not give it. Positions and slots are computed here, on the device, so
        the k steps cost the host one fill and one launch."""
        bs, pool = self.cache.block_size, self.pool
        positions = st.pos_slots64[0]
        rows = torch.arange(st.b, device=positions.device)
        ids = tokens
        for j in range(self.draft_steps):
            live = st.drafts > j
            pos = torch.where(live, positions + j, 0)
            block = st.block_table[rows, (pos // bs).clamp(max=self.max_blocks - 1)]
            slots = torch.where(live, block * bs + pos % bs, self.scratch_slot)
            ids = forward(tokens, slots, torch.stack([pos, slots]).to(torch.int32))
            pool.data.index_copy_(0, torch.where(live, st.dest + j, pool.scratch), ids)
            tokens = ids
        return ids

    # -- running ----------------------------------------------------------------------------
    def size_for(self, rows: int) -> int | None:
        fits = [b for b in self.graphs if b >= rows]
        return min(fits) if fits else None

    def load(self, inputs: StepInputs, b: int) -> None:
        """Copy one pure-decode step's rows into the graph of padded size b."""
        split = split_plan(b, int(inputs.context_lens.max()))[1]
        self.static[b].fill(inputs, self.scratch_slot, self.scratch_block, split, self.pool.scratch)

    def load_rows(self, rows: TokenRows, b: int, max_context: int) -> None:
        """Copy token rows (a verify step's, a draft's) into the graph of padded size b;
        `max_context`: the longest context any row attends over."""
        self.static[b].load(rows, max_context, self.scratch_slot, self.scratch_block,
                            self.pool.scratch)  # fmt: skip

    def replay(self, b: int) -> torch.Tensor:
        graph = self.graphs[b]
        if self.capture:
            graph.replay()
        else:
            self.static[b].out = graph()
        out = self.static[b].out
        assert out is not None
        return out

"""Decode steps on the GPU: the whole model's decode for one padded batch size in a CUDA graph.

A pure-decode step (every row one token) runs as one graph replay: embedding, every layer on
the step's path (`agentab.kernels.standard.StandardPath` or `specialized.SpecializedPath`, the
very layers `agentab kernels bench` times), final norm, LM head and argmax. Graphs are captured
at engine start for each padded batch size up to the engine's largest batch (vLLM's sizes: 1,
2, 4, then multiples of 8), so no step pays a capture. A step's rows are copied into the graph's
static inputs; padding rows decode a dummy token into a scratch block that no request owns.

Attention reads the paged latent cache through the block table (`kernels.attention.PagedKV`);
the split length is written per step on the device, so one graph serves every context length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from agentab.engine.local.config import ModelConfig
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.outputs import StepInputs
from agentab.engine.paths import padded_tokens
from agentab.kernels.attention import PagedKV, split_plan
from agentab.kernels.weights import DecodeState


def greedy_cuda(cfg: ModelConfig, w: ModelWeights, x: torch.Tensor) -> torch.Tensor:
    """Final norm, LM head (bf16 weights, fp32 logits), argmax: (rows,) int64."""
    h = F.rms_norm(x, (x.shape[-1],), w.final_norm, cfg.layer.rms_eps)
    return torch.mm(h, w.lm_head.t(), out_dtype=torch.float32).argmax(dim=-1)


def graph_sizes(max_batch: int, graph_max: int = 512) -> list[int]:
    """The padded batch sizes a step of 1..max_batch rows runs at."""
    return sorted({padded_tokens(n, graph_max) for n in range(1, max_batch + 1)})


class GraphInputs:
    """A graph's inputs as one int64 buffer: [tokens | positions | slots | split | table].

    The host fills a pinned copy and one copy moves it to the device before each replay (the
    fewest launches on the host's critical path); the graph itself derives the int32 forms
    the kernels read.
    """

    def __init__(self, b: int, max_blocks: int, device: torch.device) -> None:
        self.b, self.max_blocks = b, max_blocks
        total = 4 * b + 1 + b * max_blocks
        pinned = torch.device(device).type == "cuda"  # pinned host memory needs a GPU
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=pinned)
        self.np = self.host.numpy()
        self.dev = torch.zeros(total, dtype=torch.int64, device=device)
        d = self.dev
        self.token_ids = d[:b]
        self.pos_slots64 = d[b : 3 * b].view(2, b)  # positions, then new slots
        self.new_slots = d[2 * b : 3 * b]
        self.split_len = d[3 * b : 3 * b + 1]
        self.prev_rows = d[3 * b + 1 : 4 * b + 1]  # -1, or the previous step's row to take
        self.block_table = d[4 * b + 1 :].view(b, max_blocks)
        self.out: torch.Tensor | None = None  # (B,) int64 sampled ids

    def fill(self, inputs: StepInputs | None, scratch_slot: int, scratch_block: int,
             split_len: int) -> None:  # fmt: skip
        """Rows of the step first; padding rows decode token 0 at position 0 into the
        scratch block's first slot."""
        b, m, h = self.b, self.max_blocks, self.np
        n = 0 if inputs is None else inputs.num_rows
        table = h[4 * b + 1 :].reshape(b, m)
        prev = h[3 * b + 1 : 4 * b + 1]
        if inputs is not None:
            h[:n] = inputs.token_ids
            h[b : b + n] = inputs.positions
            h[2 * b : 2 * b + n] = inputs.slot_mapping
            prev[:n] = -1 if inputs.prev_rows is None else inputs.prev_rows
            width = inputs.block_tables.shape[1]
            table[:n, :width] = inputs.block_tables
        h[n:b] = 0
        h[b + n : 2 * b] = 0
        h[2 * b + n : 3 * b] = scratch_slot
        prev[n:] = -1
        table[n:, 0] = scratch_block
        h[3 * b] = split_len
        self.dev.copy_(self.host, non_blocking=True)


class DecodeGraphs:
    """One decode path's captured graphs, by padded batch size."""

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
        last_sampled: torch.Tensor,
    ) -> None:
        self.cfg, self.w, self.cache, self.path = cfg, weights, cache, path
        self.max_len = max_len
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * cache.block_size
        self.max_blocks = math.ceil(max_len / cache.block_size)
        self.layers_by_size: dict[int, list[Any]] = {}
        self.static: dict[int, GraphInputs] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._standard = standard_paths
        self.last_sampled = last_sampled
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
        st.fill(None, self.scratch_slot, self.scratch_block, split_plan(b, 1)[1])
        paths = self._paths(b)
        cfg, w, cache = self.cfg, self.w, self.cache

        last = self.last_sampled

        def run() -> torch.Tensor:
            taken = last.index_select(0, st.prev_rows.clamp(min=0))
            tokens = torch.where(st.prev_rows >= 0, taken, st.token_ids)
            x = w.embed.index_select(0, tokens % cfg.vocab_rows)
            pos_slots = st.pos_slots64.to(torch.int32)  # the CuTe preparation's (2, B) form
            for layer in range(cfg.num_layers):
                paged = PagedKV(
                    cache=cache.layer(layer),
                    block_table=st.block_table,
                    new_slots=st.new_slots,
                    positions_and_slots=pos_slots,
                    block_size=cache.block_size,
                    max_len=self.max_len,
                    split_len=st.split_len,
                )
                state = DecodeState(cache=paged.cache, positions=pos_slots[0], paged=paged)
                x = paths[layer % len(paths)].step(x, state).out
            ids = greedy_cuda(cfg, w, x)
            last[:b].copy_(ids)  # where the next step finds tokens it was scheduled without
            return ids

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles, autotunes and allocates outside the capture
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            st.out = run()
        self.layers_by_size[b] = paths
        self.static[b] = st
        self.graphs[b] = graph

    # -- running ----------------------------------------------------------------------------
    def size_for(self, rows: int) -> int | None:
        fits = [b for b in self.graphs if b >= rows]
        return min(fits) if fits else None

    def load(self, inputs: StepInputs, b: int) -> None:
        """Copy one pure-decode step's rows into the graph of padded size b."""
        width = inputs.block_tables.shape[1]
        if width > self.max_blocks:
            raise RuntimeError(f"a sequence needs {width} blocks; graphs hold {self.max_blocks}")
        split = split_plan(b, int(inputs.context_lens.max()))[1]
        self.static[b].fill(inputs, self.scratch_slot, self.scratch_block, split)

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        out = self.static[b].out
        assert out is not None
        return out

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
from dataclasses import dataclass
from typing import Any

import numpy as np
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


@dataclass
class _Static:
    """A graph's inputs (written before each replay) and output."""

    token_ids: torch.Tensor  # (B,) int64
    pos_slots: torch.Tensor  # (2, B) int32: positions, new slots
    new_slots: torch.Tensor  # (B,) int64
    block_table: torch.Tensor  # (B, max blocks) int32
    split_len: torch.Tensor  # (1,) int32
    out: torch.Tensor | None = None  # (B,) int64 sampled ids


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
    ) -> None:
        self.cfg, self.w, self.cache, self.path = cfg, weights, cache, path
        self.max_len = max_len
        self.scratch_block = scratch_block
        self.max_blocks = math.ceil(max_len / cache.block_size)
        self.layers_by_size: dict[int, list[Any]] = {}
        self.static: dict[int, _Static] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._standard = standard_paths
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
        dev = self.cache.data.device
        st = _Static(
            token_ids=torch.zeros(b, dtype=torch.int64, device=dev),
            pos_slots=torch.zeros(2, b, dtype=torch.int32, device=dev),
            new_slots=torch.zeros(b, dtype=torch.int64, device=dev),
            block_table=torch.full(
                (b, self.max_blocks), self.scratch_block, dtype=torch.int32, device=dev
            ),
            split_len=torch.zeros(1, dtype=torch.int32, device=dev),
        )
        self._fill_padding(st, 0, b)
        st.split_len.fill_(split_plan(b, 1)[1])
        paths = self._paths(b)
        cfg, w, cache = self.cfg, self.w, self.cache

        def run() -> torch.Tensor:
            x = w.embed.index_select(0, st.token_ids % cfg.vocab_rows)
            for layer in range(cfg.num_layers):
                paged = PagedKV(
                    cache=cache.layer(layer),
                    block_table=st.block_table,
                    new_slots=st.new_slots,
                    positions_and_slots=st.pos_slots,
                    block_size=cache.block_size,
                    max_len=self.max_len,
                    split_len=st.split_len,
                )
                state = DecodeState(cache=paged.cache, positions=st.pos_slots[0], paged=paged)
                x = paths[layer % len(paths)].step(x, state).out
            return greedy_cuda(cfg, w, x)

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

    def _fill_padding(self, st: _Static, start: int, end: int) -> None:
        """Rows [start, end) decode token 0 at position 0 into the scratch block's first slot."""
        if end <= start:
            return
        st.token_ids[start:end] = 0
        st.pos_slots[0, start:end] = 0
        st.pos_slots[1, start:end] = self.scratch_block * self.cache.block_size
        st.new_slots[start:end] = self.scratch_block * self.cache.block_size
        st.block_table[start:end, 0] = self.scratch_block

    # -- running ----------------------------------------------------------------------------
    def size_for(self, rows: int) -> int | None:
        fits = [b for b in self.graphs if b >= rows]
        return min(fits) if fits else None

    def load(self, inputs: StepInputs, b: int) -> None:
        """Copy one pure-decode step's rows into the graph of padded size b."""
        st = self.static[b]
        n = inputs.num_rows
        width = inputs.block_tables.shape[1]
        if width > self.max_blocks:
            raise RuntimeError(f"a sequence needs {width} blocks; graphs hold {self.max_blocks}")
        dev = st.token_ids.device
        host = np.stack([inputs.positions, inputs.slot_mapping]).astype(np.int32)
        st.token_ids[:n].copy_(torch.from_numpy(inputs.token_ids), non_blocking=True)
        st.pos_slots[:, :n].copy_(torch.from_numpy(host), non_blocking=True)
        st.new_slots[:n].copy_(torch.from_numpy(inputs.slot_mapping), non_blocking=True)
        table = torch.from_numpy(inputs.block_tables.astype(np.int32))
        st.block_table[:n, :width].copy_(table.to(dev, non_blocking=True))
        self._fill_padding(st, n, b)
        st.split_len.fill_(split_plan(b, int(inputs.context_lens.max()))[1])

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        out = self.static[b].out
        assert out is not None
        return out

"""The specialized layer's attention tail at batch 1-4, in variants, timed in one process.

The question (NOTES.md): what does folding the combine of the split-KV partials into the value
projection (`attention_uv.mla_decode_uv`: the split kernel, then one fused Triton kernel) save
against the production path's split + combine + CuTe value GEMV, and how many value rows per
program (each program re-reads its head's partials from L2) is best?

Variants, each the whole specialized layer (4 layers per CUDA graph, as `kernels bench`):
- `split+combine+gemv`: the production path (`mla_decode`, then the `uv` GEMV), timed first
  and again last (the first graph timed in a process has read ~4% faster at batch 1);
- `fused`: the fused tail, rows from `attention_uv.uv_rows`, a programmatic dependent launch;
- `fused, plain launches`: the same launched plainly;
- `fused, C channels a chunk`: the combine's channel chunks of C instead of 64;
- `fused-rR`: the fused tail with R rows per program.
Every variant's step output is compared with the first's (max abs difference, printed).

Run on the GPU machine (repo root):
  source scripts/gpu/prologue.sh && python3 -m benchmarks.kernels.research.uv_tail
Writes $OUT/uv_tail.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from agentab.kernels.config import get_preset
from agentab.kernels.harness import capture, kernel_names, layer_chain, time_replays
from agentab.kernels.specialized import SpecializedPath
from agentab.kernels.weights import init_state, init_weights
from benchmarks.kernels.research.attention_uv import mla_decode_uv

BATCHES = (1, 2, 4)
ROWS = (16, 32, 64, 128)
LAYERS = 4
CONTEXT = 4096


def _fused(**options: Any) -> type:
    class _Rows(SpecializedPath):
        def _attention_small(self, x: torch.Tensor, state: Any) -> None:
            cfg, w, k, b = self.cfg, self.w, self.k, self.b
            dv, dr = self.dummy_vec, self.dummy_bf16
            k["qkv_a"][1](w.w_qkv_a, x, w.attn_norm, dr, self.qkv, self.dummy_rs)
            k["q_b"][1](w.w_q_b, self.qkv, w.q_a_norm, dr, self.q, self.dummy_rs)
            pos = state.positions if state.paged is None else state.paged.positions_and_slots
            k["absorb"][1](w.w_uk_t.view(-1, cfg.qk_nope), self.q, dv, dr, self.q_lat,
                           self.dummy_rs, self.qkv, pos, w.kv_a_norm, self.cos_sin, state.cache,
                           self.q_pe)  # fmt: skip
            mla_decode_uv(
                cfg, self.q_lat.view(b, cfg.n_heads, cfg.kv_lora), self.q_pe, state.cache,
                state.positions, w.w_uv, self.o, state.paged, **options,
            )  # fmt: skip
            k["o_proj"][1](w.w_o, self.o, dv, x, self.h1[:b], self.dummy_rs)
            k["router"][1](w.w_gate, self.h1[:b], w.ffn_norm, dr, self.logits[:b], self.rs[:b])

    return _Rows


def _time(cls: type, cfg: Any, weights: list, batch: int) -> tuple[dict, int, torch.Tensor]:
    dev = weights[0].w_o.device
    gen = torch.Generator(device=dev).manual_seed(batch)
    x = torch.randn(batch, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)
    states = [init_state(cfg, batch, CONTEXT, 10 * i + batch, dev) for i in range(LAYERS)]
    paths = [cls(cfg, w, CONTEXT, batch, CONTEXT + 1) for w in weights]
    first = [s.clone() for s in states]

    graph, _outs = capture(layer_chain(x, paths, states))
    t = time_replays(graph, iters=200)
    n_kernels = len(kernel_names(lambda: paths[0].step(x, first[0])))
    out = paths[0].step(x, first[0]).out.float().clone()
    return t, n_kernels, out


def main() -> None:
    cfg = get_preset("k2-tp8-shard")
    dev = torch.device("cuda")
    weights = [init_weights(cfg, 1000 * i + 1, dev) for i in range(LAYERS)]
    variants: list[tuple[str, type]] = [
        ("split+combine+gemv", SpecializedPath),
        ("fused", _fused()),
        ("fused, plain launches", _fused(pdl=False)),
        ("fused, 128 channels a chunk", _fused(channels=128)),
        ("fused, 32 channels a chunk", _fused(channels=32)),
    ] + [(f"fused-r{r}", _fused(rows=r)) for r in ROWS]
    results = []
    for b in BATCHES:
        ref = None
        for name, cls in [*variants, ("split+combine+gemv (again)", SpecializedPath)]:
            t, nk, out = _time(cls, cfg, weights, b)
            ref = out if ref is None else ref
            diff = float((out - ref).abs().max())
            row = {"batch": b, "variant": name, "us_per_layer": t["median"] / LAYERS,
                   "p10": t["p10"] / LAYERS, "p90": t["p90"] / LAYERS, "kernels": nk,
                   "max_abs_diff_vs_first": diff}  # fmt: skip
            results.append(row)
            print(f"batch {b} {name:28s} {row['us_per_layer']:7.2f} us/layer "
                  f"(p10 {row['p10']:.2f}, p90 {row['p90']:.2f}) {nk} kernels, "
                  f"max |out - first| {diff:.3g}", flush=True)  # fmt: skip
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "uv_tail.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Why the first specialized layer graph timed in a process reads faster at batch 1.

`uv_tail.py` times the same production layer (batch 1, context 4096) first and again last in
one process, and the two figures differ at batch 1 only (NOTES.md, 2026-12-02). Two
explanations predict different things here:
- the GPU's state (clocks, temperature, power) after a stretch of work: a graph timed again
  later reads slower, whichever graph it is, and the SM clock falls with it;
- where the step's buffers landed (the first graph's allocations are the first in the process):
  each graph keeps its own figure when timed again in any order.
Graphs A then B are built and timed, then timed again in the order A, B, then B after 10 s idle,
with the SM / memory clocks, temperature and power read between runs.

Run on the GPU machine (repo root):
  source scripts/gpu/prologue.sh && python3 -m benchmarks.kernels.research.first_graph
Writes $OUT/first_graph.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from agentab.kernels.config import get_preset
from agentab.kernels.harness import capture, layer_chain, time_replays
from agentab.kernels.specialized import SpecializedPath
from agentab.kernels.weights import init_state, init_weights

LAYERS = 4
CONTEXT = 4096


def _gpu_state() -> str:
    q = "clocks.sm,clocks.mem,temperature.gpu,power.draw"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return out.stdout.strip()


def _graph(cfg: Any, weights: list, batch: int) -> tuple[Any, Any]:
    dev = weights[0].w_o.device
    gen = torch.Generator(device=dev).manual_seed(batch)
    x = torch.randn(batch, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)
    states = [init_state(cfg, batch, CONTEXT, 10 * i + batch, dev) for i in range(LAYERS)]
    paths = [SpecializedPath(cfg, w, CONTEXT, batch, CONTEXT + 1) for w in weights]

    graph, _ = capture(layer_chain(x, paths, states))
    return graph, (x, states, paths)  # the inputs stay alive with the graph


def main() -> None:
    cfg = get_preset("k2-tp8-shard")
    dev = torch.device("cuda")
    weights = [init_weights(cfg, 1000 * i + 1, dev) for i in range(LAYERS)]
    rows: list[dict] = []

    def timed(label: str, graph: Any) -> None:
        before = _gpu_state()
        t = time_replays(graph, iters=200)
        row = {"run": label, "us_per_layer": t["median"] / LAYERS, "gpu_before": before,
               "gpu_after": _gpu_state()}  # fmt: skip
        rows.append(row)
        print(f"{label:28s} {row['us_per_layer']:7.2f} us/layer  before [{before}] "
              f"after [{row['gpu_after']}]", flush=True)  # fmt: skip

    ga, keep_a = _graph(cfg, weights, 1)
    timed("A (built first)", ga)
    gb, keep_b = _graph(cfg, weights, 1)
    timed("B (built second)", gb)
    timed("A again", ga)
    timed("B again", gb)
    for _ in range(3):
        timed("A, back to back", ga)
    time.sleep(10)
    timed("B after 10 s idle", gb)
    timed("A after B", ga)
    del keep_a, keep_b
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "first_graph.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

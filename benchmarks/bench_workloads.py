"""Workload speed goals, measured and printed; never asserted in tests.

Goals on one core: generating 400 AgentX-style sessions <= 5 s; importing 100k requests of AgentX
JSON <= 5 s. Also printed: native JSONL write/read, the content hash, `inspect`'s summary, and
building one 256k-token prompt (replay builds one per request).

    python benchmarks/bench_workloads.py [--sessions 400] [--seed 42]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentab.workloads import Request, Session, load, save
from agentab.workloads.generator import generate, load_config
from agentab.workloads.stats import summarize
from agentab.workloads.tokens import prompt_text, prompt_token_ids


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def row(name: str, wall: float, cpu: float, note: str = "") -> None:
    print(f"{name:<44} {wall:8.3f} s wall {cpu:8.3f} s cpu  {note}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    cfg = load_config("agentx-coding")

    wl, wall, cpu = timed(lambda: generate(cfg, args.sessions, args.seed))
    n = wl.num_requests()
    row(f"generate {args.sessions} sessions (goal <= 5 s)", wall, cpu, f"{n} requests")

    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        agentx = tmpdir / "agentx.jsonl"
        _, wall, cpu = timed(lambda: save(wl, agentx, "agentx"))
        size = agentx.stat().st_size / 1e6
        row("write AgentX JSONL", wall, cpu, f"{size:.0f} MB")
        back, wall, cpu = timed(lambda: load(agentx))
        row(
            f"import AgentX JSON, {n} requests (goal <= 5 s for 100k)",
            wall,
            cpu,
            f"{n / wall:,.0f} requests/s",
        )
        assert back.content_hash == wl.content_hash

        native = tmpdir / "native.jsonl"
        _, wall, cpu = timed(lambda: save(wl, native))
        row("write native JSONL", wall, cpu, f"{native.stat().st_size / 1e6:.0f} MB")
        back, wall, cpu = timed(lambda: load(native))
        row("import native JSONL", wall, cpu)

    h, wall, cpu = timed(lambda: back.content_hash)
    row("content hash", wall, cpu, h[:16])
    summary, wall, cpu = timed(lambda: summarize(wl))
    row("inspect summary", wall, cpu)

    session = Session(id="bench", block_size=64, items=())
    big = Request(t=0.0, in_tokens=256_000, out_tokens=1, hash_ids=tuple(range(1, 4001)))
    _, wall, cpu = timed(lambda: [prompt_token_ids(session, big) for _ in range(100)])
    row("prompt_token_ids 256k tokens (per call)", wall / 100, cpu / 100)
    _, wall, cpu = timed(lambda: [prompt_text(session, big) for _ in range(10)])
    row("prompt_text 256k tokens (per call)", wall / 10, cpu / 10)

    ins, outs = summary["input_tokens"], summary["output_tokens"]
    print(
        f"workload: {summary['sessions']} sessions, {summary['requests']} requests "
        f"({summary['subagent_requests']} subagent); in mean {ins['mean']:.0f} p50 {ins['p50']:.0f}"
        f" p99 {ins['p99']:.0f} max {ins['max']}; out p50 {outs['p50']:.0f} p90 {outs['p90']:.0f};"
        f" cache hit {summary['theoretical_cache_hit_ratio']:.4f};"
        f" suffix growth {summary['suffix_growth_ratio']:.4f}"
    )


if __name__ == "__main__":
    main()

"""Simulator speed: figures printed, never asserted (run once, on an otherwise idle core).

1. Simulated output tokens per wall second at 64 running requests (ISL 2000, OSL 5000 each),
   without and with speculative decoding (7 drafts, acceptance length 6).
2. Wall time to simulate 1 h of traffic at 64 concurrent sessions of the generated AgentX-style
   workload (`agentab workload generate --preset agentx-coding`), replayed closed-loop by
   `agentab.replay.simulate_to_dir` exactly as `agentab simulate` does. Goal: <= 30 s.

Both wall and CPU time are printed: on a shared machine wall time includes waiting for a core.

    python benchmarks/bench_engine.py [--sessions 300] [--seed 7] [--skip-agentx]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import numpy as np

from agentab.clock import run_virtual
from agentab.engine import EngineRequest, FinalUsage, build_simulator


class Timer:
    def __enter__(self) -> Timer:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


async def run_batch(engine, n: int, isl: int, osl: int) -> tuple[int, float]:
    engine.start()
    rng = np.random.default_rng(0)

    async def one(i: int) -> int:
        req = EngineRequest(f"r{i}", rng.integers(1, 32000, size=isl), osl)
        async for ev in engine.generate(req):
            if isinstance(ev, FinalUsage):
                return ev.completion_tokens
        return 0

    done = await asyncio.gather(*(one(i) for i in range(n)))
    await engine.stop()
    return sum(done), asyncio.get_running_loop().time()


def bench_batch() -> None:
    print("== 64 running requests, ISL 2000, OSL 5000, gb300-tp16-kimi-k3 ==")
    cases = [
        ("auto, no spec", "auto", {}),
        ("auto, k=7 acc=6", "auto", {"num_draft_tokens": 7, "acceptance_length": 6}),
        (
            "latency_specialized, k=7 acc=6",
            "latency_specialized",
            {"num_draft_tokens": 7, "acceptance_length": 6},
        ),
        ("auto, no spec, one step at a time", "auto", {"fast_forward": False}),
    ]
    for label, backend, opts in cases:
        eng = build_simulator("gb300-tp16-kimi-k3", backend, **opts)
        with Timer() as t:
            tokens, sim_s = run_virtual(run_batch(eng, 64, 2000, 5000))
        steps = sum(v for k, v in eng.metrics().items() if k.startswith("agentab:steps_"))
        print(
            f"  {label:36} {tokens:>7} tokens {int(steps):>6} steps in {sim_s:7.1f} simulated s: "
            f"wall {t.wall:6.2f} s (cpu {t.cpu:6.2f} s) -> {tokens / t.wall:>10,.0f} tokens/wall s"
        )


def bench_agentx(sessions: int, seed: int) -> None:
    from agentab.replay import simulate_to_dir
    from agentab.replay.options import ReplayOptions
    from agentab.rundir import scan_records
    from agentab.workloads.generator import generate, load_config

    print(f"\n== 1 h AgentX-style, 64 concurrent sessions ({sessions} generated, seed {seed}) ==")
    with Timer() as t:
        wl = generate(load_config("agentx-coding"), sessions, seed)
    print(f"  generate: {wl.num_requests()} requests in {t.wall:.2f} s wall")
    cases = [
        ("auto, no spec", {"profile": "gb300-tp16-kimi-k3"}),
        (
            "latency_specialized, k=7 acc=6",
            {
                "profile": "gb300-tp16-kimi-k3",
                "decode_backend": "latency_specialized",
                "num_draft_tokens": 7,
                "acceptance_length": 6,
            },
        ),
    ]
    for label, opts in cases:
        with tempfile.TemporaryDirectory() as tmp:
            with Timer() as t:
                simulate_to_dir(
                    wl,
                    engine_options=opts,
                    replay=ReplayOptions(concurrency=64, duration_s=3600.0),
                    out_dir=f"{tmp}/run",
                    progress=False,
                )
            df = scan_records(f"{tmp}/run").collect()
        span = float(df["sent_s"].max())
        print(
            f"  {label:32} {len(df):>6} requests, {int(df['completion_tokens'].sum()):>9} output "
            f"tokens, last send at {span:7.1f} s: wall {t.wall:6.2f} s (cpu {t.cpu:6.2f} s)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--skip-agentx", action="store_true")
    args = ap.parse_args()
    bench_batch()
    if not args.skip_agentx:
        bench_agentx(args.sessions, args.seed)


if __name__ == "__main__":
    main()

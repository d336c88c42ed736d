"""`agentab simulate` speed goal, measured and printed; never asserted in tests.

Goal: 400 generated AgentX-style sessions at concurrency 16 for 1 h of virtual time in <= 60 s
of wall time (one process). Also printed: requests and tokens simulated, the virtual/wall ratio,
and where the wall time went (prompt building is part of the replay's per-request cost).

    python benchmarks/bench_simulate.py [--sessions 400] [--concurrency 16] [--duration 3600]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import polars as pl

from agentab.replay import ReplayOptions, simulate_to_dir
from agentab.rundir import scan_records
from agentab.workloads.generator import generate, load_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--profile", default="h200-tp1-kimi-shard")
    ap.add_argument("--decode-backend", default="auto")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--cprofile", action="store_true", help="Print the top functions.")
    args = ap.parse_args()

    t = time.perf_counter()
    wl = generate(load_config("agentx-coding"), args.sessions, args.seed)
    gen_s = time.perf_counter() - t
    opts = ReplayOptions(concurrency=args.concurrency, duration_s=args.duration, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        prof = cProfile.Profile() if args.cprofile else None
        wall, cpu = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        simulate_to_dir(
            wl,
            engine_options={"profile": args.profile, "decode_backend": args.decode_backend},
            replay=opts,
            out_dir=out,
            progress=False,
        )
        if prof:
            prof.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        df = scan_records(out).collect()
        manifest = json.loads((out / "manifest.json").read_text())
    stats = manifest["stats"]
    virtual = stats["elapsed_s"]
    tokens = df.select(pl.col("prompt_tokens").sum(), pl.col("completion_tokens").sum()).row(0)
    print(
        f"workload: {args.sessions} generated sessions ({wl.num_requests():,} requests), "
        f"generated in {gen_s:.2f} s"
    )
    print(
        f"simulate: concurrency {args.concurrency}, duration {args.duration:g} s virtual, "
        f"profile {args.profile}, decode_backend {args.decode_backend}"
    )
    print(
        f"  requests        {stats['finished']:,} ({stats['warmup_requests']} warmup), "
        f"errors {stats['errors']}, stopped by {stats['stop_reason']}"
    )
    print(f"  tokens          {tokens[0]:,} prompt, {tokens[1]:,} completion")
    print(f"  virtual time    {virtual:,.1f} s")
    print(
        f"  wall time       {wall:.2f} s ({cpu:.2f} s cpu)   goal <= 60 s: "
        f"{'met' if wall <= 60 else 'NOT met'}"
    )
    print(
        f"  speed           {virtual / wall:,.0f}x real time, "
        f"{stats['finished'] / wall:,.0f} requests/s of wall time"
    )
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()

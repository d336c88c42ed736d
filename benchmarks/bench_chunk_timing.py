"""How late the replay client times a chunk after the server wrote it; printed, never asserted.

The server (`agentab serve`'s EngineServer over the simulator) runs on the client's own event
loop, so both sides read the same monotonic clock and the difference is the client's cost of
turning bytes into a timestamp. Goal: p99 <= 1 ms on an idle machine. On a loaded machine the
tail grows with the scheduler's latency, which is why this is a benchmark and not a test.

    python benchmarks/bench_chunk_timing.py [--sessions 3] [--out-scale 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from agentab.engine import build_simulator
from agentab.replay import ReplayOptions, run_to_dir
from agentab.replay.targets.loopback import LoopbackTarget
from agentab.rundir import scan_records
from agentab.workloads.model import Request, Session, Workload

PROFILE = "h200-tp1-kimi-shard"


def session(i: int, out_scale: int) -> Session:
    """Four growing turns with chained hash ids (prefix-cache hits as in agent traffic)."""
    items = []
    ids: tuple[int, ...] = ()
    for k in range(4):
        ids = ids + tuple(range(100 * k + 1, 100 * k + 9))
        items.append(
            Request(
                t=0.3 * k,
                in_tokens=len(ids) * 64 + 10,
                out_tokens=(12 + 4 * k) * out_scale,
                hash_ids=ids,
                api_time=0.1,
            )
        )
    return Session(f"s{i}", 64, tuple(items))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--out-scale", type=int, default=5)
    args = ap.parse_args()
    workload = Workload(tuple(session(i, args.out_scale) for i in range(args.sessions)))
    options = ReplayOptions(
        concurrency=2,
        passes=2,
        duration_s=None,
        start_window=(0.0, 0.0),
        warmup_requests=0,
        idle_cap_global_s=0,
        idle_cap_tree_s=0,
    )
    target = LoopbackTarget(build_simulator(PROFILE))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = run_to_dir(
            workload, target, replay=options, out_dir=Path(tmp) / "r", virtual=False, progress=False
        )
        t0 = json.loads((run_dir / "manifest.json").read_text())["clock_t0"]
        records = scan_records(run_dir).collect()
    lags, first = [], []
    for rid, sent, chunks in records.select("request_id", "sent_s", "chunk_times_s").iter_rows():
        written = target.server.emissions[rid]
        lags += [t0 + sent + c - w for c, w in zip(chunks, written, strict=True)]
        first.append(t0 + sent + chunks[0] - written[0])
    d = np.asarray(lags) * 1e3
    print(
        f"client - server chunk time over {d.size} chunks of {records.height} requests: "
        f"p50 {np.percentile(d, 50):.3f} ms, p99 {np.percentile(d, 99):.3f} ms, "
        f"max {d.max():.3f} ms (goal p99 <= 1 ms); first chunk (TTFT) max {max(first) * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()

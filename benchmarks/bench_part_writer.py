"""What one flush of the record writer costs in CPU: the part's frame built from the queued rows
(`_Batch.frame`, list columns from flat buffers) and, separately, its Arrow IPC file written.

The rows are shaped like a simulated AgentX run's at concurrency 64: --rows per flush (a 20k
request run written in ~15 flushes holds ~1,400 a flush), each with a chunk-time list of 1 to
--max-chunks float64 values and a chunk-token list of as many int32 (uniform lengths, seeded).
Printed, never asserted: process time (all threads: polars builds the columns on its pool) of
each of --repeats frame builds and file writes, and their medians.

    python benchmarks/bench_part_writer.py [--rows 1400] [--max-chunks 1000] [--repeats 7]

Run with an older checkout on PYTHONPATH for its figures (the script imports `agentab` from
there).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from agentab.rundir.parts import atomic_write_ipc
from agentab.rundir.schema import RECORD_SCHEMA
from agentab.rundir.writer import _Batch


def _rows(n: int, max_chunks: int, seed: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(1, max_chunks + 1))
        rows.append(
            {
                "request_id": f"L{i % 64}-P0-N{i}",
                "session_id": f"s{i // 10}",
                "lane": i % 64,
                "pass": 0,
                "agent_id": "main",
                "turn": i % 10,
                "phase": "profiling",
                "planned_s": float(i),
                "sent_s": float(i) + 0.001,
                "chunk_times_s": np.cumsum(rng.random(k)),
                "chunk_tokens": np.ones(k, dtype=np.int32),
                "reasoning_chunks": None,
                "prompt_tokens": 20_000,
                "completion_tokens": k,
                "cached_tokens": 18_000,
                "osl": k,
                "error_class": None,
                "error_message": None,
                "warning_class": None,
                "warning_message": None,
                "target": None,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1400)
    ap.add_argument("--max-chunks", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rows = _rows(args.rows, args.max_chunks, seed=1)
    items = sum(len(r["chunk_times_s"]) for r in rows)  # type: ignore[arg-type]
    frames, writes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats + 1):  # the first builds polars' thread pool: not counted
            batch = _Batch(RECORD_SCHEMA)
            for row in rows:
                batch.add(row)
            t0 = time.process_time()
            frame = batch.frame(RECORD_SCHEMA)
            t1 = time.process_time()
            atomic_write_ipc(frame, Path(tmp) / f"part-{i:08d}-{i:08d}.arrow")
            t2 = time.process_time()
            if i:
                frames.append(t1 - t0)
                writes.append(t2 - t1)
    print(f"{args.rows} rows, {items:,} chunk times a flush; process time in ms")
    print("frame build: " + " ".join(f"{1e3 * t:.1f}" for t in frames))
    print("file write:  " + " ".join(f"{1e3 * t:.1f}" for t in writes))
    print(
        f"medians: frame build {1e3 * statistics.median(frames):.1f} ms, "
        f"file write {1e3 * statistics.median(writes):.1f} ms"
    )


if __name__ == "__main__":
    main()

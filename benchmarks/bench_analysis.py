"""Benchmark: summarize a synthetic run dir of 1M request records on one core.

Goal: <= 10 s on one core for `agentab report` of a 1M-record run. The run dir is
written the way replay writes it (manifest.json + records/part-*.arrow with RECORD_SCHEMA), with
1..16 chunks per request, 2% errors and 1% warmup. Also times the bootstrap of a comparison
(10k resamples, all metrics) for 100,000 requests per arm.

    python benchmarks/bench_analysis.py [--requests 1000000] [--keep DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("POLARS_MAX_THREADS", "1")  # before polars and numpy load: one core
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import polars as pl

from agentab.rundir import RECORD_SCHEMA

MAX_CHUNKS = 16
DERIVED = {"chunk_times_s", "chunk_tokens", "completion_tokens", "osl", "error_class"}


def synthetic_records(n: int, seed: int = 0) -> pl.DataFrame:
    """n records with realistic shapes, built column-wise (no per-row Python)."""
    rng = np.random.default_rng(seed)
    sessions = n // 250 + 1
    itl = rng.lognormal(np.log(0.02), 0.4, n)
    ttft = rng.lognormal(np.log(0.3), 0.8, n)
    n_chunks = rng.integers(1, MAX_CHUNKS + 1, n)
    tokens_per_chunk = rng.integers(1, 8, (n, MAX_CHUNKS)).astype(np.int32)
    steps = np.cumsum(tokens_per_chunk, axis=1) - tokens_per_chunk[:, :1]
    times = ttft[:, None] + steps * itl[:, None]
    sent = np.sort(rng.uniform(0, 3600, n))
    errors = rng.random(n) < 0.02
    frame = pl.DataFrame(
        {
            "request_id": pl.int_range(n, eager=True).cast(pl.String),
            "session_id": pl.Series(rng.integers(0, sessions, n)).cast(pl.String),
            "lane": rng.integers(0, 64, n).astype(np.int32),
            "pass": np.zeros(n, dtype=np.int32),
            "agent_id": np.where(rng.random(n) < 0.3, "sub", "main"),
            "turn": rng.integers(0, 300, n).astype(np.int32),
            "phase": np.where(rng.random(n) < 0.01, "warmup", "profiling"),
            "planned_s": sent - rng.exponential(0.01, n),
            "sent_s": sent,
            "chunk_times_s": pl.Series(times.ravel()).reshape((n, MAX_CHUNKS)),
            "chunk_tokens": pl.Series(tokens_per_chunk.ravel()).reshape((n, MAX_CHUNKS)),
            "n": n_chunks,
            "reasoning_chunks": pl.Series(rng.integers(0, 3, n).astype(np.int32)),
            "prompt_tokens": rng.integers(1000, 200_000, n),
            "cached_tokens": rng.integers(0, 1000, n) * 64,
            "error": errors,
        }
    )
    return frame.select(
        *(c for c in RECORD_SCHEMA.names() if c in frame.columns and c not in DERIVED),
        chunk_times_s=pl.col("chunk_times_s").arr.to_list().list.head(pl.col("n")),
        chunk_tokens=pl.col("chunk_tokens").arr.to_list().list.head(pl.col("n")),
        completion_tokens=pl.col("chunk_tokens").arr.to_list().list.head(pl.col("n")).list.sum()
        .cast(pl.Int64),
        osl=pl.lit(1000, pl.Int64),
        error_class=pl.when("error").then(pl.lit("http_500")),
        error_message=pl.when("error").then(pl.lit("boom")),
    ).select(RECORD_SCHEMA.names()).cast(dict(RECORD_SCHEMA))  # fmt: skip


def write_run_dir(path: Path, records: pl.DataFrame) -> Path:
    (path / "records").mkdir(parents=True)
    records.write_ipc(path / "records" / "part-00000000-00000000.arrow")
    manifest = {"gpu_count": 16, "arm": "auto", "decode_backend": "auto", "replay": {}}
    (path / "manifest.json").write_bytes(orjson.dumps(manifest))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, default=None, help="write the run dir here")
    args = parser.parse_args()
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run, write_summary

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp) / "run"
        t0 = time.perf_counter()
        write_run_dir(root, synthetic_records(args.requests))
        size = sum(p.stat().st_size for p in (root / "records").iterdir()) / 1e6
        print(
            f"wrote {args.requests:,} records ({size:.0f} MB) in {time.perf_counter() - t0:.1f} s"
        )

        t0 = time.perf_counter()
        summary = summarize_run(load_run(root))
        write_summary(summary)
        took = time.perf_counter() - t0
        v = summary.values
        print(
            f"summarize (agentab report) of {args.requests:,} records on "
            f"{pl.thread_pool_size()} thread(s): {took:.2f} s (goal <= 10 s); "
            f"{v['requests_ok']:,} ok, P90 interactivity {v['p90_interactivity_tok_s']:.2f} tok/s"
        )

        from agentab.analysis.compare import bootstrap_ratios
        from agentab.analysis.sample import build_sample, session_index

        part = summary.requests.head(100_000)
        small = type(summary)(summary.run, part, summary.values, summary.sessions)
        index = session_index([small], [small])
        a = build_sample("a", [small], index)
        t0 = time.perf_counter()
        bootstrap_ratios(a, a, index.height, resamples=10_000, seed=0)
        print(
            f"bootstrap of 100,000 requests per arm ({index.height} sessions), 10,000 "
            f"resamples, all metrics: {time.perf_counter() - t0:.2f} s"
        )


if __name__ == "__main__":
    main()

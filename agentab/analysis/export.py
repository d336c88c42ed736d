"""Per-request records as Parquet: one row per request, in the names other tools' users expect.

Columns (times in seconds from the request's send time; null where undefined):

| column | meaning |
|---|---|
| `run`, `arm`, `request_id`, `session_id`, `agent_id`, `phase` | which request of which run |
| `lane` | the replay lane (closed loop) or the session's arrival index (open loop) that sent it |
| `pass` | which play of the trace on that lane (0 = first; a short trace is played again) |
| `turn` | the request's index within its agent's conversation (0 = first) |
| `planned_s`, `sent_s` | when the plan had it due and when it left the client, seconds |
|  | from the run's start (the difference is the client's lateness) |
| `ok`, `error_class` | success; the error class of a failed request (null when ok) |
| `ttft_s` | first content chunk |
| `itl_s` | mean inter-token latency, (last chunk - first chunk) / (OSL - 1): AIPerf's ITL |
|  | and vLLM bench serve's TPOT; null when OSL < 2 or the output came in one chunk |
| `tpot_s` | vLLM bench serve's TPOT, (E2E - TTFT) / (OSL - 1): the same number as `itl_s` |
| `chunk_itl_mean_s` | vLLM bench serve's ITL averaged over the request: the mean gap |
|  | between chunks (differs from `itl_s` when chunks carry several tokens) |
| `e2e_s` | last content chunk |
| `output_tokens` | OSL: server usage, else the counted chunk tokens |
| `prompt_tokens`, `cached_tokens` | prompt tokens, and those the server reported cached |

polars writes the file itself (no pyarrow needed); pandas reads it with pyarrow or fastparquet.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from agentab.analysis.load import Run
from agentab.analysis.metrics import request_table

_gaps = pl.col("chunk_times_s").list.len() - 1

COLUMNS: tuple[str, ...] = (
    "run",
    "arm",
    "request_id",
    "session_id",
    "agent_id",
    "lane",
    "pass",
    "turn",
    "phase",
    "planned_s",
    "sent_s",
    "ok",
    "error_class",
    "ttft_s",
    "itl_s",
    "tpot_s",
    "chunk_itl_mean_s",
    "e2e_s",
    "output_tokens",
    "prompt_tokens",
    "cached_tokens",
)


def request_records(run: Run) -> pl.LazyFrame:
    """The export's rows of one run, in COLUMNS order."""
    chunk_gap = (
        pl.when(_gaps >= 1)
        .then((pl.col("chunk_times_s").list.last() - pl.col("chunk_times_s").list.first()) / _gaps)
        .alias("chunk_itl_mean_s")
    )
    chunks = run.records.select("request_id", "planned_s", chunk_gap)
    return (
        request_table(run.records)
        .join(chunks, on="request_id", how="left")
        .with_columns(
            run=pl.lit(str(run.path)),
            arm=pl.lit(run.arm),
            tpot_s=pl.when(pl.col("osl") >= 2)
            .then((pl.col("e2e_s") - pl.col("ttft_s")) / (pl.col("osl") - 1))
            .when(pl.col("itl_s").is_not_null())
            .then(pl.col("itl_s")),
            output_tokens=pl.col("osl"),
        )
        .with_columns(tpot_s=pl.when(pl.col("itl_s").is_not_null()).then(pl.col("tpot_s")))
        .select(COLUMNS)
    )


def write_parquet(runs: Sequence[Run], path: Path) -> Path:
    """All requests of `runs`, one row each, into one Parquet file."""
    frames = [request_records(r) for r in runs]
    pl.concat(frames, how="vertical").collect().write_parquet(path)
    return path

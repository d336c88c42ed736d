"""Where a run dir keeps its parts and which columns its two tables hold.

A run dir outlives the code that wrote it (it is re-analysed long after the engine that produced
it is gone), so these names are a contract between the replay that writes and the analysis that
reads; they live here, below both, so that neither has to import the other to agree on them.
"""

from __future__ import annotations

import polars as pl

MANIFEST = "manifest.json"
RECORDS_DIR = "records"
METRICS_DIR = "metrics"

_RECORD_COLUMNS: dict[str, pl.DataType | type[pl.DataType]] = {
    "request_id": pl.String,
    "session_id": pl.String,
    "lane": pl.Int32,
    "pass": pl.Int32,
    "agent_id": pl.String,
    "turn": pl.Int32,
    "phase": pl.String,
    "planned_s": pl.Float64,
    "sent_s": pl.Float64,
    "chunk_times_s": pl.List(pl.Float64),
    "chunk_tokens": pl.List(pl.Int32),
    "reasoning_chunks": pl.Int32,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "cached_tokens": pl.Int64,
    "osl": pl.Int64,
    "error_class": pl.String,
    "error_message": pl.String,
    "warning_class": pl.String,
    "warning_message": pl.String,
    "target": pl.Int32,
}
RECORD_SCHEMA = pl.Schema(_RECORD_COLUMNS)
"""Columns of `records/*.arrow` (docs/interfaces.md, "run dir"); analysis reads exactly these."""

ADDED_RECORD_COLUMNS: tuple[str, ...] = ("warning_class", "warning_message", "target")
"""Record columns that run dirs written before them lack, oldest first (a part lacks a tail of
them: `target` alone, or all three); reading such a part fills them with null (nothing was
flagged then, and the target was the one URL of the manifest), so an old run dir still reads
with today's schema."""

METRICS_SCHEMA = pl.Schema(
    {"t_s": pl.Float64, "name": pl.String, "labels": pl.String, "value": pl.Float64}
)
"""Columns of `metrics/*.arrow`: scraped server metrics in long form (labels as JSON)."""

"""report.html's over-time plots explode chunks; vLLM streams carry no per-chunk token counts."""

from __future__ import annotations

import polars as pl

from agentab.analysis.metrics import chunk_table
from agentab.rundir import RECORD_SCHEMA


def _row(**fields: object) -> dict[str, object]:
    row: dict[str, object] = {name: None for name in RECORD_SCHEMA}
    row.update(phase="profiling", **fields)
    return row


def test_reported_chunk_tokens_are_kept_and_missing_ones_spread_evenly() -> None:
    records = pl.LazyFrame(
        [
            # agentab serve / the simulator: tokens per chunk reported (spec decode: several).
            _row(sent_s=1.0, chunk_times_s=[0.1, 0.3], chunk_tokens=[1, 6], completion_tokens=7),
            # vLLM: no per-chunk counts; 6 tokens over 3 chunks -> 2 each.
            _row(sent_s=2.0, chunk_times_s=[0.5, 0.6, 0.7], completion_tokens=6),
            # errored and warmup requests are not plotted.
            _row(sent_s=3.0, chunk_times_s=[0.1], completion_tokens=1, error_class="http_500"),
            {**_row(sent_s=4.0, chunk_times_s=[0.1], completion_tokens=1), "phase": "warmup"},
        ],
        schema=RECORD_SCHEMA,
    )
    table = chunk_table(records).collect()
    assert table["t_s"].to_list() == [1.1, 1.3, 2.5, 2.6, 2.7]
    assert table["tokens"].to_list() == [1.0, 6.0, 2.0, 2.0, 2.0]

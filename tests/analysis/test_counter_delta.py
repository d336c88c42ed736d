"""Counter increases over the profiling phase, series by series: what a scrape missed before a
labelled series existed is counted, and series a reader must keep apart stay apart."""

from __future__ import annotations

import orjson
import polars as pl

from agentab.analysis.summary import (
    DRAFTS,
    PER_POSITION,
    acceptance_rates,
    accepted_per_position,
    counter_delta,
    series_deltas,
)


def frame(rows: list[tuple[float, str, dict[str, str], float]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "t_s": [r[0] for r in rows],
            "name": [r[1] for r in rows],
            "labels": [orjson.dumps(r[2], option=orjson.OPT_SORT_KEYS).decode() for r in rows],
            "value": [r[3] for r in rows],
        }
    )


def pos(i: int, engine: str = "0") -> dict[str, str]:
    return {"engine": engine, "model_name": "m", "position": str(i)}


# Scrapes at t = 0 (before the phase, which starts at 1), 5 and 9. Two engine cores. Position 1
# of engine 1 is first counted between the scrapes at 5 and 9 (a server creates a labelled
# series when it first counts in it): its 4 accepted drafts are all inside the phase.
ROWS = [
    (0.0, DRAFTS, {"engine": "0", "model_name": "m"}, 2.0),
    (0.0, DRAFTS, {"engine": "1", "model_name": "m"}, 0.0),
    (0.0, PER_POSITION, pos(0), 1.0),
    (0.0, PER_POSITION, pos(1), 0.0),
    (5.0, DRAFTS, {"engine": "0", "model_name": "m"}, 12.0),
    (5.0, DRAFTS, {"engine": "1", "model_name": "m"}, 10.0),
    (5.0, PER_POSITION, pos(0), 7.0),
    (5.0, PER_POSITION, pos(1), 3.0),
    (5.0, PER_POSITION, pos(0, "1"), 6.0),
    (9.0, DRAFTS, {"engine": "0", "model_name": "m"}, 22.0),
    (9.0, DRAFTS, {"engine": "1", "model_name": "m"}, 20.0),
    (9.0, PER_POSITION, pos(0), 15.0),
    (9.0, PER_POSITION, pos(1), 8.0),
    (9.0, PER_POSITION, pos(0, "1"), 14.0),
    (9.0, PER_POSITION, pos(1, "1"), 4.0),
]


def test_a_series_created_during_the_phase_counts_from_zero() -> None:
    metrics = frame(ROWS)
    deltas = dict(series_deltas(metrics, PER_POSITION, 1.0).iter_rows())
    assert [deltas[orjson.dumps(p, option=orjson.OPT_SORT_KEYS).decode()] for p in
            (pos(0), pos(1), pos(0, "1"), pos(1, "1"))] == [14.0, 8.0, 14.0, 4.0]  # fmt: skip
    # the totals sum the engine cores; positions stay apart
    assert counter_delta(metrics, DRAFTS, 1.0) == 20.0 + 20.0
    assert accepted_per_position(metrics, 1.0) == [28.0, 12.0]
    assert acceptance_rates(metrics, 1.0) == [28.0 / 40.0, 12.0 / 40.0]


def test_when_scraping_began_after_the_phase_start_the_first_sample_is_the_baseline() -> None:
    late = frame([r for r in ROWS if r[0] > 0.0])  # nothing scraped by t = 1
    assert counter_delta(late, DRAFTS, 1.0) == 10.0 + 10.0
    assert accepted_per_position(late, 1.0) == [8.0 + 8.0, 5.0 + 0.0]


def test_a_counter_never_scraped_is_none_not_zero() -> None:
    metrics = frame(ROWS)
    assert counter_delta(metrics, "vllm:prefix_cache_hits_total", 1.0) is None
    assert accepted_per_position(frame(ROWS[:2]), 1.0) is None

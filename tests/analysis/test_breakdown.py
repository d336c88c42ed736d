"""The comparison per context-length and turn bucket (agentab.analysis.breakdown)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from agentab.analysis.breakdown import CONTEXT_EDGES, TURN_EDGES, breakdown, bucket_labels
from agentab.analysis.compare import compare_runs
from agentab.analysis.load import load_run
from agentab.analysis.markdown import comparison_markdown

from .rundirs import manifest, synthetic_records, write_run

LS = {"decode_backend": "latency_specialized", "arm": "latency_specialized"}


def test_bucket_labels_say_the_edges() -> None:
    assert bucket_labels(CONTEXT_EDGES, tokens=True) == [
        "< 8k", "8k-32k", "32k-64k", "64k-128k", ">= 128k"
    ]  # fmt: skip
    assert bucket_labels(TURN_EDGES, tokens=False) == ["0", "1-4", "5-9", "10-19", ">= 20"]


def _frame(prompts: list[int], itls: list[float], ok: list[bool] | None = None) -> pl.DataFrame:
    n = len(prompts)
    return pl.DataFrame(
        {
            "ok": ok or [True] * n,
            "phase": ["profiling"] * n,
            "error_class": [None] * n,
            "prompt_tokens": prompts,
            "turn": [0] * n,
            "itl_s": itls,
            "ttft_s": [0.1] * n,
        },
        schema_overrides={"error_class": pl.String},
    )


def test_each_bucket_has_its_own_figures_and_ratio() -> None:
    # short prompts: B twice as fast; long prompts: B half as fast; one failed request ignored
    ok = [True, True, True, True, False]
    a = _frame([100, 100, 200_000, 200_000, 100], [0.01, 0.01, 0.01, 0.01, 9.0], ok)
    b = _frame([100, 100, 200_000, 200_000], [0.005, 0.005, 0.02, 0.02])
    rows = breakdown([a], [b], "context")
    assert [r["bucket"] for r in rows] == ["< 8k", ">= 128k"]
    short, long = rows
    assert (short["requests_a"], short["requests_b"]) == (2, 2)
    assert short["itl_p50_s_a"] == 0.01 and short["itl_p50_s_b"] == 0.005
    assert short["p90_interactivity_tok_s_ratio"] == pytest.approx(2.0)
    assert long["p90_interactivity_tok_s_ratio"] == pytest.approx(0.5)
    assert long["ttft_p50_s_ratio"] == 1.0


def test_a_bucket_only_one_arm_reached_has_no_ratio() -> None:
    rows = breakdown([_frame([100], [0.01])], [_frame([100, 50_000], [0.01, 0.01])], "context")
    assert [(r["bucket"], r["requests_a"], r["requests_b"]) for r in rows] == [
        ("< 8k", 1, 1),
        ("32k-64k", 0, 1),
    ]
    assert rows[1]["itl_p50_s_ratio"] is None


def test_the_comparison_carries_both_breakdowns(tmp_path: Path) -> None:
    a = [
        write_run(tmp_path / f"a{k}", synthetic_records(5 + k), manifest(repeat=k)) for k in (0, 1)
    ]
    b = [
        write_run(
            tmp_path / f"b{k}", synthetic_records(5 + k, itl_scale=0.5), manifest(repeat=k, **LS)
        )
        for k in (0, 1)
    ]
    result = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], resamples=200)
    turns = result.to_json()["breakdowns"]["turn"]
    # synthetic sessions have 8 turns (0..7): 20 sessions x 2 runs per turn
    assert [(r["bucket"], r["requests_a"]) for r in turns] == [
        ("0", 40),
        ("1-4", 160),
        ("5-9", 120),
    ]
    assert all(r["p90_interactivity_tok_s_ratio"] == pytest.approx(2.0) for r in turns)
    assert [r["bucket"] for r in result.breakdowns["context"]] == ["< 8k"]  # prompts 1000-1700
    text = comparison_markdown(result)
    assert "By turn index (0 = a session's first request): point estimates per bucket" in text
    assert "| 1-4 | 160 / 160 |" in text

"""The Parquet export: one row per request, the documented columns, values worked out by hand,
readable by polars and pandas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from agentab.analysis.export import COLUMNS

from .rundirs import manifest, rec, write_run


@pytest.fixture()
def exported(tmp_path: Path) -> Path:
    records = [
        # sent at 10 s; chunks at 0.5, 0.7, 1.1 s carrying 1, 2, 2 tokens; server says 5 tokens
        rec(
            "r1",
            session_id="s1",
            planned_s=9.5,
            sent_s=10.0,
            turn=3,
            chunk_times_s=[0.5, 0.7, 1.1],
            chunk_tokens=[1, 2, 2],
            completion_tokens=5,
            prompt_tokens=1200,
            cached_tokens=1024,
        ),
        rec("r2", session_id="s2", sent_s=11.0, error_class="http_500"),
        rec("r3", session_id="s2", sent_s=12.0, chunk_times_s=[0.3], chunk_tokens=[1]),
    ]
    run = write_run(tmp_path / "run", records, manifest(arm="fast"))
    out = tmp_path / "requests.parquet"
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "export", str(run), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return out


def test_each_column_of_a_hand_computed_request(exported: Path) -> None:
    frame = pl.read_parquet(exported)
    assert tuple(frame.columns) == COLUMNS
    assert frame.height == 3
    r1 = frame.filter(pl.col("request_id") == "r1").row(0, named=True)
    assert r1["arm"] == "fast" and r1["session_id"] == "s1" and r1["phase"] == "profiling"
    assert (r1["lane"], r1["pass"], r1["turn"]) == (0, 0, 3)
    assert (r1["planned_s"], r1["sent_s"]) == (9.5, 10.0)
    assert r1["ok"] is True and r1["error_class"] is None
    assert r1["ttft_s"] == pytest.approx(0.5)
    assert r1["e2e_s"] == pytest.approx(1.1)
    assert r1["itl_s"] == pytest.approx((1.1 - 0.5) / (5 - 1))  # 0.15 s per token
    assert r1["tpot_s"] == pytest.approx((1.1 - 0.5) / (5 - 1))  # vLLM's TPOT: the same
    assert r1["chunk_itl_mean_s"] == pytest.approx((1.1 - 0.5) / 2)  # two gaps between chunks
    assert (r1["output_tokens"], r1["prompt_tokens"], r1["cached_tokens"]) == (5, 1200, 1024)
    r2 = frame.filter(pl.col("request_id") == "r2").row(0, named=True)
    assert r2["ok"] is False and r2["error_class"] == "http_500" and r2["ttft_s"] is None
    r3 = frame.filter(pl.col("request_id") == "r3").row(0, named=True)
    assert r3["output_tokens"] == 1 and r3["itl_s"] is None and r3["tpot_s"] is None
    assert r3["chunk_itl_mean_s"] is None and r3["e2e_s"] == pytest.approx(0.3)


def test_pandas_reads_the_same_rows(exported: Path) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.read_parquet(exported)
    assert tuple(frame.columns) == COLUMNS
    row = frame.set_index("request_id").loc["r1"]
    assert row["itl_s"] == pytest.approx(0.15) and row["output_tokens"] == 5
    assert pd.isna(frame.set_index("request_id").loc["r2", "ttft_s"])

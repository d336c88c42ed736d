"""The drain cap (requests in flight when the window closes get `drain_s` to finish) and the
warning when a short trace is played over and over."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from agentab.errors import AgentabError, AgentabWarning
from agentab.replay import simulate_to_dir
from agentab.replay.options import ReplayOptions
from agentab.rundir import scan_records
from agentab.workloads.generator import generate, load_config

ENGINE = {"profile": "gb300-tp16-kimi-k3", "decode_backend": "auto"}


def _run(path: Path, workload, concurrency: int = 4, **replay) -> tuple[dict, pl.DataFrame]:
    simulate_to_dir(
        workload,
        engine_options=ENGINE,
        replay=ReplayOptions(concurrency=concurrency, warmup_requests=1, **replay),
        out_dir=path,
        progress=False,
    )
    manifest = json.loads((path / "manifest.json").read_text())
    return manifest, scan_records(path).collect()


def test_requests_still_running_at_the_cap_are_cut_and_counted(tmp_path: Path) -> None:
    workload = generate(load_config("agentx-coding"), 8, 5)
    manifest, records = _run(tmp_path / "cut", workload, duration_s=60.0, drain_s=0.25)
    stats = manifest["stats"]
    cut = records.filter(pl.col("error_class") == "cancelled")
    assert cut.height > 0 and stats["cancelled"] == cut.height
    assert manifest["status"] == "completed" and stats["stop_reason"] == "duration"
    assert stats["message"] == (
        f"drain cap: {cut.height} request(s) still in flight 0.25 s after the profiling window "
        "closed were cut (recorded as cancelled, in no metric)"
    )
    assert set(cut["error_message"]) == {"cut by the drain cap (0.25 s after the window closed)"}
    window_end = stats["profiling_start_s"] + 60.0
    assert stats["elapsed_s"] == pytest.approx(window_end + 0.25)
    assert (cut["sent_s"] <= window_end).all()  # sent inside the window, cut after it
    # a cap long enough for every request: nothing is cut
    manifest, records = _run(tmp_path / "full", workload, duration_s=60.0, drain_s=3600.0)
    assert manifest["stats"]["cancelled"] == 0 and manifest["stats"]["message"] == ""
    assert records.filter(pl.col("error_class") == "cancelled").height == 0


def test_requests_cut_at_the_cap_are_recorded_in_the_order_they_were_sent(tmp_path: Path) -> None:
    """A stop cancels the requests in flight in dispatch order, so their records come out in
    the same order in every process (not in the order of the tasks' memory addresses)."""
    workload = generate(load_config("agentx-coding"), 24, 5)
    _, records = _run(tmp_path / "cut", workload, concurrency=24, duration_s=30.0, drain_s=0.1)
    cut = records.filter(pl.col("error_class") == "cancelled")
    assert cut.height >= 10
    assert cut["sent_s"].is_sorted()


def test_the_drain_cap_must_be_positive() -> None:
    with pytest.raises(AgentabError, match="drain_s must be > 0"):
        ReplayOptions(drain_s=0.0)
    assert ReplayOptions(duration_s=None).drain_cap_s is None
    assert ReplayOptions(duration_s=900.0).drain_cap_s == 900.0


def test_a_trace_played_over_and_over_warns(tmp_path: Path) -> None:
    workload = generate(load_config("agentx-coding"), 1, 5)
    with pytest.warns(AgentabWarning, match=r"the trace's 1 session\(s\) were played \d+ times"):
        _run(tmp_path / "short", workload, duration_s=600.0, start_window=(0.0, 0.0))


def test_the_ab_report_counts_the_cut_requests(tmp_path: Path) -> None:
    from agentab.analysis.compare import compare_runs
    from agentab.analysis.load import load_run
    from agentab.analysis.markdown import comparison_markdown

    workload = generate(load_config("agentx-coding"), 8, 5)
    runs = []
    for k in (0, 1):
        path = tmp_path / f"run-{k}"
        manifest, _ = _run(path, workload, duration_s=60.0, drain_s=0.25, seed=42 + k)
        runs.append((load_run(path), manifest["stats"]["cancelled"]))
    cut = sum(n for _, n in runs)
    result = compare_runs([runs[0][0]], [runs[1][0]], resamples=100)
    assert (
        f"- Drain cap: {cut} request(s) in 2 run(s) were still in flight when their run's drain "
        "cap passed and were cut (recorded as cancelled, in no metric)."
    ) in comparison_markdown(result)

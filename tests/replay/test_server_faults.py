"""Server faults that end a 200 stream properly: each gets its class in the record and the report.

Every request asks for 6 tokens with ignore_eos; the fault server (a real aiohttp server on
127.0.0.1) answers each request of a run with one fault (tests/replay/fault_server.py).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import polars as pl
import pytest

from agentab.replay import ReplayOptions, replay_to_dir
from agentab.rundir import scan_records
from agentab.workloads.model import Request, Session, Workload

from .fault_server import SERVER_FAULT_MODES, FaultServer

# mode -> (error_class, warning_class, message of the one that is set, content chunks timed)
EXPECTED = {
    "usage_over_ids": (
        "usage_above_delivered",
        None,
        "usage claims 6 tokens, the chunks' token ids hold 3",
        3,
    ),
    "over_generation": (
        "over_generation",
        None,
        "usage 9 tokens, 9 content chunks, for max_tokens 6",
        9,
    ),
    "empty_text": (
        None,
        "empty_chunks",
        "3 chunk(s) without text or token ids, not timed as tokens",
        3,
    ),
    "abort": ("aborted", None, 'finish_reason "abort" after 6 content chunk(s)', 6),
    "abort_early": ("aborted", None, 'finish_reason "abort" after 3 content chunk(s)', 3),
    "usage_over_chunks": (
        None,
        "usage_above_chunks",
        "usage claims 6 tokens over 3 content chunks without token ids",
        3,
    ),
}


def _workload(sessions: int = 1, turns: int = 2) -> Workload:
    request = Request(t=0.0, in_tokens=40, out_tokens=6, hash_ids=(1, 2), api_time=0.0)
    return Workload(tuple(Session(f"s{i}", 16, (request,) * turns) for i in range(sessions)))


def _opts(**kw: object) -> ReplayOptions:
    base: dict[str, object] = {
        "concurrency": 1,
        "passes": 1,
        "duration_s": None,
        "start_window": (0.0, 0.0),
        "warmup_requests": 0,
        "request_timeout_s": 5.0,
        "max_error_rate": 1.0,
    }
    base.update(kw)
    return ReplayOptions(**base)  # type: ignore[arg-type]


def test_every_kind_has_an_expectation() -> None:
    assert set(EXPECTED) == set(SERVER_FAULT_MODES)


@pytest.mark.parametrize("mode", SERVER_FAULT_MODES)
def test_server_fault_is_classified(tmp_path: Path, mode: str) -> None:
    with FaultServer(lambda rid: mode) as srv:
        run = replay_to_dir(
            _workload(), url=srv.url, replay=_opts(), out_dir=tmp_path / "r", progress=False
        )
    error, warning, message, chunks = EXPECTED[mode]
    df = scan_records(run).collect()
    assert df.height == 2
    assert df["error_class"].to_list() == [error] * 2
    assert df["warning_class"].to_list() == [warning] * 2
    column = "error_message" if error else "warning_message"
    assert df[column].to_list() == [message] * 2
    assert df["chunk_times_s"].list.len().to_list() == [chunks] * 2
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stats"]["error_classes"] == ({error: 2} if error else {})
    assert manifest["stats"]["warning_classes"] == ({warning: 2} if warning else {})


def test_empty_text_chunks_are_not_timed_as_tokens(tmp_path: Path) -> None:
    # The first chunk is empty: TTFT is the first chunk with text, and the server's usage
    # (6 tokens) stays the OSL.
    with FaultServer(lambda rid: "empty_text", token_interval_s=0.05) as srv:
        run = replay_to_dir(
            _workload(turns=1), url=srv.url, replay=_opts(), out_dir=tmp_path / "r", progress=False
        )
    row = scan_records(run).collect().row(0, named=True)
    assert row["completion_tokens"] == 6
    times = row["chunk_times_s"]
    # Chunks are written 50 ms apart, so the first text chunk comes at least 50 ms after the
    # empty one (timed, it would have been the TTFT), and text chunks 100 ms apart: lower bounds
    # only, a loaded machine can only add to them.
    assert len(times) == 3
    assert times[0] >= 0.045
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.095


def test_the_reports_name_every_class_per_arm(tmp_path: Path) -> None:
    from agentab.analysis.compare import compare_summaries
    from agentab.analysis.faults import FAULTS_TITLE, fault_rows, faults_json
    from agentab.analysis.html import comparison_html
    from agentab.analysis.load import load_run
    from agentab.analysis.markdown import comparison_markdown, run_markdown
    from agentab.analysis.summary import summarize_run

    modes = ("ok", *SERVER_FAULT_MODES)
    with FaultServer(lambda rid: modes[int(rid.rsplit("N", 1)[1]) % len(modes)]) as srv:
        run_a = replay_to_dir(
            _workload(turns=len(modes)),
            url=srv.url,
            replay=_opts(),
            out_dir=tmp_path / "a",
            progress=False,
        )
    with FaultServer() as srv:
        run_b = replay_to_dir(
            _workload(turns=len(modes)),
            url=srv.url,
            replay=_opts(),
            out_dir=tmp_path / "b",
            progress=False,
        )
    a, b = summarize_run(load_run(run_a)), summarize_run(load_run(run_b))
    assert a.values["errors_by_class"] == {
        "aborted": 2,
        "over_generation": 1,
        "usage_above_delivered": 1,
    }
    assert a.values["warnings_by_class"] == {"empty_chunks": 1, "usage_above_chunks": 1}
    assert a.values["requests_ok"] == 3  # a warning does not fail its request
    assert fault_rows([a], [b]) == [
        ["aborted", "error", "2", "0"],
        ["over_generation", "error", "1", "0"],
        ["usage_above_delivered", "error", "1", "0"],
        ["empty_chunks", "warning", "1", "0"],
        ["usage_above_chunks", "warning", "1", "0"],
    ]
    assert faults_json([a], [b])["warnings_by_class"] == {
        "a": {"empty_chunks": 1, "usage_above_chunks": 1},
        "b": {},
    }
    assert "warnings by class: {'empty_chunks': 1, 'usage_above_chunks': 1}." in run_markdown(a)
    ok = a.requests.filter(pl.col("ok"))
    assert sorted(ok["warning_class"].fill_null("").to_list()) == [
        "",
        "empty_chunks",
        "usage_above_chunks",
    ]
    # The A/B report: the same table in Markdown and HTML, the counts in comparison.json.
    comparison = compare_summaries([a], [b], resamples=200)
    markdown = comparison_markdown(comparison)
    assert (
        f"{FAULTS_TITLE}\n\n| class | kind | A requests | B requests |\n|---|---|---|---|\n"
        "| aborted | error | 2 | 0 |\n"
    ) in markdown
    assert "| usage_above_chunks | warning | 1 | 0 |\n\nDefinitions:" in markdown
    page = comparison_html(comparison)
    assert "<td>usage_above_delivered</td><td>error</td><td>1</td><td>0</td>" in (
        page.replace(' class=""', "")
    )
    assert comparison.to_json()["errors_by_class"] == {
        "a": {"aborted": 2, "over_generation": 1, "usage_above_delivered": 1},
        "b": {},
    }

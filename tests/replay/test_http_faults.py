"""HttpTarget against a misbehaving server on 127.0.0.1: every request gets a classified record."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from agentab.errors import AgentabError
from agentab.replay import ReplayOptions, replay_to_dir
from agentab.rundir import scan_records
from agentab.workloads.model import Request, Session, Workload

from .fault_server import MODES, FaultServer, node_of

EXPECTED_CLASS = {
    "ok": None,
    "500": "http",
    "reset": "broken_stream",
    "stall": "timeout",
    "malformed": "malformed_stream",
    "overflow": "context_overflow",
    "empty": "empty_response",
    "short": "short_output",
    "no_usage": "no_usage",
    "keepalive": "keepalive_timeout",
    "keepalive_done": "empty_response",
    "404": "http",
}


def _workload(sessions: int, turns: int) -> Workload:
    return Workload(
        tuple(
            Session(
                f"s{i}",
                16,
                tuple(
                    Request(t=0.01 * k, in_tokens=40, out_tokens=6, hash_ids=(1, 2), api_time=0.0)
                    for k in range(turns)
                ),
            )
            for i in range(sessions)
        )
    )


def _opts(**kw: object) -> ReplayOptions:
    base: dict[str, object] = {
        "concurrency": 4,
        "passes": 1,
        "duration_s": None,
        "start_window": (0.0, 0.0),
        "warmup_requests": 0,
        "request_timeout_s": 0.5,
    }
    base.update(kw)
    return ReplayOptions(**base)  # type: ignore[arg-type]


def _mode(rid: str) -> str:
    return MODES[node_of(rid) % len(MODES)]


def test_every_fault_is_recorded_with_its_class(tmp_path: Path) -> None:
    wl = _workload(sessions=4, turns=len(MODES))
    with FaultServer(_mode, stall_s=3.0) as srv:
        run = replay_to_dir(
            wl,
            url=srv.url,
            replay=_opts(max_error_rate=1.0),
            out_dir=tmp_path / "r",
            progress=False,
        )
    df = scan_records(run).collect()
    assert df.height == 4 * len(MODES)  # every request has a record
    for rid, cls, msg in df.select("request_id", "error_class", "error_message").iter_rows():
        assert cls == EXPECTED_CLASS[_mode(rid)], (rid, cls, msg)
    by = dict(zip(df["request_id"], df["error_message"], strict=True))
    assert by["L0-P0-N1"].startswith("HTTP 500: internal boom")
    assert "maximum context length is 1024" in by["L0-P0-N5"]
    assert by["L0-P0-N6"] == "HTTP 200 and [DONE] without a content chunk"
    assert by["L0-P0-N7"] == "2 of 6 tokens with ignore_eos"
    assert by["L0-P0-N8"] == "the stream ended without the usage chunk include_usage asks for"
    assert by["L0-P0-N9"].startswith("only ") and by["L0-P0-N9"].endswith(
        " keep-alive line(s), no data, for 0.5 s"
    )
    assert by["L0-P0-N11"].startswith("HTTP 404: {")
    ok = df.filter(pl.col("error_class").is_null())
    assert ok["completion_tokens"].to_list() == [6] * 4
    assert ok["prompt_tokens"].to_list() == [40] * 4
    assert ok["chunk_times_s"].list.len().to_list() == [6] * 4
    assert ok["cached_tokens"].null_count() == 4  # the server does not report them
    # The two chunks before a reset or a stall are kept.
    assert (
        df.filter(pl.col("error_class") == "timeout")["chunk_times_s"].list.len().to_list()
        == [2] * 4
    )
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["model"] == "fault-model"
    assert manifest["stats"]["error_rate"] == pytest.approx(44 / 48)
    assert manifest["stats"]["error_classes"] == {
        "broken_stream": 4,
        "context_overflow": 4,
        "empty_response": 8,
        "http": 8,
        "keepalive_timeout": 4,
        "malformed_stream": 4,
        "no_usage": 4,
        "short_output": 4,
        "timeout": 4,
    }
    # None of them enters a latency metric; the run's summary counts each class.
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run

    values = summarize_run(load_run(run)).values
    assert (values["requests_ok"], values["requests_error"]) == (4, 44)
    assert values["errors_by_class"] == manifest["stats"]["error_classes"]


def test_error_rate_guard_ends_the_run_with_valid_records(tmp_path: Path) -> None:
    wl = _workload(sessions=2, turns=40)
    # Every third request fails with a 500: 33% > 10%.
    every_third = FaultServer(lambda rid: "500" if node_of(rid) % 3 == 0 else "ok")
    expected = r"run ended early: error rate .* exceeds max_error_rate 10\.0%"
    with every_third as srv, pytest.raises(AgentabError, match=expected):
        replay_to_dir(
            wl,
            url=srv.url,
            replay=_opts(concurrency=2),
            out_dir=tmp_path / "r",
            progress=False,
        )
    run = tmp_path / "r"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "error_rate"
    df = scan_records(run).collect()
    assert df.height == manifest["stats"]["dispatched"] < 80
    assert df.height == manifest["stats"]["finished"] + manifest["stats"]["cancelled"]


def test_connect_errors_and_unreachable_server(tmp_path: Path) -> None:
    wl = _workload(sessions=1, turns=2)
    with FaultServer() as srv:
        url = srv.url
    # The server is gone: model discovery fails with one clear line.
    with pytest.raises(AgentabError, match="cannot reach the server"):
        replay_to_dir(wl, url=url, replay=_opts(), out_dir=tmp_path / "a", progress=False)
    # With --model given, each request fails to connect and is recorded as such.
    with pytest.raises(AgentabError, match=r"run failed: error rate 100\.0%"):
        replay_to_dir(
            wl,
            url=url,
            model="m",
            replay=_opts(concurrency=1),
            out_dir=tmp_path / "b",
            progress=False,
        )
    df = scan_records(tmp_path / "b").collect()
    assert df["error_class"].to_list() == ["connect", "connect"]


def test_api_key_from_env_is_sent_and_never_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTAB_TEST_KEY", "sekrit-123")
    wl = _workload(sessions=1, turns=1)
    with FaultServer() as srv:
        run = replay_to_dir(
            wl,
            url=srv.url,
            replay=_opts(),
            out_dir=tmp_path / "k",
            progress=False,
            api_key_env="AGENTAB_TEST_KEY",
        )
    for path in run.rglob("*"):
        if path.is_file():
            assert b"sekrit-123" not in path.read_bytes()
    monkeypatch.delenv("AGENTAB_TEST_KEY")
    with pytest.raises(AgentabError, match="AGENTAB_TEST_KEY is not set"):
        replay_to_dir(
            wl,
            url="http://127.0.0.1:9",
            replay=_opts(),
            out_dir=tmp_path / "k2",
            progress=False,
            api_key_env="AGENTAB_TEST_KEY",
        )


def test_a_run_stopped_by_its_error_rate_says_why(tmp_path: Path) -> None:
    # A wrong model name: every request gets vLLM's 404. The one-line error names the class,
    # the status and the start of the body; the run's report shows status and errors, warmup
    # errors included.
    import subprocess
    import sys

    from agentab.workloads import save

    save(_workload(sessions=2, turns=30), tmp_path / "wl.jsonl")
    with FaultServer(lambda rid: "404") as srv:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "agentab",
                "replay",
                str(tmp_path / "wl.jsonl"),
                "--url",
                srv.url,
                "--model",
                "no-such-model",
                "--out",
                str(tmp_path / "r"),
                "--concurrency",
                "2",
                "--warmup-requests",
                "1",
                "--duration",
                "0",
                "--passes",
                "1",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    body = (
        '{"object": "error", "message": "The model `no-such-model` does not exist.", '
        '"type": "NotFoundError", "code": 404}'
    )
    assert result.returncode == 2
    assert result.stderr.startswith(
        "agentab: error: run ended early: error rate 100.0% (20 of 20 requests) exceeds "
        f"max_error_rate 10.0%; top errors: http x20: HTTP 404: {body}"
    ), result.stderr
    assert result.stderr.count("\n") == 1
    report = subprocess.run(
        [sys.executable, "-m", "agentab", "report", str(tmp_path / "r"), "--allow-incomplete"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0].startswith(f"**INCOMPLETE RUN(S)**: {tmp_path / 'r'} (error_rate: ")
    assert "- Status: error_rate, stopped by error_rate: error rate 100.0% (20 of 20" in (
        report.stdout
    )
    assert "- Warmup errors by class: {'http': 4}." in lines
    assert f"- First `http` error: HTTP 404: {body}" in lines

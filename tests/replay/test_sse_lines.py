"""SSE line splitting: exact lines across reads, the per-line limit, and a huge line that does not
hold up the other streams of a run (tests/replay/fault_server.py serves it over real HTTP)."""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl
import pytest

from agentab.errors import AgentabError
from agentab.replay import ReplayOptions, replay_to_dir
from agentab.replay.targets.sse import (
    DEFAULT_MAX_LINE_BYTES,
    MAX_LINE_ENV,
    EventAssembler,
    EventTooLong,
    LineSplitter,
    LineTooLong,
    max_line_bytes_from_env,
)
from agentab.rundir import scan_records
from agentab.workloads.model import Request, Session, Workload

from .fault_server import HUGE, HUGE_ERROR, MULTILINE, UNTERMINATED, FaultServer


def test_lines_are_the_same_however_the_body_is_cut() -> None:
    body = b'data: {"a": 1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    expected = [b'data: {"a": 1}', b"", b": keep-alive", b"", b"data: [DONE]", b""]
    for step in (1, 2, 3, 7, len(body)):
        splitter = LineSplitter()
        lines = []
        for at in range(0, len(body), step):
            lines += splitter.feed(body[at : at + step])
        assert lines == expected, step
        assert splitter.pending_bytes == 0


def test_a_line_over_the_limit_is_refused_as_soon_as_it_passes_it() -> None:
    splitter = LineSplitter(10)
    assert splitter.feed(b"data: 1234") == []  # exactly 10 bytes pending: still taken
    with pytest.raises(LineTooLong) as exc:
        splitter.feed(b"5")
    assert str(exc.value) == "an SSE line passed 10 bytes (11 bytes of it read)"
    # Whole lines in one read, and an unfinished rest, are held to the same limit.
    assert LineSplitter(10).feed(b"data: 1234\ndata: 12") == [b"data: 1234"]
    with pytest.raises(LineTooLong, match=r"passed 10 bytes \(11 bytes"):
        LineSplitter(10).feed(b"data: 12345\n")
    with pytest.raises(LineTooLong, match=r"passed 10 bytes \(12 bytes"):
        LineSplitter(10).feed(b"\ndata: 123456")


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MAX_LINE_ENV, raising=False)
    assert max_line_bytes_from_env() == DEFAULT_MAX_LINE_BYTES == 16 * 1024 * 1024
    monkeypatch.setenv(MAX_LINE_ENV, "1000")
    assert max_line_bytes_from_env() == 1000
    monkeypatch.setenv(MAX_LINE_ENV, "lots")
    with pytest.raises(AgentabError, match=r"^AGENTAB_MAX_SSE_LINE_BYTES='lots': expected a pos"):
        max_line_bytes_from_env()


def test_a_huge_line_fails_its_request_and_the_other_stream_keeps_going(tmp_path: Path) -> None:
    # Lane 0's request sends one data line 1 MiB over the default limit; lane 1's streams 150
    # tokens 10 ms apart meanwhile. The huge request fails alone, with its class; the other
    # stream gets every chunk without a timeout (the limit is 2 s of silence).
    request = Request(t=0.0, in_tokens=40, out_tokens=150, hash_ids=(1,), api_time=0.0)
    workload = Workload((Session("s0", 16, (request,)), Session("s1", 16, (request,))))
    opts = ReplayOptions(
        concurrency=2,
        passes=1,
        duration_s=None,
        start_window=(0.0, 0.0),
        warmup_requests=0,
        request_timeout_s=2.0,
        max_error_rate=1.0,
    )
    huge = DEFAULT_MAX_LINE_BYTES + 1024 * 1024
    with FaultServer(
        lambda rid: HUGE if rid.startswith("L0-") else "ok",
        token_interval_s=0.01,
        huge_bytes=huge,
    ) as srv:
        run = replay_to_dir(workload, url=srv.url, replay=opts, out_dir=tmp_path / "r")
    df = scan_records(run).collect().sort("lane")
    assert df["error_class"].to_list() == ["line_too_long", None]
    # how much of the line had arrived when it passed the limit depends on the reads' sizes
    assert df["error_message"][0].startswith(f"an SSE line passed {DEFAULT_MAX_LINE_BYTES:,}")
    assert df["error_message"][0].endswith(f"(limit: {MAX_LINE_ENV})")
    assert df["chunk_times_s"].list.len().to_list() == [1, 150]  # the chunk before the line
    assert df.filter(pl.col("lane") == 1)["completion_tokens"].to_list() == [150]


def test_an_endless_error_body_is_not_read_past_its_excerpt(tmp_path: Path) -> None:
    # A 500 whose body never ends (the server stops after 60 s): the record gets the status and
    # the start of the body, as for any 500, once 2,000 bytes of it are read; the client then
    # closes the connection. Reading the whole body would take the server's 60 s and all the
    # bytes it sent meanwhile (the bound on the run's wall time is loose on purpose).
    request = Request(t=0.0, in_tokens=40, out_tokens=6, hash_ids=(1,), api_time=0.0)
    opts = ReplayOptions(
        concurrency=1,
        passes=1,
        duration_s=None,
        start_window=(0.0, 0.0),
        warmup_requests=0,
        request_timeout_s=5.0,
        max_error_rate=1.0,
    )
    started = time.monotonic()
    with FaultServer(lambda rid: HUGE_ERROR, stall_s=60.0) as srv:
        run = replay_to_dir(
            Workload((Session("s0", 16, (request, request)),)),
            url=srv.url,
            replay=opts,
            out_dir=tmp_path / "r",
            progress=False,
        )
    df = scan_records(run).collect()
    assert df["error_class"].to_list() == ["http", "http"]
    assert df["error_message"].to_list() == ["HTTP 500: " + "boom " * 60] * 2
    assert time.monotonic() - started < 30


def test_an_events_data_lines_are_joined_and_dispatched_at_its_blank_line() -> None:
    events = EventAssembler()
    # one event over three reads' lines: nothing until the blank line that ends it
    assert events.feed([b'data: {"a":', b"id: 7", b": a comment"]) == ([], True)
    assert events.feed([b"data:1,", b"data", b'data:  "b": 2}\r']) == ([], True)
    assert events.feed([b"event: message", b"\r"]) == ([b'{"a":\n1,\n\n "b": 2}'], False)
    assert events.comments == 1
    # blank lines with no data dispatch nothing; a comment alone is no data
    assert events.feed([b"", b": keep-alive", b""]) == ([], False)
    assert events.comments == 2
    # two events in one read, and an event left open when the body ends
    assert events.feed([b"data: 1", b"", b"data: 2", b"", b"data: [DONE]"]) == (
        [b"1", b"2"],
        True,
    )
    assert events.end() == [b"[DONE]"]
    assert events.end() == []


def test_an_event_over_the_limit_is_refused_however_short_its_lines() -> None:
    events = EventAssembler(10)
    assert events.feed([b"data: 1234", b"data: 1234"]) == ([], True)  # 5 + 5 bytes with "\n"s
    with pytest.raises(EventTooLong) as exc:
        events.feed([b"data: 1"])
    assert isinstance(exc.value, LineTooLong)  # a replay records it as line_too_long
    assert str(exc.value) == "an SSE event passed 10 bytes (12 bytes of it read)"


def _one_request_of_12_tokens(tmp_path: Path, mode: str) -> pl.DataFrame:
    """The records of one 12-token request replayed against a FaultServer in `mode`."""
    request = Request(t=0.0, in_tokens=40, out_tokens=12, hash_ids=(1,), api_time=0.0)
    opts = ReplayOptions(
        concurrency=1,
        passes=1,
        duration_s=None,
        start_window=(0.0, 0.0),
        warmup_requests=0,
        request_timeout_s=10.0,
        max_error_rate=1.0,
    )
    with FaultServer(lambda rid: mode) as srv:
        run = replay_to_dir(
            Workload((Session("s0", 16, (request,)),)),
            url=srv.url,
            replay=opts,
            out_dir=tmp_path / "r",
            progress=False,
        )
    return scan_records(run).collect()


def test_a_stream_of_multi_line_events_is_read_as_its_chunks(tmp_path: Path) -> None:
    # Every chunk's JSON split over three data lines, CRLF line ends, an id field and a comment
    # inside each event (tests/replay/fault_server.py, split_chunk): read line by line, each
    # half is undecodable and the request fails as malformed_stream.
    df = _one_request_of_12_tokens(tmp_path, MULTILINE)
    assert df["error_class"].to_list() == [None]
    assert df["warning_class"].to_list() == [None]
    assert df["chunk_times_s"].list.len().to_list() == [12]
    assert df["completion_tokens"].to_list() == [12]


def test_a_last_line_without_a_line_end_is_read_when_the_body_ends(tmp_path: Path) -> None:
    splitter = LineSplitter()
    assert splitter.feed(b'data: {"a": 1}\n\ndata: [DO') == [b'data: {"a": 1}', b""]
    assert splitter.feed(b"NE]") == []
    assert splitter.end() == [b"data: [DONE]"] and splitter.pending_bytes == 0
    assert splitter.end() == []
    # over HTTP: a server that closes right after `data: [DONE]` with no line end
    df = _one_request_of_12_tokens(tmp_path, UNTERMINATED)
    assert df["error_class"].to_list() == [None]
    assert df["chunk_times_s"].list.len().to_list() == [12]
    assert df["completion_tokens"].to_list() == [12]

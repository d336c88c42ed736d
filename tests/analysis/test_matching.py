"""The paired design's request matching: the latency metrics of a repeat compare the requests
both arms completed, named by the plan's request ids."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from agentab.analysis.load import load_run
from agentab.analysis.matching import match_requests, same_plan
from agentab.analysis.summary import summarize_run

from .rundirs import manifest, rec, write_run


def _records(ids: list[str], errors: tuple[str, ...] = ()) -> list[dict]:
    return [
        rec(
            rid,
            session_id=f"s{int(rid[1:]) % 3}",
            chunk_times_s=[0.1, 0.2, 0.3],
            chunk_tokens=[1, 1, 1],
            completion_tokens=3,
            error_class="http_500" if rid in errors else None,
        )
        for rid in ids
    ]


def _summary(path: Path, records: list[dict], **changes) -> object:
    return summarize_run(load_run(write_run(path, records, manifest(**changes))))


def test_a_repeat_compares_the_requests_both_arms_completed(tmp_path: Path) -> None:
    # A completed r0..r9; B completed r0..r7, failed r8 and got one request further (r10).
    a = _summary(tmp_path / "a", _records([f"r{i}" for i in range(10)]))
    b = _summary(
        tmp_path / "b",
        _records([f"r{i}" for i in range(9)] + ["r10"], errors=("r8",)),
        decode_backend="latency_specialized",
    )
    frames_a, frames_b, matching = match_requests([a], [b])
    assert matching.matched == [8] and matching.only_a == [2] and matching.only_b == [1]
    want = [f"r{i}" for i in range(8)]
    assert sorted(frames_a[0]["request_id"].to_list()) == want
    assert sorted(frames_b[0]["request_id"].to_list()) == want
    assert matching.dropped_share == 3 / 19
    assert matching.describe() == (
        "latency metrics on the 8 requests both arms completed (per repeat 8); left out: "
        "2 only A completed, 1 only B completed"
    )


def test_runs_of_different_plans_are_not_matched(tmp_path: Path) -> None:
    ids = [f"r{i}" for i in range(4)]
    a = _summary(tmp_path / "a", _records(ids))
    b = _summary(tmp_path / "b", _records(ids), replay__seed=43)
    c = _summary(tmp_path / "c", _records(ids), workload_hash="x" * 64)
    assert not same_plan(a, b) and not same_plan(a, c) and same_plan(a, a)
    assert match_requests([a], [b]) is None
    assert match_requests([a, a], [a]) is None


def test_warmup_requests_never_enter_the_match(tmp_path: Path) -> None:
    records = _records(["r0", "r1"])
    records[0]["phase"] = "warmup"
    a = _summary(tmp_path / "a", records)
    _, _, matching = match_requests([a], [a])
    assert matching.matched == [1]
    assert a.requests.filter(pl.col("phase") == "warmup").height == 1

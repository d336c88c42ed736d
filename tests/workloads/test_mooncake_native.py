"""Mooncake import (exact values) and the native JSONL round trip."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import orjson
import pytest

from agentab.workloads import Request, Session, Workload, load, save
from agentab.workloads.stats import summarize

from .conftest import DATA

SAMPLE = DATA / "mooncake" / "sample.jsonl"


def test_mooncake_lines_become_one_request_sessions() -> None:
    wl = load(SAMPLE)
    assert [s.id for s in wl.sessions] == ["line-1", "line-2", "line-3"]
    assert [s.arrival_s for s in wl.sessions] == [0.0, 1.5, 2.75]
    assert {s.block_size for s in wl.sessions} == {512}
    assert {s.hash_scope for s in wl.sessions} == {"global"}
    first = wl.sessions[0].items[0]
    # 1100 tokens hold 2 full blocks of 512: the id of the partial third block is dropped.
    assert first == Request(t=0.0, in_tokens=1100, out_tokens=12, hash_ids=(0, 1))
    assert wl.sessions[1].items[0].hash_ids == (0, 1)
    assert wl.sessions[2].items[0] == Request(t=0.0, in_tokens=300, out_tokens=7)


def test_mooncake_block_size_option() -> None:
    wl = load(SAMPLE, "mooncake", block_size=256)
    assert wl.sessions[0].items[0].hash_ids == (0, 1, 2)
    assert wl.sessions[1].items[0].hash_ids == (0, 1)


def test_mooncake_inspect_figures() -> None:
    got = summarize(load(SAMPLE))
    assert (got["sessions"], got["requests"], got["parent_requests"]) == (3, 3, 3)
    assert got["pause_s"] == dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    # Mooncake ids are global: line 2's two blocks were seen in line 1 (2 x 512 of 2,424).
    assert got["theoretical_cache_hit_ratio"] == pytest.approx(1024 / (1100 + 1024 + 300))
    assert got["suffix_growth_ratio"] is None
    assert got["input_tokens"]["mean"] == pytest.approx((1100 + 1024 + 300) / 3)


def test_native_round_trip_is_lossless(tmp_path: Path) -> None:
    wl = load(DATA / "agentx")
    for name in ("w.jsonl", "w.jsonl.gz"):
        save(wl, tmp_path / name)
        back = load(tmp_path / name)
        assert back.sessions == wl.sessions
        assert back.content_hash == wl.content_hash
    moon = load(SAMPLE)
    save(moon, tmp_path / "m.jsonl")
    assert load(tmp_path / "m.jsonl").sessions == moon.sessions


def test_native_hash_ids_are_stored_as_deltas(tmp_path: Path) -> None:
    wl = load(DATA / "agentx" / "joins.json")
    save(wl, tmp_path / "w.jsonl")
    lines = (tmp_path / "w.jsonl").read_bytes().splitlines()
    assert orjson.loads(lines[0]) == {"agentab_workload": 1, "sessions": 1}
    items = orjson.loads(lines[1])["items"]
    assert [(i.get("hash_prefix"), i.get("hash_new")) for i in items] == [
        (0, [1, 2]),
        (None, None),  # subagent a1
        (None, None),  # subagent a2
        (2, [3, 4]),
        (4, [5, 6]),
    ]
    assert [(i["hash_prefix"], i["hash_new"]) for i in items[1]["items"]] == [
        (0, [20, 21]),
        (2, [22]),
    ]


def test_content_hash_is_pinned() -> None:
    """Same content -> same hash in any process, on any machine: pinned to a literal."""
    wl = Workload(
        (
            Session(
                id="pin",
                block_size=4,
                items=(Request(t=0, in_tokens=9, out_tokens=1, hash_ids=(1, 2)),),
            ),
        )
    )
    canonical = (
        b'{"id":"pin","block_size":4,"system_tokens":0,"tool_tokens":0,"models":[],'
        b'"arrival_s":0.0,"hash_scope":null,"items":[{"t":0.0,"in":9,"out":1,"hash_prefix":0,'
        b'"hash_new":[1,2],"kind":"parent","agent_id":"main","type":"n","input_types":[],'
        b'"output_types":[],"stop":"","api_time":null,"think_time":null,"ttft":null,"model":""}]}\n'
    )
    assert wl.content_hash == hashlib.sha256(canonical).hexdigest()
    assert wl.content_hash == "f255bdf7a7ba399b55086ca86e66a229d6e87978eeb320474612db2d9a2dd162"
    assert wl.content_hash == Workload(wl.sessions, source="elsewhere").content_hash


def test_gzip_native_detected_by_magic(tmp_path: Path) -> None:
    wl = load(DATA / "agentx")
    save(wl, tmp_path / "w.jsonl")
    (tmp_path / "plain-name").write_bytes(gzip.compress((tmp_path / "w.jsonl").read_bytes()))
    assert load(tmp_path / "plain-name").content_hash == wl.content_hash

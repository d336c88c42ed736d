"""Hand-written AgentX sessions: exact parsed values and exact `inspect --json` figures.

tests/data/agentx/joins.json: two subagents spawned together (one with relative-looking but
absolute inner times) that the parent's next turn joins. tests/data/agentx/bg-reset.json: an
old capture (inner times relative to the spawn) with a background subagent and a context reset.
Every expected number below was computed by hand from those files (block_size 4).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import orjson
import pytest

from agentab.workloads import Request, Subagent, load

from .conftest import DATA as ROOT
from .conftest import run_main as run_cli

DATA = ROOT / "agentx"


def test_joins_session_parsed_exactly() -> None:
    wl = load(DATA / "joins.json")
    assert len(wl) == 1
    s = wl.sessions[0]
    assert (s.id, s.block_size, s.system_tokens, s.tool_tokens) == ("join-1", 4, 3, 5)
    assert s.models == ("m-large", "m-small")
    assert s.hash_scope is None and s.arrival_s == 0.0
    r0, a1, a2, r3, r4 = s.items
    assert r0 == Request(
        t=0.0,
        in_tokens=10,
        out_tokens=2,
        hash_ids=(1, 2),
        kind="parent",
        agent_id="main",
        type="n",
        input_types=("text",),
        output_types=("tool_use",),
        stop="tool_use",
        api_time=1.0,
        model="m-large",
    )
    assert isinstance(a1, Subagent) and isinstance(a2, Subagent)
    assert (a1.agent_id, a1.t, a1.duration_s, a1.end, a1.background) == ("a1", 1.5, 3.0, 4.5, False)
    assert (a1.subagent_type, a1.status, a1.total_tokens, a1.tool_use_count) == (
        "Explore",
        "completed",
        25,
        1,
    )
    assert (a1.system_tokens, a1.tool_tokens, a1.models) == (1, 2, ("m-small",))
    # Inner times are absolute here (not earlier than the spawn): kept as they are.
    inner = list(a1.requests())
    assert [r.t for r in inner] == [2.0, 3.0]
    assert [(r.kind, r.agent_id, r.type) for r in inner] == [("subagent", "a1", "s")] * 2
    assert inner[0].ttft == 0.1 and inner[1].ttft is None
    assert inner[1].hash_ids == (20, 21, 22)
    assert (a2.end, [r.t for r in a2.requests()]) == (3.5, [1.6])
    assert (r3.t, r3.think_time, r3.hash_ids, r3.output_types) == (
        5.0,
        0.5,
        (1, 2, 3, 4),
        ("text", "tool_use"),
    )
    assert (r4.t, r4.type, r4.ttft, r4.stop) == (7.5, "s", 0.25, "end_turn")
    # The first parent turn at or after both subagents' ends (4.5, 3.5) is r3 at t=5.0.
    assert min(r.t for r in s.requests() if r.t >= max(a1.end, a2.end)) == 5.0


def test_old_capture_relative_inner_times_background_and_reset() -> None:
    s = load(DATA / "bg-reset.json").sessions[0]
    _r0, b1, _r2, r3, r4 = s.items
    assert isinstance(b1, Subagent)
    assert (b1.t, b1.duration_s, b1.end, b1.status, b1.background) == (
        11.5,
        None,
        None,
        "async_launched",
        True,
    )
    assert (b1.total_tokens, b1.tool_use_count) == (None, None)
    # Inner times 0.25 and 1.0 are relative to the spawn at 11.5.
    assert [r.t for r in b1.requests()] == [11.75, 12.5]
    assert r4.t == 21.0 and isinstance(r4.t, float)  # written as the integer 21
    assert r3.hash_ids == (1, 6)  # the reset keeps only the first block
    assert (s.system_tokens, s.tool_tokens) == (0, 0)


def inspect_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert run_cli("workload", "inspect", str(path), "--json") == 0
    return orjson.loads(capsys.readouterr().out)


def test_inspect_json_figures_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    got = inspect_json(DATA, capsys)
    approx = pytest.approx
    assert got["sessions"] == 2
    assert (got["requests"], got["parent_requests"], got["subagent_requests"]) == (12, 7, 5)
    assert (got["subagents"], got["background_subagents"]) == (3, 1)
    # in: joins 10 9 13 8 16 24, bg-reset 12 8 12 20 9 15; sorted 8 8 9 9 10 12 12 13 15 16 20 24
    assert got["input_tokens"] == {
        "mean": 13.0,
        "p50": 12.0,
        "p90": approx(19.6),
        "p99": approx(23.56),
        "max": 24,
    }
    # out: 2 1 2 1 3 1 | 4 2 1 4 2 1; sorted 1 1 1 1 1 2 2 2 2 3 4 4
    assert got["output_tokens"] == {
        "mean": 2.0,
        "p50": 2.0,
        "p90": approx(3.9),
        "p99": 4.0,
        "max": 4,
    }
    assert got["turns_per_session"] == {
        "mean": 3.5,
        "p50": 3.5,
        "p90": approx(3.9),
        "p99": approx(3.99),
        "max": 4,
    }
    # end-to-start gaps: joins parent 5-0-1=4, 7.5-5-2=0.5, a1 3-2-0.5=0.5;
    # bg-reset parent 13-10-1=2, 20-13-1=6, 21-20-0.5=0.5, b1 12.5-11.75-0.5=0.25
    assert got["pause_s"] == {
        "mean": approx(13.75 / 7),
        "p50": 0.5,
        "p90": approx(4.8),
        "p99": approx(5.88),
        "max": 6.0,
    }
    # leading seen blocks in start order: joins 0+0+2+2+2+4=10 (x4=40 of 80 tokens),
    # bg-reset 0+0+2+3+1+2=8 (x4=32 of 76 tokens)
    assert got["theoretical_cache_hit_ratio"] == approx(72 / 156)
    assert got["suffix_growth_ratio"] == approx(6 / 7)
    assert got["content_hash"] == load(DATA).content_hash


def test_directory_jsonl_and_gzip_give_the_same_sessions(tmp_path: Path) -> None:
    by_dir = load(DATA)
    assert [s.id for s in by_dir.sessions] == ["bg-reset-1", "join-1"]  # sorted file names
    lines = b"".join(
        orjson.dumps(orjson.loads((DATA / name).read_bytes())) + b"\n"
        for name in ("bg-reset.json", "joins.json")
    )
    (tmp_path / "both.jsonl").write_bytes(lines)
    (tmp_path / "both.jsonl.gz").write_bytes(gzip.compress(lines))
    assert load(tmp_path / "both.jsonl").content_hash == by_dir.content_hash
    assert load(tmp_path / "both.jsonl.gz", "agentx").content_hash == by_dir.content_hash
    shutil.copy(DATA / "joins.json", tmp_path / "one.json")
    assert load(tmp_path / "one.json").sessions == by_dir.sessions[1:]


def test_unknown_fields_warn_once_per_name(tmp_path: Path) -> None:
    doc = orjson.loads((DATA / "joins.json").read_bytes())
    doc["extra_session_field"] = 1
    for r in doc["requests"]:
        r["x_cost"] = 0.1
        r["x_note"] = "n"
    (tmp_path / "extra.json").write_bytes(orjson.dumps(doc))
    with pytest.warns(UserWarning) as record:
        wl = load(tmp_path / "extra.json")
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 3
    assert messages[0].endswith("session 'join-1': ignoring unknown field 'extra_session_field'")
    assert messages[1].endswith("session 'join-1': request 0: ignoring unknown field 'x_cost'")
    assert messages[2].endswith("session 'join-1': request 0: ignoring unknown field 'x_note'")
    assert wl.content_hash == load(DATA / "joins.json").content_hash


def test_unknown_field_warning_is_one_stderr_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = orjson.loads((DATA / "joins.json").read_bytes())
    doc["requests"][0]["x_cost"] = 1
    doc["requests"][3]["x_cost"] = 2
    (tmp_path / "extra.json").write_bytes(orjson.dumps(doc))
    assert run_cli("workload", "inspect", str(tmp_path / "extra.json")) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"agentab: warning: {tmp_path / 'extra.json'}: session 'join-1': request 0: "
        "ignoring unknown field 'x_cost'"
    ]


def test_a_frozen_load_leaves_the_workload_to_no_collection() -> None:
    """`freeze=True` (the commands whose workload lives as long as the process) moves what the
    load built to the collector's permanent generation; the default leaves the collector's
    state as it was. Either way the workload is the same and the collector is on again."""
    import gc

    path = DATA / "joins.json"
    assert gc.isenabled()
    before = gc.get_freeze_count()
    plain = load(path)
    assert gc.get_freeze_count() == before and gc.isenabled()
    try:
        frozen = load(path, freeze=True)
        assert gc.get_freeze_count() > before and gc.isenabled()
        assert frozen.content_hash == plain.content_hash
    finally:
        gc.unfreeze()  # give the test process's objects back to the collector

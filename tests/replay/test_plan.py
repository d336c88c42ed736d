"""Plan and runner timing on hand-built sessions, on the virtual clock: exact dispatch times.

RecordedTarget answers each request in its recorded `api_time` times `time_factor`, so every
expected send time below is worked out by hand from the rules in agentab/replay/plan.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from agentab.errors import AgentabError
from agentab.replay import ReplayOptions, run_to_dir
from agentab.replay.plan import build_plan, compile_tree
from agentab.replay.targets.recorded import RecordedTarget
from agentab.rundir import scan_records
from agentab.workloads.model import Request, Session, Subagent, Workload
from agentab.workloads.tokens import prompt_token_ids

BASE = {
    "start_window": (0.0, 0.0),
    "warmup_requests": 0,
    "duration_s": None,
    "passes": 1,
    "max_error_rate": 0.0,
}


def req(t: float, api: float | None, *, out: int = 4, n: int = 128, agent: str = "main") -> Request:
    kind = "parent" if agent == "main" else "subagent"
    return Request(
        t=t, in_tokens=n, out_tokens=out, hash_ids=(1, 2), api_time=api, kind=kind, agent_id=agent
    )


def run(
    tmp_path: Path,
    sessions: list[Session],
    *,
    factor: float = 1.0,
    name: str = "run",
    **opts: object,
) -> pl.DataFrame:
    options = ReplayOptions(**{**BASE, **opts})  # type: ignore[arg-type]
    run_dir = run_to_dir(
        Workload(tuple(sessions)),
        RecordedTarget(factor),
        replay=options,
        out_dir=tmp_path / name,
        virtual=True,
        progress=False,
    )
    return scan_records(run_dir).collect().sort("sent_s", "request_id")


def sent(df: pl.DataFrame, **where: object) -> list[float]:
    for k, v in where.items():
        df = df.filter(pl.col(k) == v)
    return [round(x, 9) for x in df["sent_s"].to_list()]


def test_end_to_start_delays(tmp_path: Path) -> None:
    s = Session("s", 64, (req(0, 2), req(5, 1), req(10, 3)))
    # Recorded speed: the recorded start times come back exactly.
    df = run(tmp_path, [s])
    assert sent(df) == [0.0, 5.0, 10.0]
    assert df["planned_s"].to_list() == df["sent_s"].to_list()  # no client lateness on virtual
    # A server twice as slow: each gap is kept after the (longer) previous response ends.
    df = run(tmp_path, [s], factor=2.0, name="slow")
    # r0 0..4, +3 -> r1 7..9, +4 -> r2 13
    assert sent(df) == [0.0, 7.0, 13.0]
    assert df["turn"].to_list() == [0, 1, 2]
    assert df["osl"].to_list() == [4, 4, 4]
    assert df["chunk_times_s"].to_list()[2] == pytest.approx([0.0, 2.0, 4.0, 6.0])


def test_missing_api_time_keeps_start_to_start_gap(tmp_path: Path) -> None:
    s = Session("s", 64, (req(0, None, out=1), req(5, 1)))
    df = run(tmp_path, [s])
    assert sent(df) == [0.0, 5.0]


def _join_session() -> Session:
    sub = Subagent(
        agent_id="sub1",
        t=2,
        duration_s=10,  # ends at 12
        items=(req(3, 2, agent="sub1"), req(6, 3, agent="sub1")),
    )
    # r1 at 4 runs beside the subagent; r2 at 15 is the first parent turn at/after 12: it joins.
    return Session("s", 64, (req(0, 1), sub, req(4, 1), req(15, 1)))


def test_join_keeps_recorded_residual_delay(tmp_path: Path) -> None:
    s = _join_session()
    df = run(tmp_path, [s])
    assert sent(df, agent_id="sub1") == [3.0, 6.0]
    assert sent(df, agent_id="main") == [0.0, 4.0, 15.0]  # 12 + residual 3, not 12
    df = run(tmp_path, [s], factor=2.0, name="slow")
    # r0 0..2; spawn 2+1=3; s0 3+1=4..8; s1 8+1=9..15; sub end 15+3=18; r1 2+3=5..7;
    # r2 after max(7, 18) + residual (15 - max(12, 5)) = 21.
    assert sent(df, agent_id="sub1") == [4.0, 9.0]
    assert sent(df, agent_id="main") == [0.0, 5.0, 21.0]


def test_join_structure() -> None:
    sched = compile_tree(_join_session())
    kinds = [(n.kind, n.agent_id, n.deps, n.delay_s) for n in sched.nodes]
    assert kinds == [
        ("request", "main", (), 0.0),
        ("spawn", "sub1", (0,), 1.0),
        ("request", "sub1", (1,), 1.0),
        ("request", "sub1", (2,), 1.0),
        ("request", "main", (0,), 3.0),
        ("end", "sub1", (3,), 3.0),
        ("request", "main", (4, 5), 3.0),
    ]


def test_background_subagent_runs_beside_and_holds_the_lane(tmp_path: Path) -> None:
    bg = Subagent(
        agent_id="bg",
        t=1,
        duration_s=None,
        status="async_launched",
        items=(req(2, 10, agent="bg"),),
    )
    s = Session("s", 64, (req(0, 1), bg, req(3, 1)))
    df = run(tmp_path, [s], passes=2)
    first = df.filter(pl.col("pass") == 0)
    assert sent(first, agent_id="bg") == [2.0]  # spawned 0 s after r0 ends at 1, then +1
    assert sent(first, agent_id="main") == [0.0, 3.0]  # r1 does not wait for it
    # The lane's next session starts when the whole tree drained: bg ends at 12.
    assert sent(df.filter(pl.col("pass") == 1), agent_id="main") == [12.0, 15.0]


def test_subagent_without_a_later_turn_is_background() -> None:
    late = Subagent(agent_id="late", t=1, duration_s=50, items=(req(2, 1, agent="late"),))
    sched = compile_tree(Session("s", 64, (req(0, 1), late, req(3, 1))))
    assert [n.kind for n in sched.nodes] == ["request", "spawn", "request", "request"]


def test_global_idle_compression_shifts_all_timers(tmp_path: Path) -> None:
    a = Session("a", 64, (req(0, 1), req(51, 1)))
    b = Session("b", 64, (req(0, 2), req(62, 1)))
    df = run(tmp_path, [a, b], concurrency=2, idle_cap_global_s=10, idle_cap_tree_s=0)
    # Idle from 2 with a1 due at 51 and b1 at 62: both move 39 s earlier (spacing kept);
    # after a1 (12..13) b1 is 10 s away, not more: it stays at 23.
    assert sent(df, session_id="a") == [0.0, 12.0]
    assert sent(df, session_id="b") == [0.0, 23.0]
    off = run(tmp_path, [a, b], name="off", concurrency=2, idle_cap_global_s=0, idle_cap_tree_s=0)
    assert sent(off, session_id="a") == [0.0, 51.0]
    assert sent(off, session_id="b") == [0.0, 62.0]


def test_tree_idle_compression_moves_only_that_tree(tmp_path: Path) -> None:
    a = Session("a", 64, (req(0, 1), req(501, 1)))
    b = Session("b", 64, (req(0, 600),))  # in flight all along: no global compression
    df = run(tmp_path, [a, b], concurrency=2, idle_cap_global_s=10, idle_cap_tree_s=300)
    assert sent(df, session_id="a") == [0.0, 301.0]  # idle from 1, capped at 300 s
    assert sent(df, session_id="b") == [0.0]
    assert df.filter(pl.col("session_id") == "b")["chunk_times_s"][0][-1] == pytest.approx(600)


def test_warmup_tagging_and_start_point(tmp_path: Path) -> None:
    early = Subagent(agent_id="early", t=5.5, duration_s=1, items=(req(5.6, 0.1, agent="early"),))
    items: list[Request | Subagent] = []
    for k in range(10):
        items.append(req(10.0 * k, 2, out=8))
        if k == 5:
            items.append(early)  # between warmup turns: not replayed
    s = Session("s", 64, tuple(items))
    df = run(tmp_path, [s], start_window=(0.5, 0.5), warmup_requests=2)
    # start point p = 5: turn 4 with its full output, turns 5 and 6 with max_tokens 1,
    # back to back; profiling from turn 7 with the recorded gaps.
    assert df["turn"].to_list() == [4, 5, 6, 7, 8, 9]
    assert df["phase"].to_list() == ["warmup"] * 3 + ["profiling"] * 3
    assert df["osl"].to_list() == [8, 1, 1, 8, 8, 8]
    assert "early" not in df["agent_id"].to_list()
    # turn 4: 0..2; turn 5: 2..2 (1 token at ttft 0); turn 6: 2..2; turn 7 +8 s = 10
    assert sent(df) == [0.0, 2.0, 2.0, 10.0, 20.0, 30.0]
    profiling = df.filter(pl.col("phase") == "profiling")
    assert profiling.height == 3
    manifest = (tmp_path / "run" / "manifest.json").read_text()
    assert '"warmup_requests": 3' in manifest


def test_start_points_sampled_in_window() -> None:
    s = Session("s", 64, tuple(req(10.0 * k, 1) for k in range(100)))
    plan = build_plan(Workload((s,)), ReplayOptions(concurrency=50, start_window=(0.25, 0.75)))
    assert all(25 <= p <= 75 for p in plan.start_turns)
    assert len(set(plan.start_turns)) > 10
    plan0 = build_plan(Workload((s,)), ReplayOptions(concurrency=3, start_window=(0, 0)))
    assert plan0.start_turns == (0, 0, 0)


def test_salts_distinct_across_lanes_and_passes_identical_across_arms(tmp_path: Path) -> None:
    sessions = [Session(f"s{i}", 64, (req(0, 1), req(2, 1))) for i in range(3)]
    wl = Workload(tuple(sessions))
    opts = ReplayOptions(concurrency=4, passes=3, seed=7)
    arm_a, arm_b = build_plan(wl, opts), build_plan(wl, opts)
    plays_a = [arm_a.closed_play(lane, p) for lane in range(4) for p in range(3)]
    plays_b = [arm_b.closed_play(lane, p) for lane in range(4) for p in range(3)]
    salts = [p.salt for p in plays_a if p]
    assert len(set(salts)) == 12  # 4 lanes x 3 passes, even where sessions repeat
    assert [(p.session.id, p.salt) for p in plays_a if p] == [
        (p.session.id, p.salt) for p in plays_b if p
    ]
    other = build_plan(wl, ReplayOptions(concurrency=4, passes=3, seed=8))
    assert other.closed_play(0, 0).salt != arm_a.closed_play(0, 0).salt  # type: ignore[union-attr]
    # Same session in two lanes: prompts never share a block (salt in the first ids).
    same = [p for p in plays_a if p and p.session.id == plays_a[0].session.id]  # type: ignore[union-attr]
    p1 = prompt_token_ids(same[0].session, same[0].session.items[0], salt=same[0].salt)
    p2 = prompt_token_ids(same[1].session, same[1].session.items[0], salt=same[1].salt)
    assert not np.array_equal(p1[:64], p2[:64])
    # Two arms at different speeds send the same requests in the same slots.
    fast = run(tmp_path, sessions, name="a", concurrency=4, passes=3, seed=7)
    slow = run(tmp_path, sessions, name="b", factor=3.0, concurrency=4, passes=3, seed=7)
    cols = ["request_id", "session_id", "lane", "pass", "turn", "osl"]
    assert fast.select(cols).sort("request_id").equals(slow.select(cols).sort("request_id"))
    assert fast.height == 4 * 3 * 2


def test_duration_and_max_requests_stop_dispatch(tmp_path: Path) -> None:
    s = Session("s", 64, tuple(req(10.0 * k, 1) for k in range(10)))
    df = run(tmp_path, [s], duration_s=35.0, passes=None)
    assert sent(df) == [0.0, 10.0, 20.0, 30.0]
    df = run(tmp_path, [s], name="m", max_requests=3, passes=None, duration_s=None)
    assert sent(df) == [0.0, 10.0, 20.0]


def test_duration_window_opens_when_the_last_warmup_request_ends(tmp_path: Path) -> None:
    def session(name: str, ttft: float) -> Session:
        turns = tuple(
            Request(
                t=10.0 * k, in_tokens=128, out_tokens=4, hash_ids=(1, 2), api_time=1.0, ttft=ttft
            )
            for k in range(10)
        )
        return Session(name, 64, turns)

    # Lane of "a": warmup turns 0 and 1 take 0.5 s each (ends at 1), profiling turn 2 after
    # the recorded 9 s gap: 10, 20, 30, ...; lane of "b": warmup ends at 6, its turns take 3 s
    # (the ttft): 15, 27, ... The 22 s window counts from 6 (the last warmup end), not from the
    # run start: [6, 28], so b's 27 is in it.
    df = run(
        tmp_path,
        [session("a", 0.5), session("b", 3.0)],
        concurrency=2,
        warmup_requests=2,
        duration_s=22.0,
        passes=None,
    )
    profiling = df.filter(pl.col("phase") == "profiling")
    assert sent(profiling, session_id="a") == [10.0, 20.0]
    assert sent(profiling, session_id="b") == [15.0, 27.0]
    assert sent(df.filter(pl.col("phase") == "warmup")) == [0.0, 0.0, 0.5, 3.0]
    stats = json.loads((tmp_path / "run" / "manifest.json").read_text())["stats"]
    assert stats["profiling_start_s"] == 6.0
    assert stats["stop_reason"] == "duration"
    # Without warmup the window opens at the run start.
    df = run(tmp_path, [session("a", 0.5)], name="cold", duration_s=20.0, passes=None)
    assert sent(df) == [0.0, 10.0, 20.0]
    stats = json.loads((tmp_path / "cold" / "manifest.json").read_text())["stats"]
    assert stats["profiling_start_s"] == 0.0


def test_open_loop_rate_and_time_scale(tmp_path: Path) -> None:
    sessions = [Session(f"s{i}", 64, (req(0, 1),), arrival_s=100.0 + 20 * i) for i in range(3)]
    df = run(tmp_path, sessions, time_scale=0.5, idle_cap_global_s=0)
    assert sent(df) == [0.0, 10.0, 20.0]
    assert df["lane"].to_list() == [0, 1, 2]
    df = run(tmp_path, sessions, name="rate", rate=2.0, passes=2, idle_cap_global_s=0)
    assert df.height == 6
    gaps = np.diff(df["sent_s"].to_numpy())
    assert (gaps >= 0).all() and gaps.sum() > 0


def test_no_stopping_rule_is_an_error() -> None:
    s = Session("s", 64, (req(0, 1),))
    opts = ReplayOptions(duration_s=None, passes=None)
    with pytest.raises(AgentabError, match="no stopping rule"):
        build_plan(Workload((s,)), opts)


def test_options_from_mapping_rejects_unknown_keys() -> None:
    with pytest.raises(AgentabError, match=r"unknown replay option.*bogus"):
        ReplayOptions.from_mapping({"concurrency": 2, "bogus": 1})
    opts = ReplayOptions.from_mapping({"start_window": [0, 0.5], "seed": 3})
    assert opts.start_window == (0.0, 0.5)
    assert ReplayOptions.from_mapping(opts.to_dict()) == opts
    with pytest.raises(AgentabError, match="concurrency"):
        ReplayOptions(concurrency=0)

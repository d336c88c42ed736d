"""The sweep recommendation: each point's class from its CI, segments, the crossover, the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.analysis.compare import BETTER, SAME, WITHHELD, WORSE, compare_runs
from agentab.analysis.frontier import point_verdict
from agentab.analysis.load import load_run
from agentab.analysis.recommend import PointVerdict, recommend
from agentab.errors import AgentabError
from agentab.experiments.sweep import guard_sweep

from .rundirs import manifest, synthetic_records, write_run


def test_better_then_not_significant_names_the_crossover() -> None:
    points = [
        PointVerdict(1, 1.36, 1.31, 1.38, BETTER),
        PointVerdict(16, 1.33, 1.32, 1.35, BETTER),
        PointVerdict(4, 1.34, 1.33, 1.36, BETTER),
        PointVerdict(32, 1.02, 0.97, 1.06, SAME),
        PointVerdict(64, 0.99, 0.95, 1.03, SAME),
    ]
    rec = recommend("concurrency", "latency_specialized", points)
    assert rec.line == (
        "latency_specialized raises P90 interactivity by 33-36% (intervals 31-38%) up to "
        "concurrency 16; "
        "from concurrency 32 on the difference is not significant"
    )
    assert rec.crossover == {"last_better": 16, "next": 32, "next_verdict": SAME}
    assert rec.worse_points == []
    assert [s["points"] for s in rec.segments] == [[1, 4, 16], [32, 64]]


def test_the_line_states_the_measured_effects_and_the_intervals_apart() -> None:
    points = [PointVerdict(2, 1.087, 1.03, 1.15, BETTER), PointVerdict(8, 1.696, 1.5, 1.86, BETTER)]
    rec = recommend("concurrency", "B", points)
    assert rec.line == "B raises P90 interactivity by 9-70% (intervals 3-86%) at every " + (
        "concurrency tested (2-8)"
    )


def test_significantly_worse_is_named_and_gates() -> None:
    points = [
        PointVerdict(1, 1.2, 1.1, 1.3, BETTER),
        PointVerdict(2, 1.0, 0.9, 1.1, SAME),
        PointVerdict(4, 0.8, 0.75, 0.85, WORSE),
        PointVerdict(8, 0.7, 0.6, 0.9, WORSE),
    ]
    rec = recommend("concurrency", "B", points)
    assert rec.line == (
        "B raises P90 interactivity by 20% (intervals 10-30%) up to concurrency 1; at "
        "concurrency 2 the difference is not significant; from concurrency 4 on it lowers P90 "
        "interactivity by 20-30% (intervals 10-40%)"
    )
    assert rec.worse_points == [4, 8]
    assert rec.to_json()["any_worse"] is True
    assert rec.crossover == {"last_better": 1, "next": 2, "next_verdict": SAME}


def test_no_verdict_is_neither_better_nor_worse() -> None:
    points = [
        PointVerdict(0.5, 0.8, 0.7, 0.9, WITHHELD, why="fewer than 2 runs per arm"),
        PointVerdict(1.0, 1.01, 0.98, 1.04, SAME),
    ]
    rec = recommend("rate", "fast", points)
    assert rec.line == (
        "there is no verdict (fewer than 2 runs per arm) up to rate 0.5; from rate 1 on the "
        "difference is not significant"
    )
    assert rec.worse_points == [] and rec.crossover is None
    one = recommend("concurrency", "fast", [PointVerdict(8, 1.5, 1.4, 1.6, BETTER)])
    assert one.line == "fast raises P90 interactivity by 50% (intervals 40-60%) at concurrency 8"
    assert one.crossover is None
    every = recommend(
        "concurrency", "fast", [PointVerdict(c, 1.0, 0.9, 1.1, SAME) for c in (1, 2, 4)]
    )
    assert every.line == "the difference is not significant at every concurrency tested (1-4)"


def _point(root: Path, point: int, scale: float, repeats: int, *, b_seed: int = 0, **b) -> tuple:
    a_runs, b_runs = [], []
    for k in range(repeats):
        common = {"repeat": k, "sweep_point": {"concurrency": point}, "replay__concurrency": point}
        a = manifest(seed=10 + k, **common)
        a_runs.append(write_run(root / f"c{point}/a/run-{k}", synthetic_records(10 + k), a))
        m = manifest(decode_backend="latency_specialized", arm="latency_specialized", **common, **b)
        records = synthetic_records(10 + k + b_seed, itl_scale=scale)
        b_runs.append(write_run(root / f"c{point}/b/run-{k}", records, m))
    return [load_run(p) for p in a_runs], [load_run(p) for p in b_runs]


@pytest.fixture(scope="module")
def hand_built(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple]:
    """Five points: B 0.7x and 0.8x the ITL of A (better), the same sessions drawn afresh
    (not significant), 1.25x (worse), and one run per arm of 160 requests (no verdict: too
    few runs and requests)."""
    root = tmp_path_factory.mktemp("sweep-runs")
    return {
        1: _point(root, 1, 0.7, 2),
        2: _point(root, 2, 0.8, 2),
        4: _point(root, 4, 1.0, 3, b_seed=100),
        8: _point(root, 8, 1.25, 2),
        16: _point(root, 16, 0.5, 1),
    }


def test_hand_built_runs_give_the_exact_recommendation(hand_built) -> None:
    verdicts = []
    for point, (a, b) in hand_built.items():
        comparison = compare_runs(a, b, resamples=400, seed=1)
        verdicts.append(point_verdict(point, comparison))
    by_point = {v.point: v for v in verdicts}
    # The same requests, only faster or slower: every resample and every repeat pair has
    # B/A = 1/scale exactly, so the CI is that number.
    assert by_point[1].ratio == pytest.approx(1 / 0.7) and by_point[1].verdict == BETTER
    assert by_point[1].ci_low == pytest.approx(1 / 0.7) == pytest.approx(by_point[1].ci_high)
    assert by_point[2].ci_low == pytest.approx(1.25) and by_point[2].verdict == BETTER
    assert by_point[4].verdict == SAME and by_point[4].ci_low < 1 < by_point[4].ci_high
    assert by_point[8].ci_high == pytest.approx(0.8) and by_point[8].verdict == WORSE
    assert by_point[16].verdict == WITHHELD and by_point[16].ratio == pytest.approx(2.0)
    rec = recommend("concurrency", "latency_specialized", verdicts)
    assert rec.line == (
        "latency_specialized raises P90 interactivity by 25-43% (intervals 25-43%) up to "
        "concurrency 2; at concurrency 4 the difference is not significant; at concurrency 8 it "
        "lowers P90 interactivity by 20% (intervals 20-20%); from concurrency 16 on there is no "
        "verdict (fewer than 2 "
        "runs per arm; fewer than 200 requests with an ITL per arm)"
    )
    assert rec.crossover == {"last_better": 2, "next": 4, "next_verdict": SAME}
    assert rec.worse_points == [8]


def test_the_guard_refuses_the_sweep_as_a_whole(hand_built, tmp_path: Path) -> None:
    guard_sweep("concurrency", hand_built)  # only the swept option differs between points
    confounded = dict(hand_built)
    confounded[32] = _point(tmp_path, 32, 0.7, 2, gpu_name="H200")
    with pytest.raises(AgentabError, match=r"refusing the sweep as a whole: .*gpu_name"):
        guard_sweep("concurrency", confounded)

"""The planner: its arithmetic, and its promise checked against a simulated ground truth (the
repeats it prescribes find the effect about as often as the power it states)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from agentab.analysis.compare import compare_runs
from agentab.analysis.intervals import t_quantile
from agentab.analysis.load import load_run
from agentab.analysis.power import Pilot, plan, plan_row, standard_error

from .rundirs import manifest, rec, write_run


def _pilot(repeat_variance: float, run_variance: float = 0.0) -> Pilot:
    return Pilot(repeat_variance, run_variance, 900.0, 3, 20.0, 500.0)


def test_repeats_follow_the_t_test_formula() -> None:
    # s = sqrt(1e-3) per repeat; R repeats detect (t_(R-1,.975) + t_(R-1,.8)) s / sqrt(R):
    # R = 5: (2.776 + 0.941) 0.0316 / 2.236 = 0.0526 > ln 1.05 = 0.0488; R = 6: 0.0450 -> 6
    row = plan_row(_pilot(1e-3), 900.0, 0.05, 0.8, 0.95)
    assert row.repeats == 6 and row.limited_by == "effect"
    t = t_quantile(0.975, 5) + t_quantile(0.8, 5)
    assert row.detectable == pytest.approx(math.expm1(t * math.sqrt(1e-3 / 6)), rel=1e-9)
    assert row.arm_seconds == 5400.0
    # twice the window halves the sampling variance: 4 repeats
    assert plan_row(_pilot(1e-3), 1800.0, 0.05, 0.8, 0.95).repeats == 4
    # run-level variance does not shrink with the window
    assert standard_error(_pilot(0.0, 1e-3), 3600.0, 4) == pytest.approx(math.sqrt(1e-3 / 4))


def test_the_minimum_sample_binds_on_short_windows() -> None:
    # per 900 s repeat 20 sessions and 500 requests: a 90 s window gives 2 sessions and 50
    # requests, so 10 sessions need 5 repeats (200 requests would need 4)
    row = plan_row(_pilot(1e-6), 90.0, 0.05, 0.8, 0.95)
    assert row.repeats == 5 and row.limited_by == "minimum sample"


def test_unreachable_effects_say_why() -> None:
    rows = plan(_pilot(1e-4, 0.5), 0.01, windows=[900.0])
    assert rows[0].repeats is None and rows[0].limited_by == "run-level noise"
    with pytest.raises(ValueError):
        plan_row(_pilot(1e-4), 900.0, 0.0, 0.8, 0.95)


def _arm_runs(root: Path, seed: int, repeats: int, effect: float, noise: tuple) -> tuple:
    """Paired runs with a known effect: per repeat k one plan (replay seed k), each arm's ITLs
    = the request's base ITL x a run factor x per-request noise; B's divided by 1 + effect."""
    run_sd, request_sd = noise
    rng = np.random.default_rng(seed)
    arms: dict[str, list[Path]] = {"a": [], "b": []}
    for k in range(repeats):
        base = rng.lognormal(-4.0, 0.4, size=(12, 25))  # 12 sessions x 25 requests
        for arm, scale in (("a", 1.0), ("b", 1.0 / (1.0 + effect))):
            run_factor = math.exp(run_sd * rng.standard_normal())
            itl = base * scale * run_factor * np.exp(request_sd * rng.standard_normal(base.shape))
            records = [
                rec(
                    f"L{s}-P0-N{i}",
                    session_id=f"s{s:02d}",
                    chunk_times_s=[0.05 + j * float(itl[s, i]) for j in range(5)],
                    chunk_tokens=[1] * 5,
                    completion_tokens=5,
                )
                for s in range(12)
                for i in range(25)
            ]
            changes = {"repeat": k, "replay__seed": k}
            if arm == "b":
                changes.update(decode_backend="latency_specialized", arm="latency_specialized")
            arms[arm].append(write_run(root / f"{seed}-{arm}-{k}", records, manifest(**changes)))
    return arms["a"], arms["b"]


@pytest.mark.slow
def test_prescribed_repeats_reach_the_promised_power(tmp_path: Path) -> None:
    noise = (0.02, 0.05)  # run-level and per-request log sigmas
    effect = 0.04
    pilot_a, pilot_b = _arm_runs(tmp_path / "pilot", 1, 3, effect, noise)
    pilot_cmp = compare_runs(
        [load_run(p) for p in pilot_a], [load_run(p) for p in pilot_b], resamples=500, seed=1
    )
    pilot = Pilot.from_comparison(pilot_cmp, "p90_interactivity_tok_s")
    row = plan_row(pilot, pilot.window_s, effect, 0.8, 0.95)
    assert row.repeats is not None and 2 <= row.repeats <= 12
    found = 0
    trials = 40
    for t in range(trials):
        a, b = _arm_runs(tmp_path / f"t{t}", 100 + t, row.repeats, effect, noise)
        result = compare_runs(
            [load_run(p) for p in a], [load_run(p) for p in b], resamples=500, seed=t
        )
        found += result.metrics["p90_interactivity_tok_s"].verdict == "better"
    # 80% promised; 40 trials give a binomial sd of 6.3%: accept 0.6-1.0 (3 sd below)
    assert 0.6 <= found / trials <= 1.0, (row, found)
    print(f"prescribed {row.repeats} repeats, found {found}/{trials}")

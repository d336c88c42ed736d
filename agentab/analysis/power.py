"""How long to run: the repeats and window an A/B needs to detect a given effect.

The paired design's interval is Student t over the repeats' log ratios (`intervals.py`), each
with variance

    s^2 = v * T0 / T + tau^2

for a window of T seconds, where v is one repeat's sampling variance measured over a pilot
window T0 (it falls as the window, and so the number of requests, grows) and tau^2 the
run-level variance (it does not). Both come from a comparison (`MetricResult.repeat_variance`,
`run_variance`): a pilot run, earlier runs of the same experiment, or a simulated pilot on a
calibrated profile with timing noise. A two-sided t test at level alpha over R repeats finds a
change e with the stated power when

    (t_(R-1, 1-alpha/2) + t_(R-1, power)) * s / sqrt(R) <= log(1 + e)

so the repeats needed are the smallest R >= 2 that satisfy it, also meeting the minimum sample
(sessions and measured requests, scaled from the pilot). `plan` gives them for each window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentab.analysis.compare import Comparison
from agentab.analysis.intervals import detectable_change
from agentab.analysis.sample import MIN_REQUESTS, MIN_RUNS, MIN_SESSIONS

MAX_PLANNED_REPEATS = 200


@dataclass(frozen=True)
class Pilot:
    """What a plan needs from earlier runs: variances per repeat, the window, the sample."""

    repeat_variance: float  # sampling variance of one repeat's log(B/A) at `window_s`
    run_variance: float  # run-level variance of one repeat's log(B/A)
    window_s: float
    repeats: int
    sessions_per_repeat: float
    requests_per_repeat: float
    observed_ratio: float | None = None

    @classmethod
    def from_comparison(cls, comparison: Comparison, metric: str) -> Pilot:
        r = comparison.metrics[metric]
        if comparison.repeat_pairing != "paired" or r.repeat_variance is None:
            raise ValueError(
                "a plan needs a paired pilot: at least two repeats per arm, repeat k of both "
                "arms replaying one plan (as `agentab ab` runs them)"
            )
        replay = comparison.runs_a[0].run.manifest.get("replay") or {}
        window = replay.get("duration_s")
        if not isinstance(window, int | float) or window <= 0:
            raise ValueError("a plan needs runs with a profiling window (replay duration_s)")
        repeats = len(comparison.runs_a)
        size = min(comparison.size_a, comparison.size_b, key=lambda s: s.itl_requests)
        return cls(
            repeat_variance=r.repeat_variance,
            run_variance=r.run_variance or 0.0,
            window_s=float(window),
            repeats=repeats,
            sessions_per_repeat=size.sessions / repeats,
            requests_per_repeat=size.itl_requests / repeats,
            observed_ratio=r.ratio,
        )


@dataclass(frozen=True)
class PlanRow:
    """The design for one window: repeats per arm, the change it detects, the time it takes."""

    window_s: float
    repeats: int | None  # None: not reachable within MAX_PLANNED_REPEATS
    detectable: float  # the change R repeats detect with the power asked (fraction)
    arm_seconds: float | None  # measured window time per arm (repeats x window)
    limited_by: str  # "effect", "minimum sample" or "run-level noise"

    def to_json(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "repeats": self.repeats,
            "detectable_change": self.detectable,
            "measured_seconds_per_arm": self.arm_seconds,
            "limited_by": self.limited_by,
        }


def repeat_sd(pilot: Pilot, window_s: float) -> float:
    """sd of one repeat's log(B/A) for a window of `window_s` (module docstring)."""
    per_repeat = pilot.repeat_variance * pilot.window_s / window_s + pilot.run_variance
    return math.sqrt(max(per_repeat, 0.0))


def standard_error(pilot: Pilot, window_s: float, repeats: int) -> float:
    """se of log(B/A) for `repeats` repeats of `window_s`."""
    return repeat_sd(pilot, window_s) / math.sqrt(repeats)


def detectable(
    pilot: Pilot, window_s: float, repeats: int, power: float, confidence: float
) -> float:
    return detectable_change(
        standard_error(pilot, window_s, repeats), confidence, power, df=repeats - 1
    )


def plan_row(
    pilot: Pilot, window_s: float, effect: float, power: float, confidence: float
) -> PlanRow:
    """The fewest repeats of `window_s` that detect `effect` with `power`."""
    if effect <= 0:
        raise ValueError("effect must be > 0 (a fraction: 0.05 is 5%)")
    target = math.log1p(effect)
    repeats = None
    for r in range(MIN_RUNS, MAX_PLANNED_REPEATS + 1):
        if math.log1p(detectable(pilot, window_s, r, power, confidence)) <= target:
            repeats = r
            break
    if repeats is None:
        floor_only = Pilot(0.0, pilot.run_variance, pilot.window_s, 1, 1.0, 1.0)
        reach = detectable(floor_only, window_s, MAX_PLANNED_REPEATS, power, confidence)
        why = "run-level noise" if math.log1p(reach) > target / 2 else "effect"
        return PlanRow(window_s, None, math.nan, None, why)
    limited = "effect" if repeats > MIN_RUNS else "minimum sample"
    scale = window_s / pilot.window_s
    for floor, per in (
        (MIN_SESSIONS, pilot.sessions_per_repeat * scale),
        (MIN_REQUESTS, pilot.requests_per_repeat * scale),
    ):
        if per > 0 and repeats * per < floor:
            repeats = math.ceil(floor / per)
            limited = "minimum sample"
    return PlanRow(
        window_s,
        repeats,
        detectable(pilot, window_s, repeats, power, confidence),
        repeats * window_s,
        limited,
    )


def plan(
    pilot: Pilot,
    effect: float,
    *,
    windows: Sequence[float] | None = None,
    power: float = 0.80,
    confidence: float = 0.95,
) -> list[PlanRow]:
    """One row per window (default: the pilot's window, half, twice and four times it)."""
    if not 0.0 < power < 1.0:
        raise ValueError("power must be between 0 and 1")
    chosen = windows or [pilot.window_s * f for f in (0.5, 1.0, 2.0, 4.0)]
    return [plan_row(pilot, float(w), effect, power, confidence) for w in chosen]

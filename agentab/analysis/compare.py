"""Compare arm B against arm A: the guard, pooled metrics, bootstrap CIs of B/A, verdicts.

The statistics, in one place:
- Point estimates pool each arm's repeats (see `sample.py`).
- The CI of each ratio B/A is a percentile bootstrap over sessions, paired: one resample draws
  session ids with replacement from every session either arm played, and the same draw weighs
  both arms, because both arms replayed the same workload (same sessions) and pairing removes
  the between-session variance from the ratio. 10,000 resamples, seeded, 95% by default.
- Run-level interval: with two or more runs per arm, a Student t interval of B/A from the
  per-run values (paired by repeat when both arms ran the same repeats, else Welch), because
  sessions of one run share that run's load and the session bootstrap cannot see run-to-run
  noise (see `intervals.py` for the A/A measurements that showed it). The reported CI is the
  envelope of the two; with one run per arm it is the session CI alone, and the report says so.
- Verdict at that level: the CI entirely above 1 means B is higher, entirely below means lower;
  whether higher is "better" depends on the metric (latencies and error rate: lower is better).
  A CI that contains 1 is "no significant difference".
- No verdict at all (`sample.py`'s `withheld_because`) with fewer than two runs per arm, since
  then nothing measures run-to-run noise, or below the minimum sample of MIN_SESSIONS sessions
  and MIN_REQUESTS measured requests per arm; the interval is still shown.
- Beside it, the run-to-run spread: the metric's value in each run and the B/A ratio of each
  repeat pair, so timing noise between runs is visible next to the sampling CI.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentab.analysis.bootstrap import batches, percentile_ci, resample_weights, work_per_row
from agentab.analysis.guard import (
    Difference,
    check,
    manifest_differences,
    noted_differences,
)
from agentab.analysis.intervals import repeat_ratio_interval
from agentab.analysis.load import Run
from agentab.analysis.sample import (
    METRICS,
    ArmSample,
    Metric,
    SampleSize,
    build_sample,
    sample_size,
    session_index,
    withheld_because,
)
from agentab.analysis.status import require_completed
from agentab.analysis.summary import RunSummary, summarize_run

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95
BETTER, WORSE, SAME, UNDEFINED = "better", "worse", "no significant difference", "n/a"
WITHHELD = "no verdict"


@dataclass(frozen=True)
class MetricResult:
    """One metric of the comparison (the `metrics` entries of `compare --json`)."""

    metric: Metric
    a: float | None
    b: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str
    runs_a: list[float | None]
    runs_b: list[float | None]
    pair_ratios: list[float | None]
    ci_sessions: tuple[float, float] | None = None
    ci_repeats: tuple[float, float] | None = None
    n_a: int = 0  # requests of arm A that enter this metric
    n_b: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "n_a": self.n_a,
            "n_b": self.n_b,
            "ratio": self.ratio,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "verdict": self.verdict,
            "ci_sessions": None if self.ci_sessions is None else list(self.ci_sessions),
            "ci_repeats": None if self.ci_repeats is None else list(self.ci_repeats),
            "higher_is_better": self.metric.higher_is_better,
            "unit": self.metric.unit,
            "label": self.metric.label,
            "runs_a": self.runs_a,
            "runs_b": self.runs_b,
            "repeat_ratios": self.pair_ratios,
        }


@dataclass
class Comparison:
    """Everything the reports show: which runs, what the guard found, each metric's result."""

    arm_a: str
    arm_b: str
    runs_a: list[RunSummary]
    runs_b: list[RunSummary]
    differences: list[Difference]
    confounded_by: list[str]
    notes: list[Difference]
    metrics: dict[str, MetricResult]
    repeat_pairing: str  # "paired" (by repeat), "welch", or "none" (one run on a side)
    resamples: int
    seed: int
    confidence: float
    sessions: int
    size_a: SampleSize
    size_b: SampleSize
    withheld: list[str] = field(default_factory=list)  # why no metric has a verdict
    incomplete: list[str] = field(default_factory=list)  # unfinished runs (--allow-incomplete)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "arms": {"a": self.arm_a, "b": self.arm_b},
            "confounded_by": self.confounded_by,
            "incomplete_runs": self.incomplete,
            "guard": [d.to_json() for d in self.differences],
            "not_compared_but_different": [d.to_json() for d in self.notes],
            "metrics": {name: r.to_json() for name, r in self.metrics.items()},
            "bootstrap": {
                "resamples": self.resamples,
                "seed": self.seed,
                "confidence": self.confidence,
                "unit": "session",
                "paired": True,
                "sessions": self.sessions,
            },
            "repeat_interval": self.repeat_pairing,
            "sample": {"a": self.size_a.to_json(), "b": self.size_b.to_json()},
            "verdict_withheld": self.withheld,
            "runs": {
                "a": [str(s.run.path) for s in self.runs_a],
                "b": [str(s.run.path) for s in self.runs_b],
            },
            **self.extra,
        }


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _lookup(values: dict[str, Any], name: str) -> float | None:
    head, _, tail = name.partition(".")
    value = values.get(head)
    if tail:
        value = value.get(tail) if isinstance(value, dict) else None
    return _finite(value) if isinstance(value, int | float) else None


def verdict(metric: Metric, ci_low: float | None, ci_high: float | None) -> str:
    """better / worse / no significant difference, from where the CI of B/A lies against 1."""
    if ci_low is None or ci_high is None:
        return UNDEFINED
    if ci_low > 1.0:
        return BETTER if metric.higher_is_better else WORSE
    if ci_high < 1.0:
        return WORSE if metric.higher_is_better else BETTER
    return SAME


def bootstrap_ratios(
    a: ArmSample, b: ArmSample, sessions: int, *, resamples: int, seed: int, paired: bool = True
) -> dict[str, np.ndarray]:
    """B/A of every metric for each of `resamples` paired session resamples."""
    rng = np.random.default_rng(seed)
    n_max = max(len(v) for s in (a, b) for v in s.values.values())
    per_row = 2 * work_per_row(n_max, sessions, 4)
    chunks: dict[str, list[np.ndarray]] = {m.name: [] for m in METRICS}
    for rows in batches(resamples, per_row):
        weights = resample_weights(rng, rows, sessions)
        wb = weights if paired else resample_weights(rng, rows, sessions)
        va, vb = a.evaluate(weights), b.evaluate(wb)
        for m in METRICS:
            with np.errstate(divide="ignore", invalid="ignore"):
                chunks[m.name].append(vb[m.name] / va[m.name])
    return {name: np.concatenate(parts) for name, parts in chunks.items()}


def compare_summaries(
    runs_a: Sequence[RunSummary],
    runs_b: Sequence[RunSummary],
    *,
    allow_diff: Iterable[str] = (),
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
) -> Comparison:
    """Guard, then pool, bootstrap and judge every metric of METRICS."""
    allow = tuple(allow_diff)
    manifests_a = [s.run.manifest for s in runs_a]
    manifests_b = [s.run.manifest for s in runs_b]
    differences = manifest_differences(manifests_a, manifests_b, allow)
    confounded = check(differences, allow)
    index = session_index(runs_a, runs_b)
    arm_a, arm_b = _arm_name(runs_a), _arm_name(runs_b)
    if arm_a == arm_b:  # an A/A comparison: keep the two sides apart in the report
        arm_a, arm_b = f"{arm_a} (A)", f"{arm_b} (B)"
    sample_a = build_sample(arm_a, runs_a, index)
    sample_b = build_sample(arm_b, runs_b, index)
    ones = np.ones((1, index.height), dtype=np.int64)
    point_a, point_b = sample_a.evaluate(ones), sample_b.evaluate(ones)
    ratios = bootstrap_ratios(sample_a, sample_b, index.height, resamples=resamples, seed=seed)
    pairing, runs_a, runs_b = repeat_pairing(runs_a, runs_b)
    size_a, size_b = sample_size(runs_a, sample_a), sample_size(runs_b, sample_b)
    withheld = withheld_because(size_a, size_b)
    results = {}
    for m in METRICS:
        a, b = _finite(point_a[m.name][0]), _finite(point_b[m.name][0])
        ratio = b / a if a and b is not None else None
        runs_a_values = [_lookup(s.values, m.name) for s in runs_a]
        runs_b_values = [_lookup(s.values, m.name) for s in runs_b]
        pairs = [
            (vb / va) if va and vb is not None else None
            for va, vb in zip(runs_a_values, runs_b_values, strict=False)
        ]
        lo, hi = (_finite(x) for x in percentile_ci(ratios[m.name], confidence))
        ci_sessions = (lo, hi) if ratio is not None and lo is not None and hi is not None else None
        ci_repeats = None
        if pairing != "none" and ratio is not None:
            ci_repeats = repeat_ratio_interval(
                runs_a_values, runs_b_values, paired=pairing == "paired", confidence=confidence
            )
        bounds = [ci for ci in (ci_sessions, ci_repeats) if ci is not None]
        low = min(ci[0] for ci in bounds) if bounds else None
        high = max(ci[1] for ci in bounds) if bounds else None
        judged = verdict(m, low, high)
        results[m.name] = MetricResult(
            m,
            a,
            b,
            ratio,
            low,
            high,
            WITHHELD if withheld and judged != UNDEFINED else judged,
            runs_a_values,
            runs_b_values,
            pairs,
            ci_sessions,
            ci_repeats,
            sample_a.count(m),
            sample_b.count(m),
        )
    return Comparison(
        arm_a=arm_a,
        arm_b=arm_b,
        runs_a=list(runs_a),
        runs_b=list(runs_b),
        differences=differences,
        confounded_by=confounded,
        notes=noted_differences(manifests_a, manifests_b),
        metrics=results,
        repeat_pairing=pairing,
        resamples=resamples,
        seed=seed,
        confidence=confidence,
        sessions=index.height,
        size_a=size_a,
        size_b=size_b,
        withheld=withheld,
    )


def repeat_pairing(
    runs_a: Sequence[RunSummary], runs_b: Sequence[RunSummary]
) -> tuple[str, list[RunSummary], list[RunSummary]]:
    """How per-run values enter the run-level interval: by repeat, unpaired, or not at all.

    Paired when both arms ran the same distinct repeat numbers (an `ab` experiment: repeat k of
    both arms used the same seed); the runs are then returned in repeat order on both sides.
    """
    runs_a, runs_b = list(runs_a), list(runs_b)
    if len(runs_a) < 2 or len(runs_b) < 2:
        return "none", runs_a, runs_b
    rep_a = [str(s.run.manifest.get("repeat")) for s in runs_a]
    rep_b = [str(s.run.manifest.get("repeat")) for s in runs_b]
    if "None" in rep_a or sorted(rep_a) != sorted(rep_b) or len(set(rep_a)) != len(rep_a):
        return "welch", runs_a, runs_b
    order = sorted(range(len(rep_a)), key=lambda i: rep_a[i])
    order_b = sorted(range(len(rep_b)), key=lambda i: rep_b[i])
    return "paired", [runs_a[i] for i in order], [runs_b[i] for i in order_b]


def _arm_name(runs: Sequence[RunSummary]) -> str:
    names = sorted({s.run.arm for s in runs})
    return names[0] if len(names) == 1 else "+".join(names)


def compare_runs(
    runs_a: Sequence[Run],
    runs_b: Sequence[Run],
    *,
    allow_diff: Iterable[str] = (),
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    allow_incomplete: bool = False,
) -> Comparison:
    """Refuse unfinished runs and confounded ones on the manifests first (cheap), then
    summarize every run and compare."""
    allow = tuple(allow_diff)
    incomplete = require_completed(
        [(r.path, r.manifest) for r in (*runs_a, *runs_b)], allow_incomplete
    )
    check(
        manifest_differences([r.manifest for r in runs_a], [r.manifest for r in runs_b], allow),
        allow,
    )
    comparison = compare_summaries(
        [summarize_run(r) for r in runs_a],
        [summarize_run(r) for r in runs_b],
        allow_diff=allow,
        resamples=resamples,
        seed=seed,
        confidence=confidence,
    )
    comparison.incomplete = incomplete
    return comparison

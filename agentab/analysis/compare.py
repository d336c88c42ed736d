"""Compare arm B against arm A: the guard, pooled metrics, intervals of B/A, verdicts.

The statistics, in one place (docs/analysis.md, "How sure a verdict is"):
- Point estimates pool each arm's repeats (see `sample.py`).
- Paired design (an `ab` experiment: both arms ran the same repeats, repeat k of both arms
  replayed one plan): the per-request metrics compare the requests both arms of each repeat
  completed (`matching.py`); throughputs and the error rate keep every request.
- The interval of each ratio B/A is the paired Student t interval over the repeats' B/A
  (`intervals.paired_interval`), never narrower than a percentile bootstrap over sessions,
  paired: one resample draws session ids with replacement from every session either arm
  played, and the same draw weighs both arms in every repeat. With one run per arm there is
  no interval, and no verdict.
- Runs that did not replay one plan in pairs (`compare` of arbitrary run sets with two or more
  runs a side): the envelope of the session bootstrap and Welch's t interval over the per-run
  values.
- Verdict: the interval entirely above 1 means B is higher, entirely below means lower; whether
  higher is "better" depends on the metric (latencies and error rate: lower is better). An
  interval inside the equivalence margin (default +-3%) is "equivalent"; any other interval
  that contains 1 is "no significant difference".
- Every interval comes with the smallest change it could detect at 80% power (`detectable`):
  how large an effect the comparison could have seen, whatever the verdict.
- No verdict at all (`sample.py`'s `withheld_because`) below the minimum sample.
- Beside it, the run-to-run spread: each repeat's value per arm and each repeat pair's B/A.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentab.analysis.bootstrap import batches, percentile_ci, resample_weights, work_per_row
from agentab.analysis.breakdown import breakdowns
from agentab.analysis.guard import (
    Difference,
    check,
    manifest_differences,
    noted_differences,
)
from agentab.analysis.intervals import (
    DETECT_POWER,
    detectable_change,
    paired_interval,
    repeat_ratio_interval,
    z_quantile,
)
from agentab.analysis.load import Run
from agentab.analysis.matching import Matching, match_requests
from agentab.analysis.sample import (
    METRICS,
    PER_REQUEST,
    ArmSample,
    Metric,
    SampleSize,
    build_sample,
    metrics_for,
    sample_size,
    session_index,
    withheld_because,
)
from agentab.analysis.slo import Slo
from agentab.analysis.status import require_completed
from agentab.analysis.summary import RunSummary, summarize_run

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95
DEFAULT_EQUIVALENCE_MARGIN = 0.03
REPEAT_RESAMPLES = 2_000
"""Resamples of each repeat alone: only their variance enters the run-level estimate."""
BETTER, WORSE, SAME, UNDEFINED = "better", "worse", "no significant difference", "n/a"
EQUIVALENT = "equivalent"
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
    detectable: float | None = None  # +- change of B/A found with 80% power (a fraction)
    run_variance: float | None = None  # run-level variance of a repeat's log ratio
    repeat_variance: float | None = None  # one repeat's sampling variance of log(B/A) (mean)

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
            "detectable_change": self.detectable,
            "detectable_power": DETECT_POWER,
            "ci_sessions": None if self.ci_sessions is None else list(self.ci_sessions),
            "ci_repeats": None if self.ci_repeats is None else list(self.ci_repeats),
            "run_variance": self.run_variance,
            "repeat_variance": self.repeat_variance,
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
    matching: Matching | None = None  # paired design: the requests both arms completed
    equivalence_margin: float = DEFAULT_EQUIVALENCE_MARGIN
    slo: Slo | None = None  # the objectives goodput counts against (none: no goodput rows)
    # per context-length and turn bucket, both arms over the latency metrics' requests
    breakdowns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
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
            "matched_requests": None if self.matching is None else self.matching.to_json(),
            "equivalence_margin": self.equivalence_margin,
            "slo": None
            if self.slo is None
            else {
                "terms": self.slo.terms(),
                "limits_s": self.slo.limits(),
            },
            "sample": {"a": self.size_a.to_json(), "b": self.size_b.to_json()},
            "breakdowns": self.breakdowns,
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


def verdict(
    metric: Metric, ci_low: float | None, ci_high: float | None, margin: float = 0.0
) -> str:
    """better / worse when the CI of B/A excludes 1; equivalent when it lies inside
    [1/(1+margin), 1+margin]; else no significant difference."""
    if ci_low is None or ci_high is None:
        return UNDEFINED
    if ci_low > 1.0:
        return BETTER if metric.higher_is_better else WORSE
    if ci_high < 1.0:
        return WORSE if metric.higher_is_better else BETTER
    if margin > 0.0 and ci_low >= 1.0 / (1.0 + margin) and ci_high <= 1.0 + margin:
        return EQUIVALENT
    return SAME


@dataclass
class PairedSamples:
    """Both arms' samples for one population: pooled, and (paired designs) each repeat."""

    a: ArmSample
    b: ArmSample
    repeats: list[tuple[ArmSample, ArmSample]] = field(default_factory=list)


def _log_ratio(va: np.ndarray, vb: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(vb) - np.log(va)


def bootstrap_log_ratios(
    populations: dict[str, PairedSamples],
    sessions: int,
    *,
    resamples: int,
    seed: int,
    repeat_resamples: int = REPEAT_RESAMPLES,
    metrics: Sequence[Metric] = METRICS,
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, list[dict[str, np.ndarray]]]]:
    """log(B/A) of every metric for each paired session resample, per population, and the same
    for each repeat alone over the first `repeat_resamples` resamples (their variance is all
    the run-level estimate needs)."""
    rng = np.random.default_rng(seed)
    n_max = max(
        len(v)
        for sides in populations.values()
        for s in (sides.a, sides.b)
        for v in s.values.values()
    )
    per_row = 2 * len(populations) * work_per_row(n_max, sessions, 4)
    pooled: dict[str, dict[str, list[np.ndarray]]] = {
        key: {m.name: [] for m in metrics} for key in populations
    }
    per_repeat: dict[str, list[dict[str, list[np.ndarray]]]] = {
        key: [{m.name: [] for m in metrics} for _ in sides.repeats]
        for key, sides in populations.items()
    }
    done = 0
    for rows in batches(resamples, per_row):
        weights = resample_weights(rng, rows, sessions)
        for key, sides in populations.items():
            va, vb = sides.a.evaluate(weights), sides.b.evaluate(weights)
            for m in metrics:
                pooled[key][m.name].append(_log_ratio(va[m.name], vb[m.name]))
            take = min(rows, repeat_resamples - done)
            if take <= 0:
                continue
            w = weights[:take]
            for k, (ra, rb) in enumerate(sides.repeats):
                ea, eb = ra.evaluate(w), rb.evaluate(w)
                for m in metrics:
                    per_repeat[key][k][m.name].append(_log_ratio(ea[m.name], eb[m.name]))
        done += rows
    return (
        {k: {m: np.concatenate(v) for m, v in d.items()} for k, d in pooled.items()},
        {
            k: [{m: np.concatenate(v) for m, v in d.items()} for d in reps]
            for k, reps in per_repeat.items()
        },
    )


def bootstrap_ratios(
    a: ArmSample, b: ArmSample, sessions: int, *, resamples: int, seed: int
) -> dict[str, np.ndarray]:
    """B/A of every metric for each of `resamples` paired session resamples."""
    pooled, _ = bootstrap_log_ratios(
        {"all": PairedSamples(a, b)}, sessions, resamples=resamples, seed=seed
    )
    return {name: np.exp(logs) for name, logs in pooled["all"].items()}


def _repeat_variance(logs: np.ndarray) -> float:
    finite = logs[np.isfinite(logs)]
    return float(finite.var(ddof=1)) if finite.size >= 20 else math.nan


def compare_summaries(
    runs_a: Sequence[RunSummary],
    runs_b: Sequence[RunSummary],
    *,
    allow_diff: Iterable[str] = (),
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    equivalence_margin: float = DEFAULT_EQUIVALENCE_MARGIN,
    slo: Slo | None = None,
) -> Comparison:
    """Guard, then pool, bootstrap and judge every metric of METRICS (and goodput against
    `slo`, when given)."""
    metrics = metrics_for(slo)
    allow = tuple(allow_diff)
    manifests_a = [s.run.manifest for s in runs_a]
    manifests_b = [s.run.manifest for s in runs_b]
    differences = manifest_differences(manifests_a, manifests_b, allow)
    confounded = check(differences, allow)
    index = session_index(runs_a, runs_b)
    arm_a, arm_b = _arm_name(runs_a), _arm_name(runs_b)
    if arm_a == arm_b:  # an A/A comparison: keep the two sides apart in the report
        arm_a, arm_b = f"{arm_a} (A)", f"{arm_b} (B)"
    pairing, runs_a, runs_b = repeat_pairing(runs_a, runs_b)
    matched = match_requests(runs_a, runs_b) if pairing == "paired" else None
    full = PairedSamples(
        build_sample(arm_a, runs_a, index, slo=slo), build_sample(arm_b, runs_b, index, slo=slo)
    )
    populations = {"all": full}
    if matched is not None:
        frames_a, frames_b, _ = matched
        populations["matched"] = PairedSamples(
            build_sample(arm_a, runs_a, index, frames_a, slo=slo),
            build_sample(arm_b, runs_b, index, frames_b, slo=slo),
        )
    if pairing == "paired":
        for key, sides in populations.items():
            for k, (ra, rb) in enumerate(zip(runs_a, runs_b, strict=True)):
                fa = None if key == "all" else [matched[0][k]]  # type: ignore[index]
                fb = None if key == "all" else [matched[1][k]]  # type: ignore[index]
                sides.repeats.append(
                    (
                        build_sample(arm_a, [ra], index, fa, slo=slo),
                        build_sample(arm_b, [rb], index, fb, slo=slo),
                    )
                )
    boot, boot_repeats = bootstrap_log_ratios(
        populations, index.height, resamples=resamples, seed=seed, metrics=metrics
    )
    ones = np.ones((1, index.height), dtype=np.int64)
    points = {k: (s.a.evaluate(ones), s.b.evaluate(ones)) for k, s in populations.items()}
    repeat_points = {
        k: [(ra.evaluate(ones), rb.evaluate(ones)) for ra, rb in s.repeats]
        for k, s in populations.items()
    }
    goodput_per_run = _goodput_per_run(runs_a, runs_b, index, slo) if slo else {}
    size_a, size_b = sample_size(runs_a, full.a), sample_size(runs_b, full.b)
    withheld = withheld_because(size_a, size_b)
    results = {}
    for m in metrics:
        key = "matched" if m.name in PER_REQUEST and "matched" in populations else "all"
        sides = populations[key]
        pa, pb = points[key]
        a, b = _finite(pa[m.name][0]), _finite(pb[m.name][0])
        ratio = b / a if a and b is not None else None
        if repeat_points[key]:
            runs_a_values = [_finite(ea[m.name][0]) for ea, _ in repeat_points[key]]
            runs_b_values = [_finite(eb[m.name][0]) for _, eb in repeat_points[key]]
        elif m.name in goodput_per_run:
            runs_a_values, runs_b_values = goodput_per_run[m.name]
        else:
            runs_a_values = [_lookup(s.values, m.name) for s in runs_a]
            runs_b_values = [_lookup(s.values, m.name) for s in runs_b]
        pairs = [
            (vb / va) if va and vb is not None else None
            for va, vb in zip(runs_a_values, runs_b_values, strict=False)
        ]
        logs = boot[key][m.name]
        lo, hi = (_finite(x) for x in percentile_ci(np.exp(logs), confidence))
        ci_sessions = (lo, hi) if ratio is not None and lo is not None and hi is not None else None
        ci_repeats = None
        if pairing != "none" and ratio is not None:
            ci_repeats = repeat_ratio_interval(
                runs_a_values, runs_b_values, paired=pairing == "paired", confidence=confidence
            )
        low = high = se = run_var = repeat_var = None
        se_df = math.inf
        if ratio is not None and pairing == "paired" and all(v is not None for v in pairs):
            repeat_vars = np.array([_repeat_variance(r[m.name]) for r in boot_repeats[key]])
            repeat_var = _finite(float(repeat_vars.mean()))
            interval = paired_interval(
                math.log(ratio),
                logs,
                np.log(np.asarray(pairs, dtype=np.float64)),
                repeat_vars,
                confidence,
            )
            if interval is not None:
                low, high, se, se_df, run_var = (
                    interval.low,
                    interval.high,
                    interval.se,
                    interval.df,
                    interval.run_variance,
                )
        elif pairing == "welch" and ci_sessions is not None:
            bounds = [ci for ci in (ci_sessions, ci_repeats) if ci is not None]
            low, high = min(ci[0] for ci in bounds), max(ci[1] for ci in bounds)
            se = (math.log(high) - math.log(low)) / (2 * z_quantile(0.5 + confidence / 2))
        judged = verdict(m, low, high, equivalence_margin)
        if ratio is not None and low is None:
            judged = WITHHELD  # one run per arm: no interval, so no verdict
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
            sides.a.count(m),
            sides.b.count(m),
            detectable=_finite(detectable_change(se, confidence, df=se_df))
            if se is not None
            else None,
            run_variance=run_var,
            repeat_variance=repeat_var,
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
        matching=None if matched is None else matched[2],
        equivalence_margin=equivalence_margin,
        slo=slo,
        breakdowns=breakdowns(
            matched[0] if matched else [s.requests for s in runs_a],
            matched[1] if matched else [s.requests for s in runs_b],
        ),
    )


def _goodput_per_run(
    runs_a: Sequence[RunSummary], runs_b: Sequence[RunSummary], index: Any, slo: Slo
) -> dict[str, tuple[list[float | None], list[float | None]]]:
    """Each run's goodput figures (run summaries hold none: the objectives are the
    comparison's), for the per-run columns of runs not paired by repeat."""
    ones = np.ones((1, index.height), dtype=np.int64)
    per_run = [
        [build_sample(s.run.arm, [s], index, slo=slo).evaluate(ones) for s in runs]
        for runs in (runs_a, runs_b)
    ]
    return {
        name: (
            [_finite(v[name][0]) for v in per_run[0]],
            [_finite(v[name][0]) for v in per_run[1]],
        )
        for name in ("goodput_req_s", "slo_attainment")
    }


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
    equivalence_margin: float = DEFAULT_EQUIVALENCE_MARGIN,
    allow_incomplete: bool = False,
    slo: Slo | None = None,
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
        equivalence_margin=equivalence_margin,
        slo=slo,
    )
    comparison.incomplete = incomplete
    return comparison

"""Intervals of a B/A ratio: the paired design's interval, its detectable effect, and the
Student t interval of unpaired repeats.

The paired design (docs/analysis.md, "How sure a verdict is"): both arms of repeat k replay one
plan, and the per-request metrics compare the requests both completed. Two sources of noise are
left in the log ratio:

- sampling: which sessions the plans happened to play, and how each request's latency moved
  with the engine's step-to-step noise. The paired session bootstrap resamples sessions jointly
  over both arms and all repeats and sees this.
- run level: anything that shifts every request of one run alike (a server's start, a thermal
  state, a neighbour). Sessions of one run share it, so the bootstrap cannot see it. It shows
  as per-repeat log ratios that spread more than their own bootstrap variances explain.

`paired_interval` widens the bootstrap's percentile interval by the run-level variance
estimated from that excess (the moment estimator of a random-effects model, floored at 0):
with no run-level noise it is the bootstrap interval, with some it grows as the repeats show.
Its coverage is measured, not assumed: benchmarks/bench_verdicts.py.

`repeat_ratio_interval` is the Student t interval over per-run values, kept for comparisons of
runs that did not replay one plan in pairs (Welch's unequal-variance form for unpaired runs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DETECT_POWER = 0.80
"""The power at which the minimum detectable effect is stated."""


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (0 < p < 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    from scipy import stats  # imported when an interval is made: a report without one needs none

    return float(stats.t.ppf(p, df))


def z_quantile(p: float) -> float:
    """The p-quantile of the standard normal."""
    from scipy import stats

    return float(stats.norm.ppf(p))


@dataclass(frozen=True)
class PairedInterval:
    """The interval of log(B/A), exponentiated, and what went into it."""

    low: float
    high: float
    se: float  # standard error of log(B/A) the interval implies
    run_variance: float | None  # the run-level variance of a repeat's log ratio; None: R < 2
    inflation: float  # the factor the bootstrap interval was widened by (1: not at all)


def run_level_variance(repeat_logs: np.ndarray, repeat_vars: np.ndarray) -> float | None:
    """Between-repeat variance of the log ratio beyond what each repeat's sampling explains.

    The per-repeat log ratios d_k spread with variance tau^2 + v_k, so s^2(d) - mean(v) is
    an unbiased moment estimate of tau^2 (floored at 0). None with fewer than two repeats.
    """
    d = np.asarray(repeat_logs, dtype=np.float64)
    v = np.asarray(repeat_vars, dtype=np.float64)
    if d.size < 2 or not np.isfinite(d).all() or not np.isfinite(v).all():
        return None
    return max(0.0, float(d.var(ddof=1)) - float(v.mean()))


def paired_interval(
    center: float,
    boot_logs: np.ndarray,
    repeat_logs: np.ndarray,
    repeat_vars: np.ndarray,
    confidence: float,
) -> PairedInterval | None:
    """The paired design's interval of B/A: the bootstrap's, widened by run-level variance.

    `center` is log(B/A) of the pooled sample, `boot_logs` its paired session-bootstrap
    resamples, `repeat_logs` and `repeat_vars` each repeat's own log ratio and its bootstrap
    variance. None when the bootstrap has too few finite resamples to place percentiles.
    """
    boot = boot_logs[np.isfinite(boot_logs)]
    if boot.size < max(20, 0.9 * boot_logs.size) or not math.isfinite(center):
        return None
    alpha = 1.0 - confidence
    lo_q, hi_q = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    var_b = float(boot.var(ddof=1))
    tau2 = run_level_variance(repeat_logs, repeat_vars)
    repeats = max(1, len(repeat_logs))
    inflation = 1.0
    if tau2 is not None and tau2 > 0.0:
        inflation = math.sqrt(1.0 + tau2 / repeats / var_b) if var_b > 0 else math.inf
    if not math.isfinite(inflation):  # every resample equal, yet the repeats disagree
        half = z_quantile(1 - alpha / 2) * math.sqrt(tau2 / repeats)  # type: ignore[operator]
        lo_log, hi_log = center - half, center + half
    else:
        lo_log = center + inflation * (float(lo_q) - center)
        hi_log = center + inflation * (float(hi_q) - center)
    se = (hi_log - lo_log) / (2 * z_quantile(1 - alpha / 2))
    return PairedInterval(math.exp(lo_log), math.exp(hi_log), se, tau2, inflation)


def detectable_change(se: float | None, confidence: float, power: float = DETECT_POWER) -> float:
    """The smallest change of B/A (as a fraction, +-) that a two-sided test at this level finds
    with `power`, given the standard error of log(B/A): exp((z_(1-a/2) + z_power) se) - 1."""
    if se is None or not math.isfinite(se):
        return math.nan
    alpha = 1.0 - confidence
    return math.expm1((z_quantile(1 - alpha / 2) + z_quantile(power)) * se)


def _logs(values: Sequence[float | None]) -> np.ndarray | None:
    if any(v is None or not math.isfinite(v) or v <= 0 for v in values):
        return None
    return np.log(np.asarray(values, dtype=np.float64))


def repeat_ratio_interval(
    a: Sequence[float | None],
    b: Sequence[float | None],
    *,
    paired: bool,
    confidence: float,
) -> tuple[float, float] | None:
    """CI of B/A from per-run values: paired t on log ratios of repeat pairs, else Welch.

    None when either side has fewer than two runs or a value that is missing or not positive.
    """
    la, lb = _logs(a), _logs(b)
    if la is None or lb is None or len(la) < 2 or len(lb) < 2:
        return None
    tail = 0.5 + confidence / 2.0
    if paired and len(la) == len(lb):
        diffs = lb - la
        center = float(diffs.mean())
        se = float(diffs.std(ddof=1)) / math.sqrt(len(diffs))
        df = len(diffs) - 1.0
    else:
        va, vb = la.var(ddof=1) / len(la), lb.var(ddof=1) / len(lb)
        center = float(lb.mean() - la.mean())
        se = math.sqrt(va + vb)
        denom = va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1)
        df = (va + vb) ** 2 / denom if denom > 0 else len(la) + len(lb) - 2.0
    if se == 0.0:
        return math.exp(center), math.exp(center)
    half = t_quantile(tail, df) * se
    return math.exp(center - half), math.exp(center + half)

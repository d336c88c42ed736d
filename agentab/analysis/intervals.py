"""Intervals of a B/A ratio: the paired design's interval, its detectable effect, and the
Student t interval of unpaired repeats.

The paired design (docs/analysis.md, "How sure a verdict is"): both arms of repeat k replay one
plan, and the per-request metrics compare the requests both completed, so each repeat gives an
independent, precise estimate d_k = log(B/A). Two sources of noise are left in it:

- sampling: which sessions the plan happened to play, and how each request's latency moved
  with the engine's step-to-step noise;
- run level: anything that shifts every request of one run alike (a server's start, a thermal
  state, a neighbour), which sessions of one run share.

The repeats are the only replicates of the second, so the interval is the paired Student t
interval over the d_k (df = R - 1): exact for normal d_k whatever the mix of the two sources.
The paired session bootstrap (both arms, every repeat, one draw of sessions) is its floor: with
few repeats the d_k can agree by chance, and the interval never claims less than the sampling
alone allows. A first design widened the bootstrap by a moment estimate of the run-level
variance instead; with three repeats that estimate is too often 0, and the interval covered
86-92% where it claimed 95% (benchmarks/results/verdicts/).

`repeat_ratio_interval` is the same t interval for comparisons of runs that did not replay one
plan in pairs (Welch's unequal-variance form for unpaired runs).
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
    se: float  # standard error of log(B/A)
    df: float  # degrees of freedom of its quantile (inf: the bootstrap floor set it)
    run_variance: float | None  # run-level variance of a repeat's log ratio; None: R < 2


def run_level_variance(repeat_logs: np.ndarray, repeat_vars: np.ndarray) -> float | None:
    """Between-repeat variance of the log ratio beyond what each repeat's sampling explains.

    The per-repeat log ratios d_k spread with variance tau^2 + v_k, so s^2(d) - mean(v) is
    an unbiased moment estimate of tau^2 (floored at 0). None with fewer than two repeats.
    Reported (and used by the planner); the interval itself uses s^2(d) directly.
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
    """The paired design's interval of B/A: Student t over the repeats' log ratios, never
    narrower than the paired session bootstrap's.

    `center` is log(B/A) of the pooled sample, `boot_logs` its paired session-bootstrap
    resamples, `repeat_logs` and `repeat_vars` each repeat's own log ratio and its bootstrap
    variance. None with fewer than two repeats or too few finite resamples.
    """
    d = np.asarray(repeat_logs, dtype=np.float64)
    boot = boot_logs[np.isfinite(boot_logs)]
    if d.size < 2 or not np.isfinite(d).all() or not math.isfinite(center):
        return None
    if boot.size < max(20, 0.9 * boot_logs.size):
        return None
    alpha = 1.0 - confidence
    df = float(d.size - 1)
    se_t = float(d.std(ddof=1)) / math.sqrt(d.size)
    half_t = t_quantile(1 - alpha / 2, df) * se_t
    lo_q, hi_q = (float(x) for x in np.quantile(boot, [alpha / 2, 1 - alpha / 2]))
    lo_b, hi_b = min(lo_q, center), max(hi_q, center)
    lo_log, hi_log = min(center - half_t, lo_b), max(center + half_t, hi_b)
    if half_t >= max(center - lo_b, hi_b - center):
        se, used_df = se_t, df
    else:  # the bootstrap floor set the width
        se, used_df = (hi_log - lo_log) / (2 * z_quantile(1 - alpha / 2)), math.inf
    tau2 = run_level_variance(d, repeat_vars)
    return PairedInterval(math.exp(lo_log), math.exp(hi_log), se, used_df, tau2)


def detectable_change(
    se: float | None, confidence: float, power: float = DETECT_POWER, df: float = math.inf
) -> float:
    """The smallest change of B/A (as a fraction, +-) that a two-sided test at this level finds
    with `power`, given the standard error of log(B/A) and its degrees of freedom:
    exp((q_(1-a/2) + q_power) se) - 1, with Student t quantiles (normal ones for df = inf)."""
    if se is None or not math.isfinite(se):
        return math.nan
    alpha = 1.0 - confidence
    if math.isinf(df):
        z = z_quantile(1 - alpha / 2) + z_quantile(power)
    else:
        z = t_quantile(1 - alpha / 2, df) + t_quantile(power, df)
    return math.expm1(z * se)


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

"""Sequential A/B: add repeat blocks until the verdict is decided, with an interval that stays
valid however early the experiment stops.

Looking at a fixed-design interval after every block and stopping at the first that excludes 1
inflates the false-positive rate far past its nominal 5% (each look is another chance). This
module uses a confidence sequence instead (Howard, Ramdas, McAuliffe and Sekhon, "Time-uniform,
nonparametric, nonasymptotic confidence sequences", 2021): a sequence of intervals that all
contain the true B/A at once with probability 1 - alpha, so stopping at any block keeps the
error rate.

A block is one repeat of each arm replaying one plan. Its estimate is d_k = log(B/A) of the
metric over the requests both arms completed, with variance v_k from its own paired session
bootstrap plus the run-level variance tau^2 the blocks show beyond that (the same estimate the
fixed design uses; 0 until two blocks exist). With S_n = sum_k (d_k - theta) and
V_n = sum_k (v_k + tau^2), the normal-mixture boundary

    |S_n| <= sqrt((V_n + rho) * log((V_n + rho) / (rho * alpha^2)))

holds for all n at once (two-sided, Gaussian increments with those variances; the mixture
parameter rho is the first block's variance, which tunes the sequence to decide within a few
blocks). Dividing by n gives the interval of the mean log ratio.

The verdict after each block is the fixed design's: the interval above or below 1 decides
better / worse, inside the equivalence margin decides equivalent; otherwise another block
runs, until `max_blocks`. No verdict rests on fewer than three blocks (`MIN_BLOCKS`): the
variance is the blocks' own, and fewer give it too few degrees of freedom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentab.analysis.compare import (
    BETTER,
    DEFAULT_CONFIDENCE,
    DEFAULT_EQUIVALENCE_MARGIN,
    EQUIVALENT,
    WITHHELD,
    WORSE,
    PairedSamples,
    bootstrap_log_ratios,
    verdict,
)
from agentab.analysis.intervals import run_level_variance
from agentab.analysis.matching import match_requests
from agentab.analysis.sample import HEADLINE, Metric, build_sample, session_index
from agentab.analysis.summary import RunSummary

MIN_BLOCKS = 3
"""No sequential verdict before this many blocks (see `decide`)."""

BLOCK_RESAMPLES = 1_000
"""Bootstrap resamples per block: only its variance is used."""


@dataclass(frozen=True)
class BlockEstimate:
    """One block's log(B/A) over the requests both arms completed, and its sampling variance."""

    log_ratio: float
    variance: float
    matched: int


def block_estimate(
    a: RunSummary,
    b: RunSummary,
    metric: Metric = HEADLINE,
    *,
    resamples: int = BLOCK_RESAMPLES,
    seed: int = 0,
) -> BlockEstimate:
    """log(B/A) of `metric` for one block, from the requests both runs completed."""
    matched = match_requests([a], [b])
    if matched is None:
        raise ValueError(
            f"{a.run.path} and {b.run.path} did not replay one plan (replay seed, prompt salt "
            "and workload must match): a block compares the same requests"
        )
    frames_a, frames_b, matching = matched
    index = session_index([a], [b])
    sides = PairedSamples(
        build_sample("a", [a], index, frames_a), build_sample("b", [b], index, frames_b)
    )
    ones = np.ones((1, index.height), dtype=np.int64)
    va, vb = sides.a.evaluate(ones)[metric.name][0], sides.b.evaluate(ones)[metric.name][0]
    boot, _ = bootstrap_log_ratios({"m": sides}, index.height, resamples=resamples, seed=seed)
    logs = boot["m"][metric.name]
    logs = logs[np.isfinite(logs)]
    with np.errstate(divide="ignore", invalid="ignore"):
        d = float(np.log(vb) - np.log(va))
    v = float(logs.var(ddof=1)) if logs.size >= 20 else math.nan
    return BlockEstimate(d, v, matching.matched[0])


def confidence_sequence(
    estimates: Sequence[BlockEstimate], confidence: float, rho: float | None = None
) -> tuple[float, float, float]:
    """(low, high, center) of B/A after these blocks, valid at every block count at once."""
    d = np.array([e.log_ratio for e in estimates], dtype=np.float64)
    v = np.array([e.variance for e in estimates], dtype=np.float64)
    if not (np.isfinite(d).all() and np.isfinite(v).all()):
        return math.nan, math.nan, math.nan
    n = d.size
    tau2 = run_level_variance(d, v) or 0.0
    total = float(v.sum()) + n * tau2
    rho = float(v[0]) if rho is None else rho
    alpha = 1.0 - confidence
    center = float(d.mean())
    if rho <= 0.0 or total <= 0.0:
        return math.exp(center), math.exp(center), math.exp(center)
    half = math.sqrt((total + rho) * math.log((total + rho) / (rho * alpha**2))) / n
    return math.exp(center - half), math.exp(center + half), math.exp(center)


@dataclass
class SequentialDecision:
    """Where the sequence stopped, why, and every block's interval on the way."""

    verdict: str
    blocks: int
    ratio: float
    low: float
    high: float
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "blocks": self.blocks,
            "ratio": self.ratio,
            "ci_low": self.low,
            "ci_high": self.high,
            "history": self.history,
        }


def decide(
    estimates: Sequence[BlockEstimate],
    metric: Metric = HEADLINE,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    margin: float = DEFAULT_EQUIVALENCE_MARGIN,
) -> tuple[str, float, float, float]:
    """The verdict the confidence sequence gives after these blocks (WITHHELD: undecided).

    Never before MIN_BLOCKS blocks: the variance is estimated from the blocks themselves, and
    two blocks give it one degree of freedom (A/A runs stopped there 6% of the time)."""
    low, high, center = confidence_sequence(estimates, confidence)
    if not math.isfinite(low) or len(estimates) < MIN_BLOCKS:
        return WITHHELD, center, low, high
    judged = verdict(metric, low, high, margin)
    if judged in (BETTER, WORSE, EQUIVALENT):
        return judged, center, low, high
    return WITHHELD, center, low, high


def sequential_decision(
    blocks: Sequence[tuple[RunSummary, RunSummary]],
    metric: Metric = HEADLINE,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    margin: float = DEFAULT_EQUIVALENCE_MARGIN,
    resamples: int = BLOCK_RESAMPLES,
    seed: int = 0,
) -> SequentialDecision:
    """Walk the blocks in order and stop at the first decided verdict (or run out of blocks)."""
    estimates: list[BlockEstimate] = []
    history: list[dict[str, Any]] = []
    result = SequentialDecision(WITHHELD, 0, math.nan, math.nan, math.nan)
    for k, (a, b) in enumerate(blocks, start=1):
        estimates.append(block_estimate(a, b, metric, resamples=resamples, seed=seed + k))
        judged, center, low, high = decide(estimates, metric, confidence=confidence, margin=margin)
        history.append({"block": k, "ratio": center, "ci_low": low, "ci_high": high})
        result = SequentialDecision(judged, k, center, low, high, history)
        if judged != WITHHELD:
            break
    return result

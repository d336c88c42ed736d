"""Sequential A/B: add repeat blocks until the verdict is decided, with an interval that stays
valid however early the experiment stops.

Looking at a fixed-design interval after every block and stopping at the first that excludes 1
inflates the false-positive rate far past its nominal 5% (each look is another chance). This
module uses a confidence sequence instead: a sequence of intervals that all contain the true
B/A at once with probability 1 - alpha, so stopping at any block keeps the error rate.

A block is one repeat of each arm replaying one plan. Its estimate is d_k = log(B/A) of the
metric over the requests both arms completed. The d_k of equal blocks are modelled as
independent draws of N(theta, sigma^2) with sigma unknown: what moves d_k is partly sampling
(which requests, how the step noise fell) and partly run-level shifts that only the spread
between blocks reveals (at low concurrency these dominate, and a block's own bootstrap variance
misses them entirely; a sequence built on it stopped A/A experiments with a verdict 12% of the
time). The sequence is therefore the scale-invariant one for a Gaussian mean with unknown
variance (Lai 1976; Wang and Ramdas, "Anytime-valid t-tests and confidence sequences for
Gaussian means with unknown variance", 2023): mixing the likelihood ratio over a N(0, 1/c)
prior on the standardized effect (theta' - theta) / sigma and the scale-invariant prior on
sigma gives, for the null theta, the test martingale

    M_n = sqrt(c / (n + c)) * (1 - S_n^2 / ((n + c) V_n))^(-n/2),
    S_n = sum_k (d_k - theta),  V_n = sum_k (d_k - theta)^2,

and Ville's inequality bounds the chance that it ever reaches 1/alpha. The values of theta it
has not rejected form the interval

    |mean(d) - theta| <= sqrt(K Q / (n (n - K))),
    K = (n + c) (1 - (alpha^2 c / (n + c))^(1/n)),  Q = sum_k (d_k - mean(d))^2,

unbounded while K >= n (too few blocks to know the scale). c (`MIXTURE_PRECISION`) sets at
which block count the sequence is tightest; it is fixed in advance, never fitted to the data.

The verdict after each block is the fixed design's: the interval above or below 1 decides
better / worse, inside the equivalence margin decides equivalent; otherwise another block
runs, until `max_blocks`. No verdict rests on fewer than three blocks (`MIN_BLOCKS`).
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
    verdict,
)
from agentab.analysis.matching import match_requests
from agentab.analysis.sample import HEADLINE, Metric, build_sample, session_index
from agentab.analysis.summary import RunSummary

MIN_BLOCKS = 3
"""No sequential verdict before this many blocks (see `decide`)."""

MIXTURE_PRECISION = 0.1
"""c of the mixture: the prior on the standardized effect is N(0, 1/c), a spread of about three
blocks' standard deviations. The sequence is then finite from three blocks on and decides an
effect of five block standard deviations in three or four blocks, of two in about six
(benchmarks/bench_verdicts.py measures it on simulated engines)."""


@dataclass(frozen=True)
class BlockEstimate:
    """One block's log(B/A) over the requests both arms completed."""

    log_ratio: float
    matched: int


def block_estimate(a: RunSummary, b: RunSummary, metric: Metric = HEADLINE) -> BlockEstimate:
    """log(B/A) of `metric` for one block, from the requests both runs completed."""
    matched = match_requests([a], [b])
    if matched is None:
        raise ValueError(
            f"{a.run.path} and {b.run.path} did not replay one plan (replay seed, prompt salt "
            "and workload must match): a block compares the same requests"
        )
    frames_a, frames_b, matching = matched
    index = session_index([a], [b])
    ones = np.ones((1, index.height), dtype=np.int64)
    va = build_sample("a", [a], index, frames_a).evaluate(ones)[metric.name][0]
    vb = build_sample("b", [b], index, frames_b).evaluate(ones)[metric.name][0]
    with np.errstate(divide="ignore", invalid="ignore"):
        d = float(np.log(vb) - np.log(va))
    return BlockEstimate(d, matching.matched[0])


def half_width(
    log_ratios: Sequence[float] | np.ndarray,
    confidence: float,
    precision: float = MIXTURE_PRECISION,
) -> float:
    """Half-width of the confidence sequence for the mean log ratio after these blocks (inf
    while too few blocks fix the scale); see the module docstring for the formula."""
    d = np.asarray(log_ratios, dtype=np.float64)
    n = d.size
    if n < 2:
        return math.inf
    alpha = 1.0 - confidence
    k = (n + precision) * (1.0 - (alpha**2 * precision / (n + precision)) ** (1.0 / n))
    if k >= n:
        return math.inf
    q = float(((d - d.mean()) ** 2).sum())
    return math.sqrt(k * q / (n * (n - k)))


def confidence_sequence(
    estimates: Sequence[BlockEstimate],
    confidence: float,
    precision: float = MIXTURE_PRECISION,
) -> tuple[float, float, float]:
    """(low, high, center) of B/A after these blocks, valid at every block count at once
    (low 0 and high inf while the sequence is unbounded)."""
    d = np.array([e.log_ratio for e in estimates], dtype=np.float64)
    if d.size == 0 or not np.isfinite(d).all():
        return math.nan, math.nan, math.nan
    center = float(d.mean())
    half = half_width(d, confidence, precision)
    if math.isinf(half):
        return 0.0, math.inf, math.exp(center)
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

    Never before MIN_BLOCKS blocks: the scale comes from the blocks' own spread, and two
    blocks barely fix it."""
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
) -> SequentialDecision:
    """Walk the blocks in order and stop at the first decided verdict (or run out of blocks)."""
    estimates: list[BlockEstimate] = []
    history: list[dict[str, Any]] = []
    result = SequentialDecision(WITHHELD, 0, math.nan, math.nan, math.nan)
    for k, (a, b) in enumerate(blocks, start=1):
        estimates.append(block_estimate(a, b, metric))
        judged, center, low, high = decide(estimates, metric, confidence=confidence, margin=margin)
        history.append({"block": k, "ratio": center, "ci_low": low, "ci_high": high})
        result = SequentialDecision(judged, k, center, low, high, history)
        if judged != WITHHELD:
            break
    return result

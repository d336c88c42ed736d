"""The sequential design's confidence sequence and stopping rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentab.analysis.sample import HEADLINE
from agentab.analysis.sequential import (
    MIXTURE_PRECISION,
    BlockEstimate,
    confidence_sequence,
    decide,
    half_width,
)


def blocks(*logs: float) -> list[BlockEstimate]:
    return [BlockEstimate(d, 500) for d in logs]


def test_the_boundary_is_the_scale_invariant_mixture_one() -> None:
    d = [0.10, 0.08, 0.12, 0.09]
    low, high, center = confidence_sequence(blocks(*d), 0.95)
    n, c, alpha = 4, MIXTURE_PRECISION, 0.05
    k = (n + c) * (1 - (alpha**2 * c / (n + c)) ** (1 / n))
    q = sum((x - 0.0975) ** 2 for x in d)
    half = math.sqrt(k * q / (n * (n - k)))
    assert center == pytest.approx(math.exp(0.0975))
    assert (low, high) == (
        pytest.approx(math.exp(0.0975 - half)),
        pytest.approx(math.exp(0.0975 + half)),
    )


def test_it_is_unbounded_until_the_blocks_fix_the_scale() -> None:
    assert half_width([0.1], 0.95) == math.inf
    assert half_width([0.1, 0.12], 0.95) == math.inf  # K = 2.08 >= 2 at c = 0.1
    assert math.isfinite(half_width([0.1, 0.12, 0.11], 0.95))
    assert confidence_sequence(blocks(0.1, 0.12), 0.95)[:2] == (0.0, math.inf)


def test_the_width_scales_with_the_blocks_spread_and_narrows_with_more_blocks() -> None:
    base = [0.01, -0.02, 0.015, -0.005]
    assert half_width([3 * x for x in base], 0.95) == pytest.approx(3 * half_width(base, 0.95))
    assert half_width(base * 2, 0.95) < half_width(base, 0.95)


def test_stopping_at_the_first_look_that_excludes_the_truth_keeps_the_error_rate() -> None:
    """Time-uniform coverage: over 20 looks on Gaussian blocks of unknown scale, the sequence
    misses the true mean at some look in at most alpha of the experiments (fixed seed)."""
    rng = np.random.default_rng(7)
    trials, looks, missed = 4_000, 20, 0
    for _ in range(trials):
        d = rng.normal(0.05, rng.uniform(0.001, 0.1), looks)
        for n in range(3, looks + 1):
            if abs(d[:n].mean() - 0.05) > half_width(d[:n], 0.95):
                missed += 1
                break
    assert missed / trials <= 0.05
    assert missed > 0  # the boundary is not infinitely wide either


def test_no_verdict_before_three_blocks_then_the_fixed_designs_rules() -> None:
    clear = [0.10, 0.095, 0.105]  # +10.5%, blocks within 0.5% of each other
    assert decide(blocks(*clear[:1]), HEADLINE)[0] == "no verdict"
    assert decide(blocks(*clear[:2]), HEADLINE)[0] == "no verdict"
    assert decide(blocks(*clear), HEADLINE)[0] == "better"
    assert decide(blocks(*(-x for x in clear)), HEADLINE)[0] == "worse"
    same = [0.001, -0.001, 0.0005]
    assert decide(blocks(*same), HEADLINE)[0] == "equivalent"
    assert decide(blocks(*same), HEADLINE, margin=0.0)[0] == "no verdict"
    noisy = [0.02, -0.03, 0.06]
    assert decide(blocks(*noisy), HEADLINE)[0] == "no verdict"

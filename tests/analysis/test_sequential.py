"""The sequential design's confidence sequence and stopping rule."""

from __future__ import annotations

import math

import pytest

from agentab.analysis.sample import HEADLINE
from agentab.analysis.sequential import BlockEstimate, confidence_sequence, decide


def test_the_boundary_is_the_normal_mixture_one() -> None:
    blocks = [BlockEstimate(0.10, 4e-4, 500), BlockEstimate(0.08, 4e-4, 500)]
    low, high, center = confidence_sequence(blocks, 0.95)
    # d = [0.10, 0.08]: tau^2 = max(0, 2e-4 - 4e-4) = 0; V = 8e-4; rho = 4e-4 (first block)
    v, rho, alpha = 8e-4, 4e-4, 0.05
    half = math.sqrt((v + rho) * math.log((v + rho) / (rho * alpha**2))) / 2
    assert center == pytest.approx(math.exp(0.09))
    assert (low, high) == (
        pytest.approx(math.exp(0.09 - half)),
        pytest.approx(math.exp(0.09 + half)),
    )


def test_no_verdict_before_three_blocks_then_the_fixed_designs_rules() -> None:
    clear = BlockEstimate(0.10, 1e-4, 800)  # +10.5%, sampling sd 1%
    assert decide([clear], HEADLINE)[0] == "no verdict"
    assert decide([clear, clear], HEADLINE)[0] == "no verdict"
    assert decide([clear] * 3, HEADLINE)[0] == "better"
    slower = BlockEstimate(-0.10, 1e-4, 800)
    assert decide([slower] * 3, HEADLINE)[0] == "worse"
    same = BlockEstimate(0.0, 1e-6, 800)
    assert decide([same] * 3, HEADLINE)[0] == "equivalent"
    assert decide([same] * 3, HEADLINE, margin=0.0)[0] == "no verdict"
    noisy = BlockEstimate(0.02, 4e-3, 800)
    assert decide([noisy] * 3, HEADLINE)[0] == "no verdict"


def test_the_sequence_widens_when_blocks_disagree() -> None:
    agree = [BlockEstimate(0.05, 1e-4, 800), BlockEstimate(0.05, 1e-4, 800)]
    disagree = [BlockEstimate(0.0, 1e-4, 800), BlockEstimate(0.10, 1e-4, 800)]
    w_agree = confidence_sequence(agree, 0.95)
    w_disagree = confidence_sequence(disagree, 0.95)
    assert w_disagree[1] - w_disagree[0] > w_agree[1] - w_agree[0]

"""The run-level interval: Student t quantiles without scipy, paired and Welch ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentab.analysis.intervals import repeat_ratio_interval, t_quantile

# Reference values of Student's t quantiles (printed tables, 10 significant digits).
TABLE = [
    (0.975, 1, 12.70620474),
    (0.975, 2, 4.302652730),
    (0.975, 10, 2.228138852),
    (0.95, 5, 2.015048373),
    (0.995, 30, 2.749995654),
]


@pytest.mark.parametrize(("p", "df", "want"), TABLE)
def test_t_quantile_matches_tables(p: float, df: int, want: float) -> None:
    assert t_quantile(p, df) == pytest.approx(want, abs=1e-6)
    assert t_quantile(1 - p, df) == pytest.approx(-want, abs=1e-6)


def test_paired_interval_is_the_t_interval_of_log_ratios() -> None:
    a = [100.0, 110.0, 95.0]
    b = [160.0, 170.0, 158.0]
    logs = np.log(np.array(b) / np.array(a))
    half = 4.302652730 * logs.std(ddof=1) / math.sqrt(3)
    lo, hi = repeat_ratio_interval(a, b, paired=True, confidence=0.95)
    assert (lo, hi) == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)))


def test_welch_interval_and_missing_values() -> None:
    lo, hi = repeat_ratio_interval([1.0, 1.1, 0.9], [1.0, 1.05, 0.95, 1.02], paired=False,
                                   confidence=0.95)  # fmt: skip
    assert lo < 1.0 < hi
    assert repeat_ratio_interval([1.0], [1.0, 2.0], paired=False, confidence=0.95) is None
    assert repeat_ratio_interval([1.0, None], [1.0, 2.0], paired=True, confidence=0.95) is None
    assert repeat_ratio_interval([1.0, 0.0], [1.0, 2.0], paired=True, confidence=0.95) is None

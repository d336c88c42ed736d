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


def test_run_level_variance_is_the_excess_over_sampling() -> None:
    from agentab.analysis.intervals import run_level_variance

    # var([0.01, 0.03], ddof=1) = 2e-4; mean sampling variance 1e-4 -> 1e-4 beyond it
    assert run_level_variance(np.array([0.01, 0.03]), np.array([1e-4, 1e-4])) == pytest.approx(
        1e-4, rel=1e-12
    )
    assert run_level_variance(np.array([0.01, 0.011]), np.array([1e-4, 1e-4])) == 0.0
    assert run_level_variance(np.array([0.01]), np.array([1e-4])) is None


def test_paired_interval_is_the_t_interval_over_repeats() -> None:
    from agentab.analysis.intervals import paired_interval

    rng = np.random.default_rng(1)
    boot = rng.normal(0.0, 0.01, 4000)
    repeat_logs = np.array([-0.03, 0.0, 0.03])  # sd 0.03, far beyond the bootstrap's 0.01
    got = paired_interval(0.0, boot, repeat_logs, np.array([1e-4] * 3), 0.95)
    half = 4.302653 * 0.03 / math.sqrt(3)  # t_(0.975, 2) s / sqrt(R)
    assert math.log(got.low) == pytest.approx(-half, rel=1e-6)
    assert math.log(got.high) == pytest.approx(half, rel=1e-6)
    assert got.df == 2.0 and got.se == pytest.approx(0.03 / math.sqrt(3))
    assert got.run_variance == pytest.approx(9e-4 - 1e-4)


def test_the_bootstrap_is_the_floor_when_repeats_agree_by_chance() -> None:
    from agentab.analysis.intervals import paired_interval

    rng = np.random.default_rng(0)
    boot = rng.normal(0.05, 0.01, 4000)
    got = paired_interval(0.05, boot, np.array([0.05, 0.05, 0.05]), np.array([3e-4] * 3), 0.95)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    assert (got.low, got.high) == (pytest.approx(math.exp(lo)), pytest.approx(math.exp(hi)))
    assert got.df == math.inf and got.run_variance == 0.0
    assert got.se == pytest.approx((hi - lo) / (2 * 1.959964), rel=1e-5)
    assert paired_interval(0.05, boot, np.array([0.05]), np.array([3e-4]), 0.95) is None


def test_detectable_change_is_the_two_sided_80_percent_power_effect() -> None:
    from agentab.analysis.intervals import detectable_change

    # (z_0.975 + z_0.80) * se = (1.959964 + 0.841621) * 0.01
    assert detectable_change(0.01, 0.95) == pytest.approx(math.expm1(0.02801585), rel=1e-6)
    # with 2 degrees of freedom: (t_0.975 + t_0.80) = 4.302653 + 1.060660
    assert detectable_change(0.01, 0.95, df=2) == pytest.approx(math.expm1(0.05363313), rel=1e-6)
    assert math.isnan(detectable_change(None, 0.95))

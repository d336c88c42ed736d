"""The vectorized session bootstrap equals numpy on the expanded samples."""

from __future__ import annotations

import numpy as np
import pytest

from agentab.analysis.bootstrap import (
    batches,
    percentile_ci,
    resample_weights,
    weighted_quantiles,
)


def test_resample_weights_are_draws_of_every_session() -> None:
    weights = resample_weights(np.random.default_rng(0), 500, 13)
    assert weights.shape == (500, 13)
    assert (weights.sum(axis=1) == 13).all()
    # Each session is drawn 13 * 500 / 13 = 500 times on average.
    assert weights.sum(axis=0).mean() == 500


def test_weighted_quantiles_equal_numpy_on_the_expanded_sample() -> None:
    rng = np.random.default_rng(3)
    n, sessions, rows = 400, 25, 60
    values = np.sort(rng.lognormal(size=n))
    groups = rng.integers(0, sessions, n)
    weights = resample_weights(rng, rows, sessions)
    qs = [0.0, 0.5, 0.9, 0.95, 0.99, 1.0]
    got = weighted_quantiles(values, groups, weights, qs)
    for r in range(rows):
        expanded = np.repeat(values, weights[r, groups])
        want = np.percentile(expanded, [100 * q for q in qs]) if expanded.size else np.nan
        np.testing.assert_allclose(got[r], want, rtol=1e-12)


@pytest.mark.parametrize(("n", "sessions"), [(1, 1), (7, 3), (1001, 2), (5003, 40), (2000, 900)])
def test_weighted_quantiles_for_many_bin_layouts(n: int, sessions: int) -> None:
    rng = np.random.default_rng(n)
    values = np.sort(rng.normal(size=n))
    groups = rng.integers(0, sessions, n)
    weights = resample_weights(rng, 25, sessions)
    weights[0] = 0
    weights[0, groups[-1]] = 2  # one session only, the one holding the largest value
    qs = [0.0, 0.01, 0.5, 0.9, 0.99, 1.0]
    got = weighted_quantiles(values, groups, weights, qs)
    for r in range(weights.shape[0]):
        expanded = np.repeat(values, weights[r, groups])
        want = np.percentile(expanded, [100 * q for q in qs]) if expanded.size else np.nan
        np.testing.assert_allclose(got[r], want, rtol=1e-12, atol=1e-15)


def test_a_resample_without_values_gives_nan() -> None:
    values = np.array([1.0, 2.0])
    groups = np.array([0, 0])
    weights = np.array([[0, 3], [1, 0]])
    got = weighted_quantiles(values, groups, weights, [0.5])
    assert np.isnan(got[0, 0])
    assert got[1, 0] == 1.5


def test_batches_cover_the_total() -> None:
    assert sum(batches(10_000, 50_000)) == 10_000
    assert list(batches(3, 10)) == [3]


def test_percentile_ci_ignores_non_finite() -> None:
    lo, hi = percentile_ci(np.array([np.nan, np.inf, *range(101)], dtype=float), 0.9)
    assert (lo, hi) == pytest.approx((5.0, 95.0))


def test_weighted_quantiles_with_large_weights_use_the_exact_wide_paths() -> None:
    """Weights past int16 and totals past float32's exact integers take the wide code paths,
    with the same result as numpy on the expanded sample; a prebuilt layout changes nothing."""
    from agentab.analysis.bootstrap import QuantileLayout

    rng = np.random.default_rng(9)
    n, sessions = 300, 6
    values = np.sort(rng.normal(size=n))
    groups = rng.integers(0, sessions, n)
    weights = resample_weights(rng, 4, sessions)
    weights[1, 2] = 40_000  # beyond int16
    weights[2] = 0
    weights[2, groups[0]] = 400_000  # the total passes 2**24: float64 products
    qs = [0.0, 0.5, 0.9, 0.99, 1.0]
    layout = QuantileLayout(groups, sessions, len(qs))
    assert int((weights @ layout.per_session).max()) >= 1 << 24
    got = weighted_quantiles(values, groups, weights, qs, layout)
    np.testing.assert_array_equal(got, weighted_quantiles(values, groups, weights, qs))
    for r in range(weights.shape[0]):
        expanded = np.repeat(values, weights[r, groups])
        want = np.percentile(expanded, [100 * q for q in qs])
        np.testing.assert_allclose(got[r], want, rtol=1e-12, atol=1e-15)

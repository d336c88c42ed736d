"""Session-resampling bootstrap, vectorized: weighted percentiles for a batch of resamples at once.

Requests of one session are not independent (same context, same prefix cache, same pauses), so
the resampling unit is the session: a resample draws sessions with replacement and every request
of a drawn session enters with the session's multiplicity. A resample is therefore just an
integer weight per session, and a batch of resamples is a weight matrix W (resamples x sessions):
sums become matrix products and a percentile of the resampled requests becomes a weighted
percentile, computed for every row at once with one cumulative sum and one `searchsorted` over
the rows laid end to end. No Python loop runs per resample or per request.

The weighted percentile is exactly numpy's linear percentile of the expanded sample (each value
repeated by its weight): position h = (N - 1) q, value v[floor h] + frac * (v[floor h + 1] - ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# Elements per batch of the (resamples x requests) matrices: about 32 MB each as int64.
BATCH_ELEMENTS = 4_000_000


def resample_weights(rng: np.random.Generator, rows: int, sessions: int) -> np.ndarray:
    """`rows` bootstrap resamples of `sessions` sessions as a (rows, sessions) count matrix."""
    draws = rng.integers(0, sessions, size=(rows, sessions))
    flat = (draws + (np.arange(rows) * sessions)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * sessions).reshape(rows, sessions)


def batches(total: int, elements_per_row: int) -> Iterator[int]:
    """Row counts of successive batches so that each batch stays near BATCH_ELEMENTS."""
    size = max(1, min(total, BATCH_ELEMENTS // max(1, elements_per_row)))
    done = 0
    while done < total:
        rows = min(size, total - done)
        yield rows
        done += rows


def weighted_quantiles(
    values: np.ndarray, groups: np.ndarray, weights: np.ndarray, qs: Sequence[float]
) -> np.ndarray:
    """Linear percentiles of `values` repeated by `weights[:, groups]`, for each weight row.

    `values` must be sorted ascending; `groups[i]` is the session of `values[i]`. Returns an
    array (rows, len(qs)); a row whose resample holds no value gives NaN.
    """
    rows = weights.shape[0]
    n = values.shape[0]
    out = np.full((rows, len(qs)), np.nan)
    if n == 0:
        return out
    cum = np.cumsum(weights[:, groups], axis=1, dtype=np.int64)
    total = cum[:, -1]
    stride = int(total.max()) + 1
    offsets = np.arange(rows, dtype=np.int64) * stride
    flat = (cum + offsets[:, None]).ravel()
    base = np.arange(rows, dtype=np.int64) * n
    valid = total > 0
    for j, q in enumerate(qs):
        h = (total - 1) * q
        lo = np.floor(h).astype(np.int64)
        frac = h - lo
        hi = np.minimum(lo + 1, total - 1)
        # The element at expanded position k is the first one whose cumulative weight exceeds k.
        i_lo = np.searchsorted(flat, lo + offsets, side="right") - base
        i_hi = np.searchsorted(flat, hi + offsets, side="right") - base
        i_lo = np.clip(i_lo, 0, n - 1)
        i_hi = np.clip(i_hi, 0, n - 1)
        v_lo, v_hi = values[i_lo], values[i_hi]
        out[:, j] = np.where(valid, v_lo + frac * (v_hi - v_lo), np.nan)
    return out


def percentile_ci(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    """The percentile-bootstrap interval of finite samples (NaN, NaN when there are none)."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.percentile(finite, [100 * tail, 100 * (1 - tail)])
    return float(lo), float(hi)

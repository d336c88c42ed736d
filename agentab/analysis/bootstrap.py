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


# Relative cost of one multiply-add of the BLAS stage versus one element of the gather stage.
_GATHER_COST = 64.0


def bin_layout(n: int, sessions: int, quantiles: int) -> tuple[int, int]:
    """(bins, bin size) for `weighted_quantiles`: balances the two stages' work per resample.

    Stage 1 costs `sessions * bins` multiply-adds (a BLAS product, cheap per element), stage 2
    about `quantiles * bin size` gathered elements, so bins ~ sqrt(c * quantiles * n / sessions).
    """
    if n == 0:
        return 1, 1
    bins = int(np.clip(round(np.sqrt(_GATHER_COST * quantiles * n / max(1, sessions))), 1, n))
    size = -(-n // bins)
    return -(-n // size), size


def work_per_row(n: int, sessions: int, quantiles: int) -> int:
    """Array elements one resample row needs in `weighted_quantiles` (to size batches)."""
    bins, size = bin_layout(n, sessions, quantiles)
    return sessions + 2 * bins + 3 * size


def weighted_quantiles(
    values: np.ndarray, groups: np.ndarray, weights: np.ndarray, qs: Sequence[float]
) -> np.ndarray:
    """Linear percentiles of `values` repeated by `weights[:, groups]`, for each weight row.

    `values` must be sorted ascending; `groups[i]` is the session of `values[i]`. Returns an
    array (rows, len(qs)); a row whose resample holds no value gives NaN.

    Exact, in two stages so the work per resample stays far below one pass over the requests:
    the sorted values are cut into bins of consecutive ranks; a matrix product turns session
    weights into bin weights, whose cumulative sum locates the bin holding each target
    position; only that bin's requests are then walked, for every row at once.
    """
    rows, sessions = weights.shape
    n = values.shape[0]
    out = np.full((rows, len(qs)), np.nan)
    if n == 0 or rows == 0:
        return out
    bins, size = bin_layout(n, sessions, len(qs))
    counts = np.bincount(groups * bins + np.arange(n) // size, minlength=sessions * bins)
    cum_bins = np.cumsum(
        weights.astype(np.float64) @ counts.reshape(sessions, bins).astype(np.float64), axis=1
    )
    total = cum_bins[:, -1]
    valid = total > 0
    # Rows laid end to end: one searchsorted serves every row (cumulative sums are integers).
    stride = float(total.max()) + 1.0
    offsets = np.arange(rows, dtype=np.float64) * stride
    flat_bins = (cum_bins + offsets[:, None]).ravel()
    # Each bin's session ids, the last bin padded with a session of weight zero.
    members = np.full(bins * size, sessions, dtype=np.int64)
    members[:n] = groups
    members = members.reshape(bins, size)
    weights_ext = np.concatenate([weights, np.zeros((rows, 1), weights.dtype)], axis=1)

    def locate(k: np.ndarray, rix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For rows `rix`: bin b holding expanded position k, weight before b, cumsum inside b."""
        pos = np.searchsorted(flat_bins, k + offsets[rix], side="right") - rix * bins
        b = np.clip(pos, 0, bins - 1)
        before = np.where(b > 0, cum_bins[rix, np.maximum(b - 1, 0)], 0.0)
        within = np.cumsum(weights_ext[rix[:, None], members[b]], axis=1)
        return b, before, within

    all_rows = np.arange(rows)
    for col, q in enumerate(qs):
        h = np.where(valid, (total - 1) * q, 0.0)
        lo = np.floor(h)
        frac = h - lo
        hi = np.minimum(lo + 1, np.maximum(total - 1, 0))
        b, before, within = locate(lo, all_rows)
        # The element at k is the first whose cumulative weight exceeds k.
        i_lo = b * size + (before[:, None] + within <= lo[:, None]).sum(axis=1)
        j_hi = (before[:, None] + within <= hi[:, None]).sum(axis=1)
        i_hi = b * size + j_hi
        spill = np.flatnonzero(j_hi >= size)  # position hi lies in a later bin: locate it
        if spill.size:
            b2, before2, within2 = locate(hi[spill], spill)
            i_hi[spill] = b2 * size + (before2[:, None] + within2 <= hi[spill, None]).sum(axis=1)
        v_lo = values[np.clip(i_lo, 0, n - 1)]
        v_hi = values[np.clip(i_hi, 0, n - 1)]
        out[:, col] = np.where(valid, v_lo + frac * (v_hi - v_lo), np.nan)
    return out


def percentile_ci(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    """The percentile-bootstrap interval of finite samples (NaN, NaN when there are none)."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.percentile(finite, [100 * tail, 100 * (1 - tail)])
    return float(lo), float(hi)

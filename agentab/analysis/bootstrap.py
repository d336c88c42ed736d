"""Session-resampling bootstrap, vectorized: weighted percentiles for a batch of resamples at once.

Requests of one session are not independent (same context, same prefix cache, same pauses), so
the resampling unit is the session: a resample draws sessions with replacement and every request
of a drawn session enters with the session's multiplicity. A resample is therefore just an
integer weight per session, and a batch of resamples is a weight matrix W (resamples x sessions):
sums become matrix products and a percentile of the resampled requests becomes a weighted
percentile, computed for every row at once with one cumulative sum and one `searchsorted` over
the rows laid end to end. No Python loop runs per resample or per request, and nothing is sorted
per resample: the values are sorted once, cut into bins of consecutive ranks, and each session's
count per bin (`QuantileLayout`, built once per sample) turns a resample into bin weights with one
matrix product; only the bin holding a target rank is then walked.

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


# Relative cost of one multiply-add of the BLAS stage versus one element of the gather stage
# (measured on 1M requests in 4,000 sessions: 256 is the fastest of 16 ... 4096).
_GATHER_COST = 256.0


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


class QuantileLayout:
    """What `weighted_quantiles` precomputes from (values, groups) alone, once per sample.

    The bins of consecutive ranks, each session's count of requests per bin (the matrix stage
    1 multiplies by), and each bin's members' sessions. Built once and reused for every batch of
    resamples: recomputing it per batch was a large share of a big comparison's time.
    """

    def __init__(self, groups: np.ndarray, sessions: int, quantiles: int) -> None:
        n = len(groups)
        self.n = n
        self.sessions = sessions
        self.bins, self.size = bin_layout(n, sessions, quantiles)
        bins, size = self.bins, self.size
        counts = np.bincount(groups * bins + np.arange(n) // size, minlength=sessions * bins)
        self.counts = counts.reshape(sessions, bins).astype(np.float64)
        self.counts32 = self.counts.astype(np.float32)
        self.per_session = np.bincount(groups, minlength=sessions).astype(np.int64)
        # each bin's session ids, the last bin padded with a session of weight zero
        members = np.full(bins * size, sessions, dtype=np.intp)
        members[:n] = groups
        self.members = members.reshape(bins, size)

    def bin_weights(self, weights: np.ndarray) -> np.ndarray:
        """(rows, bins) cumulative resampled counts, exactly (integers held in floats).

        float32 products are exact while every partial sum stays below 2**24 (a row's total
        bounds them all), and twice as fast as float64, so they are used when that holds."""
        totals = weights @ self.per_session
        if len(totals) and int(totals.max()) < 1 << 24:
            prod = (weights.astype(np.float32) @ self.counts32).astype(np.float64)
        else:
            prod = weights.astype(np.float64) @ self.counts
        return np.cumsum(prod, axis=1)


def weighted_quantiles(
    values: np.ndarray,
    groups: np.ndarray,
    weights: np.ndarray,
    qs: Sequence[float],
    layout: QuantileLayout | None = None,
) -> np.ndarray:
    """Linear percentiles of `values` repeated by `weights[:, groups]`, for each weight row.

    `values` must be sorted ascending; `groups[i]` is the session of `values[i]`. Returns an
    array (rows, len(qs)); a row whose resample holds no value gives NaN. `layout` is
    `QuantileLayout(groups, sessions, len(qs))`, built here when not given.

    Exact, in two stages so the work per resample stays far below one pass over the requests:
    the sorted values are cut into bins of consecutive ranks; a matrix product turns session
    weights into bin weights, whose cumulative sum locates the bin holding each target
    position; only that bin's requests are then walked, for the rows that land in it at once.
    """
    rows, sessions = weights.shape
    n = values.shape[0]
    out = np.full((rows, len(qs)), np.nan)
    if n == 0 or rows == 0:
        return out
    if layout is None:
        layout = QuantileLayout(groups, sessions, len(qs))
    bins, size, members = layout.bins, layout.size, layout.members
    cum_bins = layout.bin_weights(weights)
    total = cum_bins[:, -1]
    valid = total > 0
    # Rows laid end to end: one searchsorted serves every row (cumulative sums are integers).
    stride = float(total.max()) + 1.0
    offsets = np.arange(rows, dtype=np.float64) * stride
    flat_bins = (cum_bins + offsets[:, None]).ravel()
    small = np.int16 if int(weights.max(initial=0)) < 1 << 15 else np.int64
    weights_ext = np.zeros((rows, sessions + 1), dtype=small)
    weights_ext[:, :sessions] = weights

    def locate(k: np.ndarray, rix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For rows `rix`: bin b holding expanded position k, and weight before b."""
        pos = np.searchsorted(flat_bins, k + offsets[rix], side="right") - rix * bins
        b = np.clip(pos, 0, bins - 1)
        before = np.where(b > 0, cum_bins[rix, np.maximum(b - 1, 0)], 0.0)
        return b, before

    def ranks_within(
        b: np.ndarray, rix: np.ndarray, thresholds: list[np.ndarray]
    ) -> list[np.ndarray]:
        """For each threshold t (per row): how many of bin b's members have a cumulative
        resampled weight <= t. Rows are grouped by bin, so each group gathers one bin's
        columns for all its rows."""
        res = [np.zeros(len(rix), dtype=np.int64) for _ in thresholds]
        thresholds = [t.astype(np.int64) for t in thresholds]
        order = np.argsort(b, kind="stable")
        sorted_b = b[order]
        cuts = np.flatnonzero(np.diff(sorted_b)) + 1
        for grp in np.split(order, cuts):
            if not len(grp):
                continue
            sub = np.take(weights_ext[rix[grp]], members[b[grp[0]]], axis=1)
            within = np.cumsum(sub, axis=1, dtype=np.int64)
            for r, t in zip(res, thresholds, strict=True):
                r[grp] = (within <= t[grp, None]).sum(axis=1)  # t: integers held in floats
        return res

    all_rows = np.arange(rows)
    for col, q in enumerate(qs):
        h = np.where(valid, (total - 1) * q, 0.0)
        lo = np.floor(h)
        frac = h - lo
        hi = np.minimum(lo + 1, np.maximum(total - 1, 0))
        b, before = locate(lo, all_rows)
        # The element at k is the first whose cumulative weight exceeds k.
        j_lo, j_hi = ranks_within(b, all_rows, [lo - before, hi - before])
        i_lo = b * size + j_lo
        i_hi = b * size + j_hi
        spill = np.flatnonzero(j_hi >= size)  # position hi lies in a later bin: locate it
        if spill.size:
            b2, before2 = locate(hi[spill], spill)
            (j2,) = ranks_within(b2, spill, [hi[spill] - before2])
            i_hi[spill] = b2 * size + j2
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

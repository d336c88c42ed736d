"""The emission log's buffer management (agentab.engine.emissions.EmissionLog.make_room).

A request's chunks are read off the log when it leaves its slot; dropping old steps, growing the
buffer and moving the kept steps to the front of the same buffer must leave every span a running
request can still read as it was, and the steps written afterwards must start from zero counts.
"""

from __future__ import annotations

import numpy as np

from agentab.engine.emissions import EmissionLog


def _reference_span(
    times: list[float], counts: dict[tuple[int, int], int], since: int, n: int, slot: int
) -> tuple[list[float], list[int]]:
    steps = [r for r in range(since, n) if counts.get((r, slot), 0)]
    return [times[r] for r in steps], [counts[(r, slot)] for r in steps]


def test_spans_survive_drops_growth_and_in_place_moves() -> None:
    rng = np.random.default_rng(7)
    slots = 6
    log = EmissionLog(4, rows=16)
    times: list[float] = []
    counts: dict[tuple[int, int], int] = {}
    since = [0] * slots  # the step each slot's request started at
    moved_in_place = grown = 0
    for _ in range(400):
        m = int(rng.integers(1, 6))
        keep = min(since)
        before = log.counts
        rows = log.counts.shape[1]
        if log.n - log.base + m > rows or slots > log.counts.shape[0]:
            log.make_room(m, keep, slots)
            if log.counts is before:
                moved_in_place += 1
            else:
                grown += 1
        row = log.n - log.base
        new_times = np.cumsum(rng.random(m)) + (times[-1] if times else 0.0)
        log.times[row : row + m] = new_times
        for j in range(m):
            step = log.n + j
            times.append(float(new_times[j]))
            for s in range(slots):
                if rng.random() < 0.7:
                    c = int(rng.integers(1, 4))
                    log.counts[s, row + j] = c
                    counts[(step, s)] = c
        log.n += m
        for s in range(slots):
            t, c = log.span(since[s], s)
            want_t, want_c = _reference_span(times, counts, since[s], log.n, s)
            assert t.tolist() == want_t and c.tolist() == want_c
            if rng.random() < 0.15:  # the slot's request leaves; the next one starts now
                since[s] = log.n
    assert moved_in_place > 0 and grown > 0

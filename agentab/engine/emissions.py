"""The emission log: every step's end time and the tokens each slot emitted at it.

Why: an in-process client (`Engine.submit`) needs a request's chunk times, not one Python object
per token. The engine logs each step's end time (`Scheduler.log_times`), the scheduler writes
each step's emitted counts as one column over its slots (a window as one block of columns), and
a request's chunks are read off its slot's row when it leaves the slot (finish, preemption,
abort), as arrays. The counts are slot-major so that this read, once per request, is one
contiguous run (step-major it took a cache miss for every step the request lived). Steps no
running request can still read are dropped when the buffer fills, so memory follows the
longest-running request (docs/engine.md, "Speed on the virtual clock").

The functions below are the scheduler's side of the log (`Scheduler.log_times`, `span`, ...):
they read which requests hold which slots, which only the scheduler knows, and are kept here
so the scheduler's module holds the scheduling rules and their transitions alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentab.engine import loops_numba, pages

if TYPE_CHECKING:
    from agentab.engine.request import Request
    from agentab.engine.scheduler import Scheduler


class EmissionLog:
    """Each step's end time (`times[r]`) and the tokens each slot emitted at it
    (`counts[slot, r]`), for steps `base + r` from step `base` on."""

    __slots__ = ("base", "counts", "n", "times", "until")

    def __init__(self, slots: int, rows: int = 1024) -> None:
        self.base = 0  # step number of row 0
        self.n = 0  # steps logged so far
        # With async scheduling a step is logged when it is applied, before it ends: the end
        # time of the last step handed out (None: every logged step has ended)
        self.until: float | None = None
        self.times = np.zeros(rows, dtype=np.float64)
        self.counts = pages.zeros((slots, rows), np.int32)

    def make_room(self, steps: int, keep_from: int, slots: int) -> None:
        """Room for `steps` more steps and `slots` slots, keeping the steps from `keep_from`."""
        cols, rows = self.counts.shape
        used = self.n - self.base
        if used + steps <= rows and slots <= cols:
            return
        keep = used - (keep_from - self.base)
        size = rows
        while keep + steps > size // 2:
            size *= 2
        lo = keep_from - self.base
        if size == rows and slots <= cols:
            # the buffer stays: the kept steps move to its front (numpy copies overlapping
            # ranges safely) and the steps after them are cleared, instead of a new buffer
            # whose tens of MB the process would fault in again
            self.times[:keep] = self.times[lo:used]
            self.counts[:, :keep] = self.counts[:, lo:used]
            self.counts[:, keep:used] = 0  # (the steps from `used` on were never written)
            self.base = keep_from
            return
        times = np.zeros(size, dtype=np.float64)
        counts = pages.zeros((max(slots, cols), size), np.int32)
        times[:keep] = self.times[lo:used]
        counts[:cols, :keep] = self.counts[:, lo:used]
        self.times, self.counts, self.base = times, counts, keep_from

    def span(self, since: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(end times, tokens) of the steps from step `since` in which `slot` emitted."""
        result: tuple[np.ndarray, np.ndarray] = loops_numba.log_span(
            self.times, self.counts, since - self.base, self.n - self.base, slot
        )
        return result


def collect_timelines(s: Scheduler) -> None:
    """Log every step's emissions from now on (see EmissionLog); the engine then passes each
    step's end time to `log_times` before applying the step."""
    if s.log is None:
        s.log = EmissionLog(s.state.capacity)
        for req in s.requests.values():
            req.since = 0


def log_times(s: Scheduler, times: np.ndarray) -> None:
    """The end times of the next steps to be applied (one for a step, m for a window)."""
    log = s.log
    assert log is not None
    m = len(times)
    cap = len(s.state.computed)
    if log.n - log.base + m > len(log.times) or cap > log.counts.shape[0]:
        keep = min((r.since for r in s.requests_of(s.run)), default=log.n)
        log.make_room(m, keep, cap)
    row = log.n - log.base
    log.times[row : row + m] = times
    log.n += m


def span(s: Scheduler, req: Request) -> tuple[np.ndarray, np.ndarray]:
    """(end times, tokens) of the steps in which `req` emitted since it took its slot."""
    assert s.log is not None and req.is_running
    return s.log.span(req.since, req.slot)


def emitted_parts(s: Scheduler, req: Request) -> list[tuple[np.ndarray, np.ndarray]]:
    """(end times, tokens) pieces of everything `req` emitted: its earlier slots' chunks, then
    what its current slot logged so far (empty without a log)."""
    parts = list(req.chunk_parts)
    if req.is_running and s.log is not None:
        parts.append(span(s, req))
    return parts

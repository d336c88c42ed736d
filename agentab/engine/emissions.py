"""The emission log: every step's end time and the tokens each slot emitted at it.

Why: an in-process client (`Engine.submit`) needs a request's chunk times, not one Python object
per token. The engine logs each step's end time (`Scheduler.log_times`), the scheduler writes
each step's emitted counts as one row over its slots (a window as one block of rows), and a
request's chunks are read off its slot's column when it leaves the slot (finish, preemption,
abort), as arrays. Rows no running request can still read are dropped when the buffer fills,
so memory follows the longest-running request (docs/engine.md, "Speed on the virtual clock").
"""

from __future__ import annotations

import numpy as np


class EmissionLog:
    """Rows of (end time, tokens emitted per slot), one row per step, from step `base` on."""

    __slots__ = ("base", "counts", "n", "times", "until")

    def __init__(self, slots: int, rows: int = 1024) -> None:
        self.base = 0  # step number of row 0
        self.n = 0  # steps logged so far
        # With async scheduling a step is logged when it is applied, before it ends: the end
        # time of the last step handed out (None: every logged step has ended)
        self.until: float | None = None
        self.times = np.zeros(rows, dtype=np.float64)
        self.counts = np.zeros((rows, slots), dtype=np.int32)

    def make_room(self, steps: int, keep_from: int, slots: int) -> None:
        """Room for `steps` more rows and `slots` columns, keeping rows from step `keep_from`."""
        rows, cols = self.counts.shape
        used = self.n - self.base
        if used + steps <= rows and slots <= cols:
            return
        keep = used - (keep_from - self.base)
        size = rows
        while keep + steps > size // 2:
            size *= 2
        times = np.zeros(size, dtype=np.float64)
        counts = np.zeros((size, max(slots, cols)), dtype=np.int32)
        lo = keep_from - self.base
        times[:keep] = self.times[lo:used]
        counts[:keep, :cols] = self.counts[lo:used]
        self.times, self.counts, self.base = times, counts, keep_from

    def span(self, since: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(end times, tokens) of the steps from step `since` in which `slot` emitted."""
        lo = since - self.base
        seg = self.counts[lo : self.n - self.base, slot]
        nz = np.flatnonzero(seg)
        return self.times[lo + nz], seg[nz]

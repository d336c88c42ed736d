"""How hard a replay client worked, and whether it kept up: recorded in the run's manifest.

Why: a client that cannot keep up measures itself, not the server. One Python process spends a
few microseconds of CPU per streamed chunk; past some thousands of chunks a second its event
loop runs late, every timestamp it takes is late by as much, and its dispatches leave after
their plan. Neither shows in the records' figures, which look like a slower server. So every
real-clock run records, per client process (`clients` in the manifest):

- `chunks` and `chunks_per_s`: the load it carried;
- `loop_lag_ms`: how late a 10 ms timer fired on its loop (P50, P90, P99, max): the delay added
  to every timestamp it took while busy;
- `behind_plan_ms`: how late its loop dispatched the profiling window's requests against their
  planned times (P50, P90, P99, max; connection setup and the server's accept are not in it).

Analysis refuses a run whose client fell behind its plan by more than the replay option
`max_behind_plan_ms` (default 10 ms) at P90, naming the client: run it again with more
client processes (`agentab replay --clients N`).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import numpy as np

LAG_INTERVAL_S = 0.01
"""The lag probe's period: 100 timer callbacks a second cost the loop nothing measurable."""


class LoopLag:
    """A timer re-armed every `interval_s` that records how late each firing was."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = LAG_INTERVAL_S) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._due = loop.time() + interval_s
        self._handle = loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        now = self.loop.time()
        self.lags.append(now - self._due)
        self._due = now + self.interval_s
        self._handle = self.loop.call_at(self._due, self._fire)

    def stop(self) -> None:
        self._handle.cancel()


def _ms(values: list[float]) -> dict[str, float | None]:
    """P50, P90, P99 and max of `values` (seconds), in milliseconds; None where there are none."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    arr = np.asarray(values) * 1e3
    p50, p90, p99 = (round(float(v), 3) for v in np.percentile(arr, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "max": round(float(arr.max()), 3)}


def client_load(
    client: int,
    lanes: int | None,
    *,
    dispatched: int,
    chunks: int,
    t0: float,
    wall_s: float,
    lags: list[float],
    behind: list[float],
) -> dict[str, Any]:
    """One client's entry of the manifest's `clients`."""
    return {
        "client": client,
        "host": socket.gethostname(),
        "node": None,
        "pid": os.getpid(),
        "lanes": lanes,
        "clock_t0": t0,
        "requests": dispatched,
        "chunks": chunks,
        "wall_s": round(wall_s, 3),
        "chunks_per_s": round(chunks / wall_s, 1) if wall_s > 0 else None,
        "loop_lag_ms": _ms(lags),
        "behind_plan_ms": _ms(behind),
    }

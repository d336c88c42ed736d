"""A request's response on its way to the client: a stream of events, or collected arrays.

`generate` hands each request a `Channel` (a deque of events plus one waiter, cheaper than an
asyncio.Queue, since the simulator creates millions of events); `submit` hands it a `Timeline`,
whose chunk times are read off the scheduler's emission log as arrays at the request's end.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from agentab.engine.types import FinalUsage, TokenEvent

if TYPE_CHECKING:
    from agentab.engine.request import Request
    from agentab.engine.scheduler import Scheduler


class Channel:
    """A request's event stream: a deque plus one waiter (cheaper than asyncio.Queue)."""

    __slots__ = ("done", "items", "waiter")

    def __init__(self) -> None:
        self.items: deque[TokenEvent | FinalUsage] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.done = False

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class Timeline:
    """A request's response collected as arrays (`Engine.submit`), for in-process clients.

    Why: a client in the same process that only needs when each chunk was emitted (the replay's
    records) need not receive one Python event per step. On a priced executor the scheduler's
    EmissionLog holds every step's time and each slot's token count, and the request's chunks
    are read off it as arrays when it leaves its slot; a measured executor's loop appends each
    step here (`add_step`). `finished` resolves with the FinalUsage at the request's end, so
    the client runs once per request instead of once per step. The times are the same as
    `generate`'s events'.
    """

    __slots__ = ("_open", "_parts", "_req", "_sched", "done", "finished")

    def __init__(
        self,
        finished: asyncio.Future[FinalUsage],
        req: Request | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.finished = finished
        self.done = False
        self._req = req
        self._sched = scheduler
        self._parts: list[tuple[Any, ...]] = []
        self._open: tuple[list[float], list[int]] | None = None  # the piece single steps extend

    def add_step(self, t: float, n: int) -> None:
        piece = self._open
        if piece is None:
            piece = self._open = ([], [])
            self._parts.append(piece)
        piece[0].append(t)
        piece[1].append(n)

    def chunk_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(loop times as float64, tokens as int32) of every chunk emitted so far, in order."""
        parts = [(np.asarray(t, np.float64), np.asarray(n, np.int32)) for t, n in self._parts]
        req, sched = self._req, self._sched
        if req is not None and sched is not None:
            parts.extend(sched.emitted_parts(req))
        if len(parts) == 1:
            times, counts = parts[0]
        elif not parts:
            return np.zeros(0, np.float64), np.zeros(0, np.int32)
        else:
            times = np.concatenate([p[0] for p in parts])
            counts = np.concatenate([p[1] for p in parts])
        until = sched.log.until if sched is not None and sched.log is not None else None
        if until is not None and len(times) and times[-1] > until:
            keep = times <= until  # a step applied ahead of its end has not ended yet
            times, counts = times[keep], counts[keep]
        if counts.dtype != np.int32:
            counts = counts.astype(np.int32)
        return times, counts

    def chunks(self) -> tuple[list[float], list[int]]:
        """(loop times, tokens) of every chunk emitted so far, in order, as lists."""
        times, counts = self.chunk_arrays()
        return times.tolist(), counts.tolist()

"""Time for replay and engines: the real asyncio loop, or a virtual (discrete-event) one.

Replay and engine code only ever use asyncio's own notion of time (`loop.time()`,
`asyncio.sleep`, `asyncio.wait_for`). Under `run_virtual` the loop's clock is virtual: whenever
every task is waiting on a timer, time jumps straight to the earliest timer instead of sleeping.
The same replay code therefore drives a real HTTP server in real time and simulates an hour of
traffic against the in-process simulator in seconds, with identical scheduling logic.

Why a custom loop rather than passing a clock object around: timeouts, `wait_for`, and
`asyncio.Event` waits with deadlines all keep working unchanged, and nothing can accidentally
read wall time in the middle of a simulation.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _VirtualSelector(selectors.DefaultSelector):
    """The virtual loop's selector: it polls real file descriptors without blocking, and where
    the loop would block until its next timer, it moves the virtual clock there instead.

    While the only descriptor is the loop's own self-pipe (and no signal handler reports
    through it), a poll that must not block is skipped: what another thread hands the loop
    (`call_soon_threadsafe`) is in its ready queue already, the pipe's byte only wakes a
    blocking select, so the skip changes nothing the loop runs. A simulation makes ~10 such
    polls per request, each a system call."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.now = float(start)
        self.own_fds = 0  # registered descriptors that only wake the loop (its self-pipe)
        self.fds = 0  # registered descriptors

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = super().register(fileobj, events, data)
        self.fds += 1
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self.fds -= 1
        return key

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and self.fds <= self.own_fds:
            if timeout > 0:
                self.now += timeout
            return []
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            # No timer pending at all: only real I/O (a worker thread) can wake us.
            return super().select(None)
        if timeout > 0:
            self.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer when nothing is ready.

    Real file descriptors still work (polled without blocking), so a virtual run may use
    threads via the loop's self-pipe; it must not wait for real network I/O, whose latency
    would be invisible to the virtual clock.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._clock = _VirtualSelector(start)
        super().__init__(self._clock)
        self._clock.own_fds = self._clock.fds

    def add_signal_handler(self, sig: int, callback: Callable[[*Ts], object], *args: *Ts) -> None:
        """As asyncio's; the signals then arrive through the self-pipe, so it is polled."""
        self._clock.own_fds = 0
        super().add_signal_handler(sig, callback, *args)

    def time(self) -> float:
        return self._clock.now


def is_virtual(loop: asyncio.AbstractEventLoop | None = None) -> bool:
    """True when running under `run_virtual` (engines use it to batch work per wakeup)."""
    loop = loop or asyncio.get_running_loop()
    return isinstance(loop, VirtualTimeLoop)


def run_virtual(coro: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run `coro` to completion on virtual time starting at `start` seconds."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(coro)


def run_real(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the ordinary real-time loop (HTTP targets, served engines)."""
    return asyncio.run(coro)

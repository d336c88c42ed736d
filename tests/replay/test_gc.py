"""The replay pauses automatic GC on the real clock, and still bounds cyclic garbage."""

from __future__ import annotations

import asyncio
import gc
import weakref

from agentab.clock import run_real, run_virtual
from agentab.replay.api import _gc_frozen, _YoungGuard


async def _enabled_inside() -> tuple[bool, bool]:
    loop = asyncio.get_running_loop()
    with _gc_frozen(loop):
        inside = gc.isenabled()
    return inside, gc.isenabled()


def test_paused_on_the_real_clock_only() -> None:
    assert gc.isenabled()
    assert run_real(_enabled_inside()) == (False, True)
    assert run_virtual(_enabled_inside()) == (True, True)
    assert gc.get_freeze_count() == 0


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic GC frees it


async def _pile_up_garbage() -> tuple[int, bool]:
    loop = asyncio.get_running_loop()
    gc.disable()
    try:
        guard = _YoungGuard(loop, limit=2_000, interval_s=0.001)
        probe = _Node()
        ref = weakref.ref(probe)
        del probe
        for _ in range(3_000):
            _Node()
        while not guard.collections:
            await asyncio.sleep(0.001)
        guard.cancel()
        return guard.collections, ref() is None
    finally:
        gc.enable()


def test_young_guard_collects_once_the_limit_is_passed() -> None:
    assert run_real(_pile_up_garbage()) == (1, True)

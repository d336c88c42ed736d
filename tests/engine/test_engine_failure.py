"""A step loop that dies must fail every stream with the reason, never leave it waiting."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentab.clock import run_virtual
from agentab.engine import EngineRequest, build_simulator
from agentab.engine.core import EngineFailed


class FailingAfter:
    """Fault injection: the simulator's executor, raising on its n-th step."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0
        self.measured, self.needs_inputs = inner.measured, inner.needs_inputs

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, plan, inputs=None):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("device lost")
        return self.inner.execute(plan, inputs)


def test_a_dead_step_loop_fails_open_and_later_streams():
    async def main() -> None:
        eng = build_simulator("gb300-tp16-kimi-k3", fast_forward=False)
        eng.executor = FailingAfter(eng.executor, 3)
        eng.start()
        got: list[int] = []
        with pytest.raises(EngineFailed, match="RuntimeError: device lost"):
            async for ev in eng.generate(EngineRequest("a", np.arange(1, 100), 50)):
                got.append(getattr(ev, "num_tokens", 0))
        assert got == [1, 1]  # steps 1 and 2 emitted, step 3 raised
        with pytest.raises(EngineFailed):
            async for _ in eng.generate(EngineRequest("b", np.arange(1, 10), 5)):
                pass
        await eng.stop()  # does not raise again

    run_virtual(asyncio.wait_for(main(), timeout=60))


def test_a_dead_step_loop_fails_collected_requests_too():
    """`submit`'s future raises the same EngineFailed; the chunks emitted before stay readable."""

    async def main() -> None:
        eng = build_simulator("gb300-tp16-kimi-k3", fast_forward=False)
        eng.executor = FailingAfter(eng.executor, 3)
        eng.start()
        timeline = eng.submit(EngineRequest("a", np.arange(1, 100), 50))
        with pytest.raises(EngineFailed, match="RuntimeError: device lost"):
            await timeline.finished
        assert timeline.chunks()[1] == [1, 1]  # steps 1 and 2 emitted, step 3 raised
        with pytest.raises(EngineFailed):
            eng.submit(EngineRequest("b", np.arange(1, 10), 5))
        await eng.stop()

    run_virtual(asyncio.wait_for(main(), timeout=60))

"""The one step loop (Engine._loop) at its edges: stopping while a step is in flight.

With 1 ms steps, a request of three tokens emits at 1, 2 and 3 ms. Stopped at 2.5 ms, its
stream must end with what it was delivered (two tokens) and finish_reason "abort", whether its
last step was applied when it ends (one step at a time) or when it started (async scheduling,
where the request has already left the scheduler when the engine stops). Stepping one step at
a time: a decode window is cut by a request or an abort, not by `stop` (which does not wait for
the window's steps to end), so a client that wants the tokens aborts before it stops.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentab.clock import run_virtual
from agentab.engine import EngineRequest, FinalUsage, TokenEvent, build_simulator
from tests.engine.test_engine_api import FLAT_STEPS


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("collected", [False, True])
def test_stopping_mid_step_ends_streams_with_what_they_were_delivered(
    tmp_path, async_scheduling: bool, collected: bool
) -> None:
    path = tmp_path / "flat.toml"
    text = FLAT_STEPS + ("[engine]\nasync_scheduling = true  # test value\n" * async_scheduling)
    path.write_text(text)

    async def main() -> tuple[list[float], FinalUsage]:
        eng = build_simulator(path, fast_forward=False)
        eng.start()
        request = EngineRequest("a", np.arange(1, 33), 3)
        if collected:
            timeline = eng.submit(request)
            await asyncio.sleep(0.0025)
            await eng.stop()
            return timeline.chunks()[0], await timeline.finished
        events: list[TokenEvent | FinalUsage] = []

        async def consume() -> None:
            async for ev in eng.generate(request):
                events.append(ev)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.0025)
        await eng.stop()
        await task
        final = events.pop()
        assert isinstance(final, FinalUsage)
        return [ev.t for ev in events if isinstance(ev, TokenEvent)], final

    times, usage = run_virtual(main())
    assert times == pytest.approx([1e-3, 2e-3], abs=1e-12)
    assert (usage.finish_reason, usage.completion_tokens) == ("abort", 2)

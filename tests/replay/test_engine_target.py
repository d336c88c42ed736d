"""The in-process target: records from collected timelines, cancellation mid-request."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from agentab.clock import run_virtual
from agentab.engine import build_simulator
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.replay.targets.engine import EngineTarget
from agentab.workloads.model import Request, Session


def _spec(max_tokens: int) -> RequestSpec:
    request = Request(t=0.0, in_tokens=300, out_tokens=max_tokens, hash_ids=(1, 2), api_time=0.0)
    session = Session("s", 64, (request,))
    return RequestSpec("s/0", session, request, 7, max_tokens)


def test_a_finished_request_records_every_chunk_after_its_send_time() -> None:
    async def main() -> Outcome:
        target = EngineTarget(build_simulator("gb300-tp16-kimi-k3"))
        await target.start()
        await asyncio.sleep(2.0)
        out = Outcome()
        await target.send(_spec(50), out)
        await target.close()
        return out

    out = run_virtual(main())
    assert out.error_class is None and out.sent == 2.0
    # the chunks come as arrays in one piece (float64 times, int32 tokens)
    assert out.chunk_tokens is not None and out.chunk_tokens.dtype == np.int32
    times = out.chunk_times
    assert isinstance(times, np.ndarray) and times.dtype == np.float64
    assert out.completion_tokens == 50 == int(out.chunk_tokens.sum())
    assert len(times) == 50  # no drafts: one token per step
    assert times[0] > 0 and times.tolist() == sorted(times.tolist())
    assert out.end == out.sent + times[-1]


def test_a_cancelled_request_keeps_the_chunks_emitted_before_the_cancel() -> None:
    async def main() -> tuple[Outcome, float, float]:
        engine = build_simulator("gb300-tp16-kimi-k3")
        target = EngineTarget(engine)
        await target.start()
        out = Outcome()
        task = asyncio.create_task(target.send(_spec(100_000), out))
        await asyncio.sleep(3.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        cancelled_at = asyncio.get_running_loop().time()
        await asyncio.sleep(1.0)  # the abort is applied at the next step boundary
        running = engine.metrics()["vllm:num_requests_running"]
        await target.close()
        return out, cancelled_at, running

    out, cancelled_at, running = run_virtual(main())
    assert out.sent is not None
    assert 10 < len(out.chunk_times) < 100_000
    assert out.sent + out.chunk_times[-1] <= cancelled_at
    assert list(out.chunk_times) == sorted(out.chunk_times)
    assert running == 0

"""The in-process target: records from collected timelines, cancellation mid-request."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

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


def _served(intake_s: float = 0.0, output_s: float = 0.0, cancel_at: float | None = None):
    async def main() -> Outcome:
        target = EngineTarget(
            build_simulator("gb300-tp16-kimi-k3"), intake_s=intake_s, output_s=output_s
        )
        await target.start()
        out = Outcome()
        task = asyncio.ensure_future(target.send(_spec(50), out))
        if cancel_at is None:
            await task
        else:
            await asyncio.sleep(cancel_at)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await target.close()
        return out

    return run_virtual(main())


def test_a_frontend_latency_delays_every_chunk_by_intake_and_output() -> None:
    """A profile's `[frontend]` latencies: the engine has the request `intake_s` after the
    send, each chunk reaches the client `output_s` after its step, and so does the end."""
    ideal, slow = _served(), _served(intake_s=0.004, output_s=0.002)
    assert slow.error_class is None
    np.testing.assert_allclose(slow.chunk_times, ideal.chunk_times + 0.006, rtol=0, atol=1e-9)
    assert slow.chunk_tokens.tolist() == ideal.chunk_tokens.tolist()
    assert slow.end - slow.sent == ideal.end - ideal.sent + 0.006
    # cancelled while in intake: nothing reached the engine, no chunk
    early = _served(intake_s=0.004, output_s=0.002, cancel_at=0.001)
    assert len(early.chunk_times) == 0
    # cancelled mid-stream: no chunk the client would only have had later
    at = float(ideal.chunk_times[10]) + 0.006 + 1e-6
    mid = _served(intake_s=0.004, output_s=0.002, cancel_at=at)
    assert 0 < len(mid.chunk_times) <= 11 and mid.chunk_times[-1] <= at


def test_the_simulator_reads_its_frontend_latency_from_the_profile(tmp_path) -> None:
    from importlib import resources

    from agentab.engine.profile import load_profile
    from agentab.errors import AgentabError

    text = (resources.files("agentab.engine") / "profiles" / "gb300-tp16-kimi-k3.toml").read_text()
    assert load_profile("gb300-tp16-kimi-k3").frontend_intake_us == 0.0  # absent: none
    path = tmp_path / "front.toml"
    path.write_text(text + "\n[frontend]\nintake_us = 700.0\noutput_us = 1300.0\n")
    p = load_profile(path)
    assert (p.frontend_intake_us, p.frontend_output_us) == (700.0, 1300.0)
    for bad, why in (
        ("intake_us = -1.0", "must be finite and >= 0"),
        ("latency_us = 1.0", "unknown key"),
    ):
        path.write_text(text + f"\n[frontend]\n{bad}\n")
        with pytest.raises(AgentabError, match=f"frontend.{bad.split()[0]}: .*{why}"):
            load_profile(path)

"""The Engine's public contract (docs/interfaces.md) on the virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentab.clock import run_virtual
from agentab.engine import EngineRequest, FinalUsage, TokenEvent, build_simulator
from agentab.errors import AgentabError


async def _drive(engine, n_requests: int, gap_s: float, seed: int = 0):
    """Send `n_requests` random requests `gap_s` apart; return per request (events, t_seen)."""
    loop = asyncio.get_running_loop()
    out: dict[int, tuple[list, float]] = {}

    async def one(i: int) -> None:
        await asyncio.sleep(i * gap_s)
        rng = np.random.default_rng(seed * 1000 + i)
        prompt = rng.integers(1, 32000, size=int(rng.integers(10, 12000)))
        events = []
        async for ev in engine.generate(EngineRequest(f"r{i}", prompt, int(rng.integers(1, 600)))):
            events.append(ev)
        out[i] = (events, loop.time())

    engine.start()
    await asyncio.gather(*(one(i) for i in range(n_requests)))
    await engine.stop()
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_draft_tokens": 7, "acceptance_length": 6, "decode_backend": "latency_specialized"},
        {"num_draft_tokens": 3, "acceptance_probs": [0.8, 0.6, 0.4], "seed": 3},
        {"kv_blocks": 2500, "max_num_seqs": 12},
    ],
)
def test_fast_forward_equals_single_steps(options):
    """Pricing decode windows at once gives the same events as stepping one step at a time."""
    backend = options.pop("decode_backend", "auto")

    def run(ff: bool):
        eng = build_simulator("gb300-tp16-kimi-k3", backend, fast_forward=ff, **options)
        return run_virtual(_drive(eng, 60, 0.37)), eng.metrics()

    (fast, m_fast), (slow, m_slow) = run(True), run(False)
    assert m_fast == m_slow
    for i in range(60):
        ev_f, ev_s = fast[i][0], slow[i][0]
        assert [e.num_tokens for e in ev_f[:-1]] == [e.num_tokens for e in ev_s[:-1]]
        assert ev_f[-1] == ev_s[-1]
        assert np.allclose([e.t for e in ev_f[:-1]], [e.t for e in ev_s[:-1]], rtol=0, atol=1e-9)


async def _drive_collected(engine, n_requests: int, gap_s: float, seed: int = 0):
    """As `_drive`, through `Engine.submit`: per request (times, tokens, usage, t_seen)."""
    loop = asyncio.get_running_loop()
    out: dict[int, tuple[list, list, FinalUsage, float]] = {}

    async def one(i: int) -> None:
        await asyncio.sleep(i * gap_s)
        rng = np.random.default_rng(seed * 1000 + i)
        prompt = rng.integers(1, 32000, size=int(rng.integers(10, 12000)))
        timeline = engine.submit(EngineRequest(f"r{i}", prompt, int(rng.integers(1, 600))))
        usage = await timeline.finished
        out[i] = (*timeline.chunks(), usage, loop.time())

    engine.start()
    await asyncio.gather(*(one(i) for i in range(n_requests)))
    await engine.stop()
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_draft_tokens": 7, "acceptance_length": 6, "decode_backend": "latency_specialized"},
        {"num_draft_tokens": 3, "acceptance_probs": [0.8, 0.6, 0.4], "seed": 3},
        {"kv_blocks": 2500, "max_num_seqs": 12},
    ],
)
@pytest.mark.parametrize("fast_forward", [True, False])
def test_collected_timelines_equal_streamed_events(options, fast_forward):
    """`submit` (chunks collected as arrays) gives exactly the times, token counts, usage and
    end time of `generate`'s events, stepping and fast-forwarding, preemptions included."""
    backend = options.pop("decode_backend", "auto")

    def engine():
        return build_simulator("gb300-tp16-kimi-k3", backend, fast_forward=fast_forward, **options)

    streamed_engine, collected_engine = engine(), engine()
    streamed = run_virtual(_drive(streamed_engine, 60, 0.37))
    collected = run_virtual(_drive_collected(collected_engine, 60, 0.37))
    assert streamed_engine.metrics() == collected_engine.metrics()
    for i in range(60):
        (*events, final), t_seen = streamed[i]
        times, tokens, usage, t_end = collected[i]
        assert times == [e.t for e in events]
        assert tokens == [e.num_tokens for e in events]
        assert usage == final
        assert t_end == t_seen


def test_stream_contract():
    """Token events sum to max_tokens, times increase, the last one is delivered at its time."""
    eng = build_simulator("gb300-tp16-kimi-k3", num_draft_tokens=7, acceptance_length=6)
    out = run_virtual(_drive(eng, 30, 0.5, seed=1))
    for events, t_seen in out.values():
        *tokens, final = events
        assert isinstance(final, FinalUsage) and final.finish_reason == "length"
        assert all(isinstance(e, TokenEvent) for e in tokens)
        assert sum(e.num_tokens for e in tokens) == final.completion_tokens
        times = [e.t for e in tokens]
        assert times == sorted(times)
        assert t_seen == tokens[-1].t
        assert final.cached_tokens % 16 == 0


def test_abort_ends_stream():
    async def main():
        eng = build_simulator("gb300-tp16-kimi-k3")
        eng.start()
        events = []

        async def consume():
            prompt = np.arange(1, 100)
            async for ev in eng.generate(EngineRequest("a", prompt, 100000)):
                events.append(ev)

        task = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        eng.abort("a")
        await task
        metrics = eng.metrics()
        await eng.stop()
        return events, metrics

    events, metrics = run_virtual(main())
    assert events[-1].finish_reason == "abort"
    assert 0 < events[-1].completion_tokens < 100000
    assert metrics["vllm:num_requests_running"] == 0


def test_bad_options_and_requests():
    with pytest.raises(AgentabError, match="unknown bogus"):
        build_simulator("gb300-tp16-kimi-k3", bogus=1)
    with pytest.raises(AgentabError, match="decode_backend"):
        build_simulator("gb300-tp16-kimi-k3", "fast")
    with pytest.raises(AgentabError, match="exactly one of"):
        build_simulator("gb300-tp16-kimi-k3", num_draft_tokens=3)
    with pytest.raises(AgentabError, match="no such builtin profile"):
        build_simulator("nope")

    async def too_big():
        eng = build_simulator("gb300-tp16-kimi-k3", kv_blocks=10)
        async for _ in eng.generate(EngineRequest("x", np.ones(200, dtype=np.int32), 1)):
            pass

    with pytest.raises(AgentabError, match="need 13 KV blocks; the cache has 10"):
        run_virtual(too_big())


def test_describe_names_profile_and_config():
    eng = build_simulator(
        "gb300-tp16-kimi-k3", "latency_specialized", num_draft_tokens=7, acceptance_length=6
    )
    d = eng.describe()
    assert d["engine"] == "agentab-sim"
    assert d["profile"] == "gb300-tp16-kimi-k3"
    assert d["gpu_count"] == 16 and d["tp"] == 16 and d["gpu_name"] == "NVIDIA GB300"
    assert d["decode_backend"] == "latency_specialized"
    assert d["spec"] == {"method": "simulated", "num_draft_tokens": 7, "acceptance_length": 6}
    assert d["scheduler"]["kv_blocks"] == 373380
    assert len(d["profile_hash"]) == 64


def test_real_time_mode_emits_each_step_at_its_end():
    """Served over HTTP the loop is real: events arrive no earlier than their time."""
    from agentab.clock import run_real

    async def main():
        loop = asyncio.get_running_loop()
        eng = build_simulator("gb300-tp16-kimi-k3", "latency_specialized")
        eng.start()
        seen = []
        t0 = loop.time()
        async for ev in eng.generate(EngineRequest("rt", np.arange(1, 50), 8)):
            seen.append((ev, loop.time()))
        await eng.stop()
        return t0, seen

    t0, seen = run_real(main())
    *tokens, (final, _) = seen
    assert final.completion_tokens == 8 and len(tokens) == 8
    for ev, delivered in tokens:
        assert delivered >= ev.t
    # 1 prefill step + 7 specialized batch-1 decode steps of ~3.9 ms
    assert tokens[-1][0].t - t0 >= 7 * 3.9e-3

"""The Engine's public contract (docs/interfaces.md) on the virtual clock."""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path

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


GB300 = "gb300-tp16-kimi-k3"
# the fast-forward fixtures: simulator options, and "async_scheduling" for the same profile with
# [engine] async_scheduling = true (with drafts too: the local engine schedules verify steps
# ahead, and the simulator calibrated on it must do the same)
FIXTURES = [
    {},
    {"num_draft_tokens": 7, "acceptance_length": 6, "decode_backend": "latency_specialized"},
    {"num_draft_tokens": 3, "acceptance_probs": [0.8, 0.6, 0.4], "seed": 3},
    {"kv_blocks": 2500, "max_num_seqs": 12},
    {"async_scheduling": True},
    {"async_scheduling": True, "decode_backend": "latency_specialized"},
    {"decode_backend": "latency_specialized", "specialized_max_tokens": 4},
    {"async_scheduling": True, "kv_blocks": 2500, "max_num_seqs": 12},
    {"async_scheduling": True, "num_draft_tokens": 7, "acceptance_length": 6},
    {
        "async_scheduling": True,
        "num_draft_tokens": 3,
        "acceptance_probs": [0.8, 0.6, 0.4],
        "seed": 3,
        "decode_backend": "latency_specialized",
        "kv_blocks": 2500,
        "max_num_seqs": 12,
    },
]


def async_profile(tmp_path: Path) -> Path:
    """The gb300 profile with async scheduling on."""
    text = (resources.files("agentab.engine") / "profiles" / f"{GB300}.toml").read_text()
    path = tmp_path / "gb300-async.toml"
    path.write_text(text + "\n[engine]\nasync_scheduling = true  # test value\n")
    return path


def fixture_engine(options: dict, tmp_path: Path, **more):
    """A builder of a fast-forward fixture's engine (`more`: further simulator options)."""
    options = dict(options)
    backend = options.pop("decode_backend", "auto")
    profile = async_profile(tmp_path) if options.pop("async_scheduling", False) else GB300
    return lambda: build_simulator(profile, backend, **options, **more)


@pytest.mark.parametrize("options", FIXTURES)
def test_fast_forward_equals_single_steps(options, tmp_path):
    """Pricing decode windows at once gives the same events as stepping one step at a time,
    with async scheduling too (where a window is cut one step later)."""

    def run(ff: bool):
        eng = fixture_engine(options, tmp_path, fast_forward=ff)()
        return run_virtual(_drive(eng, 60, 0.37)), eng.metrics()

    (fast, m_fast), (slow, m_slow) = run(True), run(False)
    assert m_fast == m_slow
    for i in range(60):
        ev_f, ev_s = fast[i][0], slow[i][0]
        assert [e.num_tokens for e in ev_f[:-1]] == [e.num_tokens for e in ev_s[:-1]]
        assert ev_f[-1] == ev_s[-1]
        assert np.allclose([e.t for e in ev_f[:-1]], [e.t for e in ev_s[:-1]], rtol=0, atol=1e-9)


FLAT_STEPS = """
format_version = 1  # test value
name = "flat"  # test value
status = "unmeasured-placeholder"  # test value
model = "m"  # test value
gpu_name = "g"  # test value
gpu_count = 1  # test value
tp = 1  # test value
num_layers = 1  # test value
kv_layers = 1  # test value
[kv_cache]
block_size_tokens = 16  # test value
capacity_blocks = 10000  # test value
bytes_per_token_per_layer = 0.0  # test value: no KV read cost
hbm_read_bytes_per_s = 1.0  # test value
[decode]
cuda_graph_max_tokens = 512  # test value
[decode.standard]
batch_tokens = [1, 8192]  # test value
layer_time_us = [1000, 1000]  # test value: every step 1 ms
step_fixed_us = 0  # test value
[decode.specialized]
batch_tokens = [1, 8192]  # test value
layer_time_us = [1000, 1000]  # test value
step_fixed_us = 0  # test value
max_padded_tokens = 64  # test value
max_requests_by_q = [64, 32, 19, 16, 12, 10, 8, 8]  # test value
[spec_decode]
drafter_step_us = 0  # test value
[prefill]
tokens_per_s_per_gpu = 1e18  # test value: prompt tokens cost (almost) nothing
attention_flops_per_token_pair = 0.0  # test value
attention_flops_per_s_per_gpu = 1.0  # test value
mixed_decode_row_us = 500  # test value: a step with a prompt costs 0.5 ms per decode row more
"""


@pytest.mark.parametrize("fast_forward", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_arriving_during_step_k_joins_step_k_plus_2_with_async_scheduling(
    tmp_path, fast_forward, async_scheduling
):
    """Every step costs 1 ms, plus 0.5 ms per decode row when it computes a prompt. A starts
    at 0 (its prompt is step 1), B arrives at 4.5 ms, during step 5. Scheduling one step at a
    time, B's prompt is step 6 (5 to 6.5 ms, beside A's decode row); with async scheduling
    step 6 was scheduled when step 4 ended, so B's prompt is step 7 (6 to 7.5 ms), and its
    first token comes one step later. An idle engine starts a request at once either way."""
    path = tmp_path / "flat.toml"
    text = FLAT_STEPS + ("[engine]\nasync_scheduling = true  # test value\n" * async_scheduling)
    path.write_text(text)

    async def main():
        eng = build_simulator(path, fast_forward=fast_forward)
        eng.start()
        a = eng.submit(EngineRequest("a", np.arange(1, 33), 20))
        await asyncio.sleep(0.0045)
        b = eng.submit(EngineRequest("b", np.arange(1001, 1033), 3))
        await asyncio.gather(a.finished, b.finished)
        await eng.stop()
        return a.chunks()[0], b.chunks()[0]

    a_times, b_times = run_virtual(main())
    mixed_end = 7.5e-3 if async_scheduling else 6.5e-3
    assert b_times == pytest.approx([mixed_end, mixed_end + 1e-3, mixed_end + 2e-3], abs=1e-12)
    before = [1e-3 * (i + 1) for i in range(6 if async_scheduling else 5)]
    after = [mixed_end + 1e-3 * i for i in range(20 - len(before))]
    assert a_times == pytest.approx(before + after, abs=1e-12)


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


@pytest.mark.parametrize("options", FIXTURES)
@pytest.mark.parametrize("fast_forward", [True, False])
def test_collected_timelines_equal_streamed_events(options, fast_forward, tmp_path):
    """`submit` (chunks collected as arrays) gives exactly the times, token counts, usage and
    end time of `generate`'s events, stepping and fast-forwarding, preemptions included."""
    engine = fixture_engine(options, tmp_path, fast_forward=fast_forward)
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


def test_specialized_max_tokens_routes_larger_steps_to_the_standard_path():
    """Per-shape dispatch: under latency_specialized with specialized_max_tokens = 4, pure
    decode steps of up to 4 padded tokens run the specialized path and larger ones the
    standard path; the engine states the limit, and vLLM's rule (the profile's 64) is the
    default. Out-of-range values are refused by name."""

    def shares(n_requests: int, **options) -> tuple[float, float, dict]:
        eng = build_simulator(GB300, "latency_specialized", **options)
        run_virtual(_drive(eng, n_requests, 0.0, seed=4))
        m = eng.metrics()
        return (m["agentab:decode_steps_specialized_total"],
                m["agentab:decode_steps_standard_total"], eng.describe())  # fmt: skip

    special, standard, described = shares(3, specialized_max_tokens=4)
    assert described["specialized_max_tokens"] == 4
    assert special > 0  # 3 rows pad to 4 tokens, and so do 2 and 1
    assert standard == 0
    special, standard, _ = shares(8, specialized_max_tokens=4)
    assert special > 0 and standard > 0  # 8 and 5-7 rows pad to 8: standard
    special_all, standard_all, described = shares(8)
    assert described["specialized_max_tokens"] == 64
    assert special_all > 0 and standard_all == 0
    with pytest.raises(AgentabError) as err:
        build_simulator(GB300, "latency_specialized", specialized_max_tokens=65)
    assert str(err.value) == "specialized_max_tokens: expected int <= 64, got 65"


def test_bad_options_and_requests():
    known = r"^bogus: unknown option \(known: specialized_max_tokens, seed, num_draft"
    with pytest.raises(AgentabError, match=known):
        build_simulator("gb300-tp16-kimi-k3", bogus=1)
    with pytest.raises(AgentabError) as err:
        build_simulator("gb300-tp16-kimi-k3", "fast")
    assert str(err.value) == "decode_backend: expected one of auto, latency_specialized, got 'fast'"
    with pytest.raises(AgentabError) as err:
        build_simulator("gb300-tp16-kimi-k3", max_num_seqs="8")
    assert str(err.value) == "max_num_seqs: expected int, got '8'"
    with pytest.raises(AgentabError) as err:
        build_simulator("gb300-tp16-kimi-k3", kv_blocks=0)
    assert str(err.value) == "kv_blocks: expected int >= 1, got 0"
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


@pytest.mark.parametrize("fast_forward", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunks_read_part_way_and_an_abort_hold_only_steps_that_ended(
    tmp_path, fast_forward, async_scheduling
):
    """With async scheduling the scheduler is a step or two ahead of the clock; what a
    client reads part-way, and the usage of a request aborted mid-stream, cover only the
    steps that have ended (the same as scheduling one step at a time). A fast-forward window
    is committed when it is cut, so a read during one sees the steps before it."""
    path = tmp_path / "flat.toml"
    text = FLAT_STEPS + ("[engine]\nasync_scheduling = true  # test value\n" * async_scheduling)
    path.write_text(text)

    async def main():
        eng = build_simulator(path, fast_forward=fast_forward)
        a = eng.submit(EngineRequest("a", np.arange(1, 33), 20))
        events = []

        async def stream():
            async for ev in eng.generate(EngineRequest("s", np.arange(2001, 2033), 20)):
                events.append(ev)

        task = asyncio.create_task(stream())  # both prompts are step 1
        eng.start()
        await asyncio.sleep(0.0035)
        part_way = a.chunks()[0]
        eng.abort("a")
        eng.abort("s")
        usage = await a.finished
        await task
        await eng.stop()
        return part_way, a.chunks()[0], usage, events

    part_way, chunks, usage, events = run_virtual(main())
    assert part_way == pytest.approx([1e-3, 2e-3, 3e-3][: 1 if fast_forward else 3], abs=1e-12)
    assert chunks == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3], abs=1e-12)
    assert (usage.finish_reason, usage.completion_tokens) == ("abort", 4)
    *tokens, final = events
    assert [e.t for e in tokens] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3], abs=1e-12)
    assert (final.finish_reason, final.completion_tokens) == ("abort", 4)

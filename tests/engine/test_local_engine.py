"""The local engine on the CPU (tiny preset): real model steps driven by the shared scheduler.

Steps are driven one at a time here (schedule -> execute -> update, the engine loop's body),
so every count is exact; the HTTP tests drive the same engine through `agentab serve`.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.build import build_local_engine  # noqa: E402
from agentab.engine.source import engine_source_digest  # noqa: E402
from agentab.errors import AgentabError  # noqa: E402


def engine(backend: str = "auto", **options):
    return build_local_engine("tiny", backend, device="cpu", seed=3, **options)


def prompt(n: int, start: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + start) % 31999 + 1


def step(eng) -> None:
    s = eng.scheduler
    plan = s.schedule()
    out = eng.executor.execute(plan, s.model_inputs(plan))
    reqs, counts, _ = s.update(plan, out)
    for req, n in zip(reqs, counts, strict=True):
        eng.outputs.setdefault(req.id, []).extend(s.output_ids(req, n).tolist())


def run(eng, arrivals: dict[int, list[tuple[str, np.ndarray, int]]]) -> dict[str, list[int]]:
    """Add requests before the step numbers given, step until idle; the tokens of each."""
    eng.outputs = {}
    i = 0
    while True:
        for rid, p, n in arrivals.get(i, []):
            eng.scheduler.add(rid, p, n)
        if not eng.scheduler.has_work() and i >= max(arrivals):
            return eng.outputs
        if eng.scheduler.has_work():
            step(eng)
        i += 1


COUNTED = (
    "steps_standard",
    "steps_specialized",
    "decode_steps_standard",
    "decode_steps_specialized",
    "prefill_tokens_computed",
    "decode_tokens_computed",
)


def counters(eng) -> dict[str, float]:
    m = eng.metrics()
    return {name: m[f"agentab:{name}_total"] for name in COUNTED}


HAND_TRACE = {0: [("A", prompt(40, 1), 4)], 1: [("B", prompt(30, 5), 3)]}


def test_step_paths_counted_exactly_on_a_hand_built_trace():
    # step 0: A's prefill (standard); step 1: A decodes while B prefills (mixed -> standard);
    # steps 2-3: A and B both decode (pure decode -> specialized); A and B then finish.
    spec = engine("latency_specialized")
    out_spec = run(spec, HAND_TRACE)
    assert counters(spec) == {
        "steps_standard": 2,
        "steps_specialized": 2,
        "decode_steps_standard": 0,
        "decode_steps_specialized": 2,
        "prefill_tokens_computed": 70,
        "decode_tokens_computed": 5,
    }
    seconds = spec.metrics()
    assert seconds["agentab:step_seconds_specialized_total"] > 0
    assert seconds["agentab:step_seconds_standard_total"] > 0
    assert seconds["agentab:eager_steps_total"] == 4  # the CPU captures no graphs
    auto = engine("auto")
    out_auto = run(auto, HAND_TRACE)
    c = counters(auto)
    assert (c["steps_standard"], c["steps_specialized"], c["decode_steps_standard"]) == (4, 0, 2)
    assert auto.metrics()["agentab:step_seconds_specialized_total"] == 0
    # the two backends' greedy tokens are identical, and lengths are exactly max_tokens
    assert out_spec == out_auto
    assert [len(out_auto["A"]), len(out_auto["B"])] == [4, 3]


def test_specialized_max_tokens_routes_wider_decode_steps_to_the_standard_path():
    """Per-shape dispatch on the local engine: with specialized_max_tokens = 1, the two-row
    decode steps of the hand-built trace run the standard path, and the tokens are the same."""
    routed = engine("latency_specialized", specialized_max_tokens=1)
    described = routed.describe()
    assert described["specialized_max_tokens"] == 1
    assert described["specialized_max_tokens_source"] == "option"
    assert described["specialized_max_tokens_reason"] == "specialized_max_tokens = 1"
    out = run(routed, HAND_TRACE)
    c = counters(routed)
    assert (c["steps_standard"], c["steps_specialized"], c["decode_steps_standard"]) == (4, 0, 2)
    assert out == run(engine("auto"), HAND_TRACE)
    default = engine("latency_specialized").describe()
    assert default["specialized_max_tokens"] == 64
    assert default["specialized_max_tokens_source"] == "vllm-rule"
    assert default["specialized_max_tokens_reason"] == (
        "no measured dispatch for the CPU reference decoder and tiny: vLLM's rule"
    )


def test_a_cached_prefix_gives_the_same_tokens_and_skips_its_prefill():
    eng = engine("latency_specialized")
    first = run(eng, {0: [("X", prompt(40, 11), 30)]})["X"]
    # Y continues X's conversation: X's prompt and its first 25 generated tokens. The first 64
    # tokens (4 blocks of 16, 24 of them generated and hashed as they were sampled) are cached.
    y_prompt = np.concatenate([prompt(40, 11), np.array(first[:25])])
    before = counters(eng)["prefill_tokens_computed"]
    out = run(eng, {0: [("Y", y_prompt, 5)]})["Y"]
    computed = counters(eng)["prefill_tokens_computed"] - before
    assert eng.scheduler.counters["prefix_cache_hits"] == 64
    fresh = engine("latency_specialized")
    scratch = run(fresh, {0: [("Y", y_prompt, 5)]})["Y"]
    assert out == scratch == first[25:30]
    assert (computed, counters(fresh)["prefill_tokens_computed"]) == (65 - 64, 65)


@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_preempted_requests_recompute_to_the_same_tokens(backend):
    reqs = {0: [("P", prompt(60, 21), 40), ("Q", prompt(60, 33), 40)]}
    roomy = run(engine(backend), reqs)
    tight = engine(backend, kv_blocks=10)  # 160 slots: both cannot hold 100 tokens each
    squeezed = run(tight, reqs)
    assert tight.scheduler.counters["num_preemptions"] >= 1
    assert squeezed == roomy
    assert [len(v) for v in squeezed.values()] == [40, 40]


def test_a_model_that_does_not_fit_is_refused_before_allocation():
    with pytest.raises(AgentabError) as err:
        build_local_engine("k2-tp8-shard", "auto", device="cpu", kv_blocks=16)
    msg = str(err.value)
    assert msg.startswith("preset k2-tp8-shard: ")
    assert "GiB of weights (8 weight sets)" in msg and "do not fit cpu" in msg


def test_bad_options_are_named():
    known = r"^warp_factor: unknown option \(known: specialized_max_tokens, seed, "
    with pytest.raises(AgentabError, match=known):
        build_local_engine("tiny", "auto", warp_factor=9)
    with pytest.raises(AgentabError) as err:
        build_local_engine("tiny", "auto", device="tpu")
    assert str(err.value) == (
        "device: expected str matching regex '^(cpu|cuda(:[0-9]+)?)$', got 'tpu'"
    )
    with pytest.raises(AgentabError) as err:
        build_local_engine("tiny", "auto", num_layers=0)
    assert str(err.value) == "num_layers: expected int >= 1, got 0"
    with pytest.raises(AgentabError, match="unknown local-engine preset 'huge'"):
        build_local_engine("huge", "auto")
    with pytest.raises(AgentabError, match="weight_sets: 5 is more than num_layers 4"):
        build_local_engine("tiny", "auto", weight_sets=5)


def test_manifest_facts_name_the_decoder_implementation():
    facts = engine("latency_specialized").describe()
    assert facts["decoder_impl"] == "cpu-torch"
    assert facts["standard_impl"] == "torch-eager"  # the compiled path runs on the GPU only
    assert (facts["engine"], facts["preset"], facts["num_layers"], facts["weight_sets"]) == (
        "agentab-local",
        "tiny",
        4,
        2,
    )
    assert facts["gpu_count"] == 1 and facts["tp"] == 1
    assert facts["engine_source"] == engine_source_digest()  # the guard refuses mixed code
    a, b = engine("auto").describe(), facts
    assert {k for k in a if a[k] != b[k]} == {"decode_backend"}


@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_async_scheduling_gives_the_tokens_of_step_by_step_scheduling(backend):
    """With one step scheduled ahead (as on a GPU), the next step's inputs name tokens the
    step in flight is still sampling; the executor takes them from its sampled-ids buffer. The
    tokens must be exactly those of scheduling one step at a time."""
    import asyncio

    from agentab.engine.types import EngineRequest, TokenEvent

    async def serve(eng, ahead: bool) -> dict[str, list[int]]:
        eng.executor.launches_async = ahead
        eng.start()

        async def one(rid: str, p: np.ndarray, n: int) -> list[int]:
            ids: list[int] = []
            async for ev in eng.generate(EngineRequest(rid, p, n)):
                if isinstance(ev, TokenEvent):
                    ids.extend(ev.token_ids.tolist())
            return ids

        try:
            jobs = [("a", prompt(50, 3), 20), ("b", prompt(17, 9), 14), ("c", prompt(90, 4), 9)]
            outs = await asyncio.gather(*(one(*j) for j in jobs))
        finally:
            await eng.stop()
        return dict(zip("abc", outs, strict=True))

    ahead = asyncio.run(serve(engine(backend, kv_blocks=64), True))
    stepwise = asyncio.run(serve(engine(backend, kv_blocks=64), False))
    assert ahead == stepwise
    assert [len(ahead[k]) for k in "abc"] == [20, 14, 9]


def test_prefill_attention_equals_the_absorbed_form():
    """The expanded form a prefill chunk uses and the absorbed form decode uses are the same
    attention: every query of a chunk matches the absorbed computation over its visible keys."""
    from agentab.engine.local.forward import decode_attention, prefill_attention
    from agentab.kernels.config import PRESETS
    from agentab.kernels.weights import init_weights

    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 2)
    gen = torch.Generator().manual_seed(8)
    ctx = torch.randn(70, cfg.kv_width, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(30, cfg.n_heads, cfg.qk_nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(30, cfg.n_heads, cfg.qk_rope, generator=gen, dtype=torch.float64)
    positions = torch.arange(40, 70)  # a chunk after a 40-token cached prefix
    w64 = type(w)(**{k: v.double() for k, v in w.tensors().items()})
    for query_slice in (None, 7, 30):  # slices must keep each query's visible keys
        got = prefill_attention(cfg, w64, q_nope, q_pe, ctx, query_slice)
        for i, p in enumerate(positions.tolist()):
            want = decode_attention(cfg, w64, q_nope[i], q_pe[i], ctx[: p + 1])
            torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-12)


def test_a_step_observer_sees_every_step_of_the_measured_loop():
    """Step records (the engine trace) of a real model scheduled one step ahead: one per step,
    each naming its rows, also for the step that finishes a request."""
    import asyncio

    from agentab.engine.types import EngineRequest

    eng = engine("latency_specialized")
    eng.executor.launches_async = True
    records: list[dict] = []
    eng.step_observer = records.append

    async def main() -> None:
        eng.start()
        try:
            async for _ in eng.generate(EngineRequest("solo", prompt(20, 2), 3)):
                pass
        finally:
            await eng.stop()

    asyncio.run(main())
    assert [r["path"] for r in records] == ["standard", "specialized", "specialized"]
    assert [[row["id"] for row in r["requests"]] for r in records] == [["solo"]] * 3


def test_a_steps_tokens_do_not_wait_for_the_next_steps_launch():
    """Scheduled one step ahead, step k+1 is launched before step k is collected, so the device
    never waits for the host. Step k's tokens must still be handed out once step k is done,
    not after the host has finished launching step k+1 (on a GPU an eager prefill or mixed
    step's launch is host work of its own): the collect runs beside the next launch. On the
    CPU a launch computes the whole step, so a collect queued behind it would wait a step."""
    import asyncio
    import time

    from agentab.engine.types import EngineRequest, TokenEvent

    eng = engine("auto", max_num_batched_tokens=1024)
    eng.executor.launches_async = True
    launch, launched_at = eng.executor.launch, []

    def timed_launch(plan, inputs=None):
        out = launch(plan, inputs)
        launched_at.append(time.monotonic())  # the loop's clock (asyncio uses monotonic)
        return out

    eng.executor.launch = timed_launch
    first: dict[str, float] = {}

    async def one(rid: str, p: np.ndarray, n: int) -> None:
        async for ev in eng.generate(EngineRequest(rid, p, n)):
            if isinstance(ev, TokenEvent):
                first.setdefault(rid, ev.t)

    async def main() -> None:
        eng.start()
        try:  # "short" fills step 1 with a chunk of "long", whose next chunks follow
            await asyncio.gather(one("short", prompt(16, 1), 2), one("long", prompt(3000, 2), 1))
        finally:
            await eng.stop()

    asyncio.run(main())
    # step 1 computed short's prompt; step 2 (short's decode and long's next chunk) was
    # launched right behind it: short's first token is out before that launch returned
    assert first["short"] < launched_at[1], (first, launched_at)

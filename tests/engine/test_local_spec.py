"""Speculative decoding on the local engine (tiny preset, CPU): drafts, verify steps, acceptance.

Steps are driven one at a time (schedule -> execute -> update, the engine loop's body) so every
step's drafts and accepted counts are seen; the counters test serves the engine over HTTP.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.build import build_local_engine  # noqa: E402
from agentab.engine.outputs import StepOutput, StepPlan  # noqa: E402
from agentab.engine.spec_decode import SpecConfig, position_uniforms, request_key  # noqa: E402

LAYERS = 4  # the tiny preset's depth: a drafter of 4 layers is the target itself


def engine(backend: str = "auto", spec: dict | None = None, **options):
    return build_local_engine(
        "tiny", backend, device="cpu", seed=3, speculative_config=spec, **options
    )


def greedy_spec(k: int = 3, layers: int = 1) -> dict:
    return {"num_speculative_tokens": k, "draft_layers": layers}


def synthetic(k: int, length: float | None = None, rates: list | None = None) -> dict:
    spec: dict = {"num_speculative_tokens": k, "rejection_sample_method": "synthetic"}
    if length is not None:
        spec["synthetic_acceptance_length"] = length
    if rates is not None:
        spec["synthetic_acceptance_rates"] = rates
    return spec


def prompt(n: int, start: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + start) % 31999 + 1


class Driven:
    """An engine stepped by hand: each request's tokens and each step's (plan, output)."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.tokens: dict[str, list[int]] = {}
        self.steps: list[tuple[StepPlan, StepOutput]] = []
        self.requests: dict = {}

    def step(self) -> None:
        s = self.eng.scheduler
        plan = s.schedule()
        out = self.eng.executor.execute(plan, s.model_inputs(plan))
        self.steps.append((plan, out))
        reqs, counts, _ = s.update(plan, out)
        for req, n in zip(reqs, counts, strict=True):
            self.tokens.setdefault(req.id, []).extend(s.output_ids(req, n).tolist())

    def run(self, arrivals: dict[int, list[tuple[str, np.ndarray, int]]]) -> dict[str, list[int]]:
        """Add requests before the step numbers given, step until idle."""
        s = self.eng.scheduler
        i = 0
        while True:
            for rid, p, n in arrivals.get(i, []):
                self.requests[rid] = s.add(rid, p, n)
            if not s.has_work() and i >= max(arrivals):
                return self.tokens
            if s.has_work():
                self.step()
            i += 1

    def verifies(self, rid: str) -> list[tuple[int, int]]:
        """(drafts, accepted) of each verify step of request `rid`, in order."""
        key = request_key(rid)
        out = []
        for plan, output in self.steps:
            for i in np.flatnonzero((plan.keys == np.uint64(key)) & (plan.drafts > 0)):
                assert output.accepted is not None
                out.append((int(plan.drafts[i]), int(output.accepted[i])))
        return out


def run(eng, arrivals) -> Driven:
    d = Driven(eng)
    d.run(arrivals)
    return d


# four prompts arriving at different steps (mixed steps of prefill chunks and verify rows); a
# 10-token budget (below) chunks the prompts and leaves some verify rows part of their drafts
MIXED = {
    0: [("A", prompt(40, 1), 23)],
    1: [("B", prompt(6, 5), 17), ("D", prompt(5, 2), 9)],
    4: [("C", prompt(70, 9), 12)],
}


def spec_counters(eng) -> tuple[float, float, float, list[float]]:
    m = eng.metrics()
    per_pos = sorted(
        (k, v) for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")
    )
    return (
        m["vllm:spec_decode_num_drafts_total"],
        m["vllm:spec_decode_num_draft_tokens_total"],
        m["vllm:spec_decode_num_accepted_tokens_total"],
        [v for _, v in per_pos],
    )


@pytest.mark.parametrize(
    ("backend", "layers"),
    [("auto", 1), ("latency_specialized", 2), ("auto", 3), ("latency_specialized", 3)],
)
def test_greedy_verification_gives_the_tokens_of_plain_greedy_decoding(backend, layers):
    plain = run(engine(backend, max_num_batched_tokens=10), MIXED).tokens
    eng = engine(backend, greedy_spec(3, layers), max_num_batched_tokens=10)
    d = run(eng, MIXED)
    assert d.tokens == plain
    assert [len(d.tokens[r]) for r in "ABCD"] == [23, 17, 12, 9]
    drafts, draft_tokens, accepted, per_pos = spec_counters(eng)
    verify = [v for r in "ABCD" for v in d.verifies(r)]
    assert drafts == len(verify) and draft_tokens == sum(n for n, _ in verify)
    assert accepted == sum(a for _, a in verify) < draft_tokens  # drafts were rejected
    assert any(n < 3 for n, _ in verify)  # partial verify rows (the budget ran out)
    assert per_pos == [sum(a > i for _, a in verify) for i in range(3)]
    mixed = [p for p, _ in d.steps if (p.drafts > 0).any() and not p.is_decode.all()]
    assert mixed  # verify rows beside prefill chunks
    if backend == "latency_specialized":  # uniform verify steps ran the specialized path
        assert eng.metrics()["agentab:decode_steps_specialized_total"] > 0


def test_a_self_drafting_configuration_accepts_every_draft():
    """The drafter of all 4 layers is the target: its drafts are the target's greedy tokens,
    so every verify step accepts all of them, on both decode paths."""
    plain = run(engine(), MIXED).tokens
    for backend in ("auto", "latency_specialized"):
        eng = engine(backend, greedy_spec(3, LAYERS))
        d = run(eng, MIXED)
        assert d.tokens == plain
        verify = [v for r in "ABCD" for v in d.verifies(r)]
        assert verify and all(a == n == 3 for n, a in verify)
        drafts, draft_tokens, accepted, per_pos = spec_counters(eng)
        assert (drafts, draft_tokens, accepted) == (len(verify), 3 * len(verify), 3 * len(verify))
        assert per_pos == [len(verify)] * 3


def test_a_prefix_hit_on_generated_tokens_gives_the_same_tokens():
    """As the non-speculative test: Y continues X's conversation and hits 64 cached tokens, 24
    of them generated by verify steps (with their rejected drafts rolled back)."""
    eng = engine("auto", greedy_spec(3, 1))
    first = run(eng, {0: [("X", prompt(40, 11), 30)]}).tokens["X"]
    assert first == run(engine(), {0: [("X", prompt(40, 11), 30)]}).tokens["X"]
    y_prompt = np.concatenate([prompt(40, 11), np.array(first[:25])])
    out = run(eng, {0: [("Y", y_prompt, 5)]}).tokens["Y"]
    assert eng.scheduler.counters["prefix_cache_hits"] == 64
    assert out == first[25:30]


@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_preempted_requests_recompute_to_the_same_tokens(backend):
    reqs = {0: [("P", prompt(60, 21), 40), ("Q", prompt(60, 33), 40)]}
    roomy = run(engine(backend), reqs).tokens
    tight = engine(backend, greedy_spec(3, 2), kv_blocks=10)
    squeezed = run(tight, reqs).tokens
    assert tight.scheduler.counters["num_preemptions"] >= 1
    assert squeezed == roomy


def test_synthetic_length_6_with_7_drafts_accepts_5_at_every_step():
    """vLLM's schedule for L = 6, k = 7: rates [1, 1, 1, 1, 1, 0, 0]; every full verify step
    accepts positions 1-5 and rejects 6, whatever the drafts."""
    eng = engine("auto", synthetic(7, length=6))
    d = run(eng, {0: [("A", prompt(20, 1), 31), ("B", prompt(9, 4), 25)]})
    assert d.verifies("A") == [(7, 5)] * 5  # 31 tokens: the prefill's, then 5 x (5 + 1)
    assert d.verifies("B") == [(7, 5)] * 4  # 25 tokens
    _, _, accepted, per_pos = spec_counters(eng)
    assert accepted == 45 and per_pos == [9, 9, 9, 9, 9, 0, 0]
    assert eng.describe()["spec"]["synthetic_rates_resolved"] == [1, 1, 1, 1, 1, 0, 0]


def test_synthetic_non_integral_length_follows_the_schedule_and_the_simulator():
    """L = 3.8, k = 7: rates [1, 1, 0.8, 0, ...]: 2 or 3 drafts, each step as vLLM's loop
    decides it from the per-position draws, and as the simulator draws it for the same request."""
    from agentab.engine.sim import build_simulator

    eng = engine("auto", synthetic(7, length=3.8))
    d = run(eng, {0: [("R", prompt(12, 1), 120)]})
    got = d.verifies("R")
    u = position_uniforms(3, np.uint64(request_key("R")), np.arange(len(got)), 7)
    cond = [1.0, 1.0, float(np.float32(0.8 - 1e-16)), 0.0, 0.0, 0.0, 0.0]
    want = []
    for row in u:
        a = 0
        while a < 7 and row[a] < cond[a]:
            a += 1
        want.append((7, a))
    assert got == want and {a for _, a in got} == {2, 3}
    sim = build_simulator("gb300-tp16-kimi-k3", num_draft_tokens=7, acceptance_length=3.8, seed=3)
    simulated = run_priced(sim, "R", prompt(12, 1), 120)
    assert simulated == [a for _, a in got]


def run_priced(sim, rid: str, p: np.ndarray, n: int) -> list[int]:
    """Accepted drafts of each verify step of one request on the simulator, stepped."""
    s = sim.scheduler
    s.add(rid, p, n)
    out = []
    while s.has_work():
        plan = s.schedule()
        output = sim.executor.execute(plan)
        if output.accepted is not None:
            out.extend(output.accepted[plan.drafts > 0].tolist())
        s.update(plan, output)
    return out


def test_synthetic_rates_and_the_arms_agree():
    """Per-position rates given directly; both decode backends emit the same tokens (the
    accepted drafts, then the target's token), and a self-drafting synthetic run emits the
    target's greedy tokens."""
    spec = synthetic(3, rates=[0.9, 0.6, 0.3])
    a = run(engine("auto", spec), MIXED)
    b = run(engine("latency_specialized", spec), MIXED)
    assert a.tokens == b.tokens
    cfg = SpecConfig(3, acceptance_probs=(0.9, 0.6, 0.3), seed=3)
    for rid in "ABCD":
        v = a.verifies(rid)
        want = cfg.accepted(
            np.uint64(request_key(rid)), np.arange(len(v)), np.array([n for n, _ in v])
        )
        assert [x for _, x in v] == want.tolist()
    self_drafting = {**synthetic(3, length=2.5), "draft_layers": LAYERS}
    assert run(engine("auto", self_drafting), MIXED).tokens == run(engine(), MIXED).tokens


def test_rollback_leaves_the_kv_and_prefix_cache_of_a_run_that_never_drafted():
    """With a 1-layer drafter most drafts are rejected. Afterwards the prefix cache holds the
    same blocks (by key) as without speculative decoding, and their KV entries are the same
    up to rounding in a few elements (about one bf16 ulp): a position computed in a verify step of 4
    tokens goes through GEMMs of another shape than in a decode step of 1, and an fp32
    difference of 1e-7 sometimes rounds to the neighbouring bf16 value (measured: at most 6 of
    a position's 576 values in a layer). A rejected draft's entry left in a position would
    differ in nearly all of them."""
    plain = engine()
    spec = engine("auto", greedy_spec(3, 1))
    reqs = {0: [("A", prompt(40, 1), 50)], 2: [("B", prompt(33, 7), 41)]}
    d_plain, d_spec = run(plain, reqs), run(spec, reqs)
    assert d_spec.tokens == d_plain.tokens
    _, draft_tokens, accepted, _ = spec_counters(spec)
    assert draft_tokens - accepted > 60  # rejected drafts, whose KV was written and rolled back
    pools = plain.scheduler.pool, spec.scheduler.pool
    assert sorted(pools[0].hash[pools[0].hash != 0]) == sorted(pools[1].hash[pools[1].hash != 0])
    bs = 16
    for rid in "AB":
        keys = d_plain.requests[rid].hashes
        assert np.array_equal(keys, d_spec.requests[rid].hashes)
        ids = [pool.lookup(keys) for pool in pools]
        assert len(ids[0]) == len(ids[1]) == len(keys) > 0  # every full block is cached
        slots = [torch.from_numpy((i[:, None] * bs + np.arange(bs)).ravel()) for i in ids]
        kv = [
            e.executor.cache.data[:, s].float() for e, s in zip((plain, spec), slots, strict=True)
        ]
        torch.testing.assert_close(kv[0], kv[1], rtol=2**-7, atol=1e-4)  # rounding
        differing = (kv[0] != kv[1]).sum(-1)  # (layers, positions)
        assert int(differing.max()) <= 8 and float(differing.float().mean()) < 0.1


def test_the_counters_on_metrics_equal_what_the_client_saw():
    """Over HTTP, as the replay client reads vLLM: every streamed chunk after a request's first
    is one verify step's tokens (1 + accepted; with L = 6 every step emits 6, and the lengths
    avoid the max_tokens cap), so the client's own count of drafts and accepted tokens must
    equal the scraped counters, the per-position series included."""
    import aiohttp
    import orjson

    from agentab.engine.server import EngineServer, start_server
    from agentab.replay.metrics import parse_prometheus

    async def main() -> tuple[list[list[int]], list]:
        server = EngineServer(engine("auto", synthetic(7, length=6)), model="m")
        runner, port = await start_server(server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:

                async def one(p: list[int], n: int) -> list[int]:
                    body = {"prompt": p, "max_tokens": n, "stream": True}
                    sizes = []
                    async with http.post(url + "/v1/completions", json=body) as r:
                        async for raw in r.content:
                            line = raw.strip()
                            if line.startswith(b"data: {"):
                                choices = orjson.loads(line[6:])["choices"]
                                if choices:
                                    sizes.append(len(choices[0]["token_ids"]))
                    return sizes

                jobs = [
                    one(prompt(n, s).tolist(), m)
                    for n, s, m in ((30, 1, 19), (12, 5, 1), (7, 3, 13))
                ]
                sizes = await asyncio.gather(*jobs)
                async with http.get(url + "/metrics") as r:
                    samples = parse_prometheus(await r.text())
        finally:
            await runner.cleanup()
        return list(sizes), samples

    sizes, samples = asyncio.run(main())
    assert sizes[1] == [1]  # a one-token request: its prefill only
    verify = [n - 1 for chunks in sizes for n in chunks[1:]]
    assert [chunks[0] for chunks in sizes] == [1, 1, 1] and set(verify) == {5}
    got = {(name, labels.get("position")): (labels, v) for name, labels, v in samples}
    assert got["vllm:spec_decode_num_drafts_total", None][1] == len(verify)
    assert got["vllm:spec_decode_num_draft_tokens_total", None][1] == 7 * len(verify)
    assert got["vllm:spec_decode_num_accepted_tokens_total", None][1] == sum(verify)
    for i in range(7):
        labels, value = got["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i)]
        assert labels == {"model_name": "m", "position": str(i)}
        assert value == sum(a > i for a in verify)


@pytest.mark.parametrize("ahead", [False, True])
def test_the_engine_loop_serves_drafts_and_an_abort_mid_verify(ahead):
    """Through `Engine.generate` (the loop, not hand stepping), one step at a time (a verify
    step applied when collected) or scheduled ahead (applied as accepting nothing, corrected
    when collected): a client that leaves mid-stream is aborted, its step in flight dropped
    for it, and the other requests get exactly plain greedy decoding's tokens."""
    from agentab.engine.types import EngineRequest, FinalUsage, TokenEvent

    async def serve(eng, leave_after: int | None) -> dict[str, list[int]]:
        eng.executor.launches_async = ahead
        eng.start()

        async def one(rid: str, p: np.ndarray, n: int, delay: float) -> list[int]:
            await asyncio.sleep(delay)
            ids: list[int] = []
            events = 0
            async for ev in eng.generate(EngineRequest(rid, p, n)):
                if isinstance(ev, TokenEvent):
                    ids.extend(ev.token_ids.tolist())
                    events += 1
                    if rid == "gone" and leave_after is not None and events == leave_after:
                        break  # leaving the stream aborts the request
                else:
                    assert isinstance(ev, FinalUsage) and ev.completion_tokens == n
            return ids

        jobs = [("a", prompt(50, 3), 20, 0.0), ("gone", prompt(17, 9), 40, 0.0),
                ("c", prompt(90, 4), 9, 0.05)]  # fmt: skip
        try:
            outs = await asyncio.gather(*(one(*j) for j in jobs))
        finally:
            await eng.stop()
        return dict(zip(("a", "gone", "c"), outs, strict=True))

    plain = asyncio.run(serve(engine(kv_blocks=64), None))
    eng = engine("latency_specialized", greedy_spec(3, 3), kv_blocks=64)
    got = asyncio.run(serve(eng, 2))
    assert got["a"] == plain["a"] and got["c"] == plain["c"]
    assert got["gone"] == plain["gone"][: len(got["gone"])] and 1 < len(got["gone"]) < 40
    assert eng.scheduler.counters["request_abort"] == 1
    assert not eng.scheduler.requests and eng.scheduler.pool.num_free == 64


ASYNC_JOBS = [
    ("a", prompt(50, 3), 20, 0.0),
    ("b", prompt(17, 9), 14, 0.0),
    ("c", prompt(90, 4), 9, 0.02),
    ("d", prompt(5, 2), 31, 0.05),
]


async def serve_all(eng, ahead: bool, jobs=ASYNC_JOBS) -> dict[str, list[int]]:
    """Every job through `Engine.generate`, scheduled one step ahead or not (on the CPU the
    executor says not; `launches_async` makes it, as on a GPU)."""
    from agentab.engine.types import EngineRequest, FinalUsage, TokenEvent

    eng.executor.launches_async = ahead
    eng.start()

    async def one(rid: str, p: np.ndarray, n: int, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        ids: list[int] = []
        async for ev in eng.generate(EngineRequest(rid, p, n)):
            if isinstance(ev, TokenEvent):
                ids.extend(ev.token_ids.tolist())
            else:
                assert isinstance(ev, FinalUsage) and ev.completion_tokens == n == len(ids)
        return ids

    try:
        outs = await asyncio.gather(*(one(*j) for j in jobs))
    finally:
        await eng.stop()
    return dict(zip([j[0] for j in jobs], outs, strict=True))


COUNTED_SPEC = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)


def spec_metrics(eng) -> dict[str, float]:
    m = eng.metrics()
    return {k: v for k, v in m.items() if k in COUNTED_SPEC or "_per_pos" in k}


@pytest.mark.parametrize(
    ("backend", "spec", "options"),
    [
        ("auto", greedy_spec(3, 1), {}),
        ("latency_specialized", greedy_spec(3, 3), {}),
        ("auto", greedy_spec(3, LAYERS), {}),
        ("latency_specialized", synthetic(7, length=3.8), {}),
        ("auto", synthetic(3, rates=[0.9, 0.6, 0.3]), {"kv_blocks": 12}),  # preemptions
    ],
)
def test_async_scheduling_with_drafts_gives_the_tokens_and_counts_of_one_step_at_a_time(
    backend, spec, options
):
    """Scheduled one step ahead, each verify row is planned as if the step in flight accepted
    none of its drafts; the executor shifts it by what that step did accept, and the counts
    are corrected when it returns. Tokens, finishes and every spec counter must be those of
    scheduling one step at a time (greedy: plain greedy decoding's tokens)."""
    ahead_engine = engine(backend, spec, **options)
    assert ahead_engine.describe()["async_scheduling"] is False  # the CPU's own choice
    stepwise_engine = engine(backend, spec, **options)
    stepwise = asyncio.run(serve_all(stepwise_engine, False))
    ahead = asyncio.run(serve_all(ahead_engine, True))
    assert ahead_engine.describe()["async_scheduling"] is True
    assert ahead == stepwise
    assert spec_metrics(ahead_engine) == spec_metrics(stepwise_engine)
    if spec.get("rejection_sample_method") != "synthetic":
        assert ahead == asyncio.run(serve_all(engine(backend, **options), False))
    if "kv_blocks" in options:
        assert ahead_engine.scheduler.counters["num_preemptions"] >= 1
    assert not ahead_engine.scheduler.requests
    assert ahead_engine.scheduler.pool.num_free == ahead_engine.scheduler.pool.num_blocks

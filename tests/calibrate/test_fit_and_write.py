"""The fit on exact synthetic measurements (every term recovered), and the writer's rules:
what it writes loads as a profile, and a field the load could not identify is refused unless
--allow-assumed names it."""

from __future__ import annotations

import numpy as np
import pytest

from agentab.calibrate.calibrate import _with_graph_tokens
from agentab.calibrate.client import (
    DecodeMeasurement,
    Measurements,
    MixedMeasurement,
    PrefillMeasurement,
)
from agentab.calibrate.facts import EngineFacts
from agentab.calibrate.fit import fit_all
from agentab.calibrate.load import build_load
from agentab.calibrate.write import Provenance, render_profile
from agentab.engine.executor import SimExecutor
from agentab.engine.outputs import StepPlan
from agentab.engine.paths import graph_padding
from agentab.engine.profile import parse_profile
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.errors import AgentabError

BASE_US = {1: 1000.0, 2: 1100.0, 4: 1300.0, 8: 1700.0, 16: 2500.0}
KV_US = 0.05
P_US, Q_US, TAIL_US = 2.0, 0.004, 4000.0
CTX_US = 0.3  # per computed context token of a prefill row
MIX_US = 150.0  # per decode row of a step with prefill tokens
MIX_NEW = 256  # the mixed phases' prompt
BUDGET = 2048


def mixed_step_us(rows: int, context_tokens: float, new: int = MIX_NEW) -> float:
    """A step computing a prompt of `new` tokens beside `rows` decode rows, exactly as the
    step-time model prices it (the table flat at its last point beyond T = 128)."""
    return (
        TAIL_US + KV_US * context_tokens + P_US * new + Q_US * new * (new + 1) / 2 + MIX_US * rows
    )


def synthetic() -> Measurements:
    """What an engine following the step-time model exactly would have measured."""
    m = Measurements()
    for b, base in BASE_US.items():
        for ctx in (100, 900):
            context = b * (ctx + 24.0)
            step = (base + KV_US * context) * 1e-6
            m.decode.append(DecodeMeasurement(b, ctx, 40, context, step, step, 40, "standard"))
    for new, cached in ((128, 0), (512, 0), (1024, 0), (2048, 0), (128, 1024), (512, 1024)):
        pairs = new * cached + new * (new + 1) / 2
        us = TAIL_US + P_US * new + Q_US * pairs + CTX_US * cached
        m.prefill.append(PrefillMeasurement(new, cached, us * 1e-6, us * 1e-6, 1))
    for rows in (4, 8, 16):
        context = rows * 130.0
        step = mixed_step_us(rows, context) * 1e-6
        m.mixed.append(MixedMeasurement(rows, MIX_NEW, context, step, step, 2e-3))
    return m


def facts(**over: object) -> EngineFacts:
    f = EngineFacts(
        engine="vllm",
        url="http://x",
        model="m",
        version="1",
        device="cpu",
        gpu_count=1,
        tp=1,
        block_size=16,
        kv_blocks=1000,
        max_num_seqs=64,
        max_num_batched_tokens=BUDGET,
        cuda_graph_max_tokens=1,
        async_scheduling=False,
    )
    f.sources["async_scheduling"] = "/server_info"
    for k, v in over.items():
        setattr(f, k, v)
    return f


@pytest.mark.parametrize("timing", ["client", "engine"])
def test_fit_recovers_every_term_of_exact_measurements(timing: str) -> None:
    fit = fit_all(
        {"standard": synthetic()}, timing=timing, graph_max=1, max_num_batched_tokens=BUDGET
    )
    d = fit.decode["standard"]
    assert d.batch_tokens == [1, 2, 4, 8, 16]
    assert d.step_us == pytest.approx(list(BASE_US.values()), rel=1e-9)
    assert d.kv_us_per_token is not None and d.kv_us_per_token.value == pytest.approx(KV_US)
    p = fit.prefill
    assert p is not None
    assert (p.us_per_token.value, p.us_per_pair.value) == pytest.approx((P_US, Q_US))
    assert p.us_per_context_token is not None
    assert p.us_per_context_token.value == pytest.approx(CTX_US)
    assert (p.tail_tokens, p.tail_us.value) == (128, pytest.approx(TAIL_US))
    mixed = fit.mixed
    assert mixed is not None
    assert mixed.us_per_decode_row.value == pytest.approx(MIX_US)
    assert mixed.offset_us.value == pytest.approx(0.0, abs=1e-6)
    assert [r["rows"] for r in mixed.residuals] == [4, 8, 16]
    assert max(abs(r["error"]) for r in d.residuals + p.residuals + mixed.residuals) < 1e-9


def test_the_mixed_fit_reads_the_per_row_slope_beside_an_offset() -> None:
    """What the priced terms miss for the phases' prompt (client-side: the request latency
    the table's last point holds) is the same at every row count: the slope is unchanged and
    only the offset, which the profile does not carry, takes it."""
    m = synthetic()
    for r in m.mixed:
        r.client_s -= 1.5e-3
    fit = fit_all({"standard": m}, timing="client", graph_max=1, max_num_batched_tokens=BUDGET)
    assert fit.mixed is not None
    assert fit.mixed.us_per_decode_row.value == pytest.approx(MIX_US)
    assert fit.mixed.offset_us.value == pytest.approx(-1500.0)
    # the residuals are the profile's price against the measurement: 1.5 ms too high
    for r in fit.mixed.residuals:
        assert r["fitted_us"] - r["measured_us"] == pytest.approx(1500.0, abs=0.02)


def test_a_negative_slope_is_noise_set_to_zero() -> None:
    m = synthetic()
    for r in m.decode:  # the long context measured a hair faster: no KV cost to see
        r.client_step_s = BASE_US[r.batch] * 1e-6 * (0.999 if r.context == 900 else 1.0)
    fit = fit_all({"standard": m}, timing="client", graph_max=1, max_num_batched_tokens=BUDGET)
    kv = fit.decode["standard"].kv_us_per_token
    assert kv is not None and kv.value == 0.0


def render(fit_facts: EngineFacts, allowed: tuple[str, ...], kv_blocks: int | None = 1000) -> str:
    fit = fit_all(
        {"standard": synthetic()}, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET
    )
    prov = Provenance(
        "vllm", "1", "cpu", "m", "http://x", "2026-01-01", "agentab calibrate", "engine"
    )
    return render_profile(
        name="t",
        fit=fit,
        facts=fit_facts,
        provenance=prov,
        kv_blocks=kv_blocks,
        kv_blocks_tag="[E]",
        gpu_count=fit_facts.gpu_count,
        gpu_tag="[E]",
        tp=fit_facts.tp,
        allowed=allowed,
    )


def test_the_written_profile_prices_what_was_fitted() -> None:
    text = render(facts(), ("decode.specialized", "spec_decode.drafter_step_us"))
    p = parse_profile(text.encode(), "t")
    assert p.standard.batch_tokens.tolist() == [1, 2, 4, 8, 16, 128]
    assert p.standard.layer_time_us.tolist() == pytest.approx([*BASE_US.values(), TAIL_US])
    assert p.num_layers == 1 and p.standard.step_fixed_us == 0.0
    assert p.kv_read_us_per_context_token() == pytest.approx(KV_US, rel=1e-5)
    assert 1e6 / p.prefill_tokens_per_s_per_gpu == pytest.approx(P_US, rel=1e-5)
    pair_us = 1e6 * p.attention_flops_per_token_pair / p.attention_flops_per_s_per_gpu
    assert pair_us == pytest.approx(Q_US, rel=1e-5)
    assert p.prefill_context_token_us == pytest.approx(CTX_US, rel=1e-5)
    assert (p.kv_block_size_tokens, p.kv_capacity_blocks, p.cuda_graph_max_tokens) == (16, 1000, 1)
    assert p.mixed_decode_row_us == pytest.approx(MIX_US, rel=1e-5)
    assert p.async_scheduling is False
    assert "async_scheduling = false  # [E] /server_info" in text
    # the simulator prices a mixed step of the calibrated shape as it was measured
    s = Scheduler(SchedulerConfig(num_blocks=1000, max_num_batched_tokens=BUDGET))
    for i in range(8):
        s.add(f"d{i}", np.arange(1 + 1000 * i, 121 + 1000 * i), 50)
    s.update(s.schedule())  # the prompts
    s.update(s.schedule())  # one decode step
    s.add("new", np.arange(90000, 90000 + MIX_NEW), 1)
    plan = s.schedule()
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (8, MIX_NEW)
    want = mixed_step_us(8, plan.decode_context_tokens) * 1e-6
    assert SimExecutor(p, 0).step_seconds(plan) == pytest.approx(want, rel=1e-5)
    for line in text.splitlines():  # every key says where its value comes from
        if "=" in line and not line.startswith("#"):
            assert "  # " in line, line


def test_a_load_without_a_cached_prefix_cannot_identify_the_context_term() -> None:
    m = synthetic()
    m.prefill = [r for r in m.prefill if r.cached == 0]
    fit = fit_all({"standard": m}, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET)
    assert fit.prefill is not None and fit.prefill.us_per_context_token is None
    prov = Provenance("vllm", "1", "cpu", "m", "http://x", "2026-01-01", "c", "engine")
    kw = dict(name="t", fit=fit, facts=facts(), provenance=prov, kv_blocks=1000)
    kw.update(kv_blocks_tag="[E]", gpu_count=1, gpu_tag="[E]", tp=1)
    allowed = ("decode.specialized", "spec_decode.drafter_step_us")
    with pytest.raises(AgentabError, match=r"prefill\.context_token_us"):
        render_profile(**kw, allowed=allowed)
    text = render_profile(**kw, allowed=(*allowed, "prefill.context_token_us"))
    assert "context_token_us = 0.0  # [A]" in text
    assert parse_profile(text.encode(), "t").prefill_context_token_us == 0.0


def test_a_load_without_a_mixed_step_cannot_identify_the_per_row_term() -> None:
    m = synthetic()
    m.mixed = []
    fit = fit_all({"standard": m}, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET)
    assert fit.mixed is None
    prov = Provenance("vllm", "1", "cpu", "m", "http://x", "2026-01-01", "c", "engine")
    kw = dict(name="t", fit=fit, facts=facts(), provenance=prov, kv_blocks=1000)
    kw.update(kv_blocks_tag="[E]", gpu_count=1, gpu_tag="[E]", tp=1)
    allowed = ("decode.specialized", "spec_decode.drafter_step_us")
    with pytest.raises(AgentabError, match=r"prefill\.mixed_decode_row_us \(would be 0"):
        render_profile(**kw, allowed=allowed)
    text = render_profile(**kw, allowed=(*allowed, "prefill.mixed_decode_row_us"))
    assert "mixed_decode_row_us = 0.0  # [A]" in text
    assert parse_profile(text.encode(), "t").mixed_decode_row_us == 0.0


def test_async_scheduling_is_the_engines_word_or_an_assumption() -> None:
    allowed = ("decode.specialized", "spec_decode.drafter_step_us")
    text = render(
        facts(async_scheduling=True, sources={"async_scheduling": "/agentab/describe"}), allowed
    )
    assert "async_scheduling = true  # [E] /agentab/describe" in text
    assert parse_profile(text.encode(), "t").async_scheduling is True
    with pytest.raises(AgentabError, match=r"engine\.async_scheduling \(would be false"):
        render(facts(async_scheduling=None), allowed)
    text = render(facts(async_scheduling=None), (*allowed, "engine.async_scheduling"))
    assert "async_scheduling = false  # [A]" in text
    assert parse_profile(text.encode(), "t").async_scheduling is False


def test_unidentified_fields_are_refused_by_name() -> None:
    with pytest.raises(AgentabError) as err:
        render(facts(block_size=None, gpu_count=None), ("decode.specialized",), kv_blocks=None)
    msg = str(err.value)
    for field in (
        "spec_decode.drafter_step_us",
        "kv_cache.capacity_blocks",
        "kv_cache.block_size_tokens",
        "gpu_count",
    ):
        assert f"--allow-assumed {field}" in msg
    assert "--allow-assumed decode.specialized" not in msg


def test_allow_assumed_must_name_a_field_that_can_be_assumed() -> None:
    with pytest.raises(AgentabError, match=r"--allow-assumed prefill\.x: not a field"):
        render(facts(), ("decode.specialized", "spec_decode.drafter_step_us", "prefill.x"))


def test_the_load_fits_the_engine() -> None:
    sized = dict(max_model_len=2048, block_size=128, max_num_batched_tokens=2048, steps=64)
    load = build_load(**sized)
    assert {(p.batch, p.context) for p in load.decode} == {
        (b, c) for b in (1, 2, 4, 8, 16) for c in (128, 1487)
    }
    assert all(p.new + p.cached <= 2046 and p.new <= 2048 for p in load.prefill)
    # the third length after the cached prefix would not fit max_model_len here
    assert sorted({(p.new, p.cached) for p in load.prefill}) == [
        (128, 0), (128, 1024), (511, 0), (511, 1024), (1023, 0), (2046, 0),
    ]  # fmt: skip
    # the H200 A/Bs' engine: the three shortest again after 8,192 cached tokens
    h200 = build_load(max_model_len=36864, block_size=16, max_num_batched_tokens=8192,
                      batches=(1, 2, 4, 8, 16, 32, 64))  # fmt: skip
    assert sorted({(p.new, p.cached) for p in h200.prefill if p.cached}) == [
        (128, 8192), (512, 8192), (2048, 8192),
    ]  # fmt: skip
    # a prompt of the second prefill length beside a quarter, half and all of the largest batch
    assert [(p.rows, p.context, p.new) for p in load.mixed if p.repeat == 0] == [
        (4, 128, 511),
        (8, 128, 511),
        (16, 128, 511),
    ]
    assert len(load.mixed) == 9 and all(p.new + p.rows <= 2048 for p in load.mixed)
    assert {p.steps for p in load.mixed} == {64}  # the rows decode --steps tokens...
    # ...but at least 24: after the 12 steps the client waits, the prompt's way in still finds
    # them decoding
    assert {p.steps for p in build_load(**{**sized, "steps": 16}).mixed} == {24}
    # the prompt of a mixed phase takes a sequence slot beside its decode rows
    full = build_load(**sized, max_num_seqs=16)
    assert [p.rows for p in full.mixed if p.repeat == 0] == [3, 7, 15]
    assert [p.batch for p in full.decode][-1] == 16  # decode phases may fill every slot
    one = build_load(
        max_model_len=2048,
        block_size=128,
        max_num_batched_tokens=2048,
        steps=64,
        one_prefill_step=True,
    )
    assert all(p.batch * p.context <= 2047 for p in one.decode)
    assert build_load(**sized, with_mixed=False).mixed == ()  # vLLM's clock times no mixed step
    # a server that drafts k = 7 (the drafter's load): its mixed phases run verify rows of
    # 8 tokens beside a prompt shortened to fit them in the step, for 24 verify steps at least
    # (not its decode phases' 8 x 96 tokens), repeated as asked
    drafter = build_load(max_model_len=4096, block_size=16, max_num_batched_tokens=512,
                         steps=768, batches=(1, 2, 4, 8), max_num_seqs=8, prefill_repeats=0,
                         mixed_repeats=2, draft_tokens=7)  # fmt: skip
    assert drafter.prefill == ()
    assert [(p.rows, p.new, p.steps) for p in drafter.mixed if p.repeat == 0] == [
        (1, 32, 192), (3, 32, 192), (7, 32, 192),
    ]  # fmt: skip
    assert len(drafter.mixed) == 6
    tight = build_load(max_model_len=4096, block_size=16, max_num_batched_tokens=72,
                       steps=768, batches=(1, 2, 4, 8), prefill_repeats=0, mixed_repeats=1,
                       draft_tokens=7)  # fmt: skip
    # the second prefill length (18) shortened to what 8 verify rows of 8 tokens leave
    assert {p.new for p in tight.mixed} == {72 - 8 * 8}
    # no room for the prompt beside the verify rows, or one row count only: no such phase
    full = dict(max_model_len=4096, block_size=16, steps=768, batches=(1, 2, 4, 8),
                prefill_repeats=0, mixed_repeats=1, draft_tokens=7)  # fmt: skip
    assert build_load(**full, max_num_batched_tokens=64).mixed == ()
    assert build_load(**full, max_num_batched_tokens=512, max_num_seqs=2).mixed == ()
    assert len(build_load(**full, max_num_batched_tokens=512, max_num_seqs=3).mixed) == 2
    with pytest.raises(AgentabError, match="--contexts 10,5000"):
        build_load(
            max_model_len=2048, block_size=16, max_num_batched_tokens=None, contexts=(10, 5000)
        )


def test_a_refit_of_a_local_engine_report_takes_async_scheduling_from_its_device() -> None:
    """Reports written before the engines stated async scheduling: the local engine schedules
    one step ahead exactly on a GPU; nothing is inferred for other engines."""
    from agentab.calibrate.facts import local_engine_schedules_ahead

    for engine, device, want in (
        ("agentab-local", "cuda", True),
        ("agentab-local", "cpu", False),
        ("vllm", "cuda", None),
    ):
        f = facts(engine=engine, device=device, async_scheduling=None, sources={})
        local_engine_schedules_ahead(f)
        assert f.async_scheduling is want


def test_the_frontend_latency_is_what_the_steps_leave_out_of_the_clients_ttft() -> None:
    """Engine clock: each prefill request's client TTFT less its step time, split by the
    server's own stamps where it exports them (the network counted half each way)."""
    from agentab.calibrate.fit import fit_frontend

    split = {"intake": 0.2e-3, "queue": 0.1e-3, "prefill": 8.5e-3, "output": 0.4e-3}
    rows = [
        PrefillMeasurement(16, 0, 10e-3, 8e-3, 1, split),  # 0.8 ms beyond the server's parts
        PrefillMeasurement(128, 0, 12e-3, 10e-3, 1, {**split, "prefill": 10.5e-3}),
        PrefillMeasurement(512, 0, 30e-3, 27e-3, 1, {**split, "prefill": 28.5e-3, "queue": 1e-3}),
    ]
    f = fit_frontend(rows)
    assert f is not None and f.split == "server"
    assert [round(r["intake_us"], 6) for r in f.requests] == [700.0, 700.0, 1150.0]
    assert [round(r["output_us"], 6) for r in f.requests] == [1300.0, 1300.0, 1850.0]
    assert (round(f.intake_us, 6), round(f.output_us, 6)) == (700.0, 1300.0)  # medians
    # without the server's split the whole difference is charged to intake
    bare = fit_frontend([PrefillMeasurement(16, 0, 10e-3, 8e-3, 1)])
    assert bare is not None and bare.split == "client"
    assert (round(bare.intake_us, 6), bare.output_us) == (2000.0, 0.0)
    # the client's clock has no step time to take away: nothing is fitted
    assert fit_frontend([PrefillMeasurement(16, 0, 10e-3)]) is None


@pytest.mark.parametrize("timing", ["client", "engine"])
def test_the_profile_states_the_frontend_latency_only_with_the_engines_clock(timing) -> None:
    m = synthetic()
    for p in m.prefill:  # 1.5 ms outside the step on every request
        p.ttft_s += 1.5e-3
    fit = fit_all({"standard": m}, timing=timing, graph_max=1, max_num_batched_tokens=BUDGET)
    text = render_profile(
        name="t",
        fit=fit,
        facts=facts(),
        provenance=Provenance("vllm", "1", "cpu", "m", "http://x", "d", "c", timing),
        kv_blocks=1000,
        kv_blocks_tag="[E]",
        gpu_count=1,
        gpu_tag="[E]",
        tp=1,
        allowed=("decode.specialized", "spec_decode.drafter_step_us"),
    )
    p = parse_profile(text.encode(), "t")
    if timing == "engine":
        assert "[frontend]" in text
        assert (p.frontend_intake_us, p.frontend_output_us) == pytest.approx((1500.0, 0.0))
    else:  # the prefill table's last point holds it
        assert "[frontend]" not in text.replace("# [frontend]", "")
        assert (p.frontend_intake_us, p.frontend_output_us) == (0.0, 0.0)


# medians of a vLLM CPU build's calibration (tiny model, engine clock, us): (new, cached) -> time
VLLM_CPU_PREFILL_US = {
    (128, 0): 25747.7,
    (128, 1024): 35711.7,
    (511, 0): 64598.7,
    (511, 1024): 93826.1,
    (1023, 0): 127798.9,
    (2046, 0): 237546.5,
}


def test_prefill_is_fitted_for_relative_error_so_the_shortest_prompt_pins_the_tail() -> None:
    """Unweighted, these points give the table's prefill point 9630 +- 10092 us (below zero
    within its noise, which makes the profile unwritable) and miss the shortest prompt by
    21%; fitted for relative error, every point is within 10%."""
    m = synthetic()
    m.prefill = [
        PrefillMeasurement(new, cached, us * 1e-6, us * 1e-6, 1)
        for (new, cached), us in VLLM_CPU_PREFILL_US.items()
    ]
    fit = fit_all({"standard": m}, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET)
    p = fit.prefill
    assert p is not None and p.tail_tokens == 128
    assert p.tail_us.value == pytest.approx(13159.8, abs=0.1)
    assert p.tail_us.stderr == pytest.approx(3860.8, abs=0.1)
    assert max(abs(r["error"]) for r in p.residuals) == pytest.approx(0.0943, abs=1e-4)


def test_the_verify_rows_context_term_is_recovered_from_the_drafter_phases() -> None:
    """A server that drafts k = 1 runs verify steps of b rows x 2 tokens: each costs the
    standard table at 2b tokens, the KV read, the drafter and `verify_context_token_us` per
    context token per draft token. The fit recovers it, the written profile carries it, and a
    report that predates the load's `draft_tokens` gives k by its step counts."""
    from agentab.calibrate.calibrate import _loaded_draft_tokens
    from agentab.calibrate.fit import DRAFTER

    verify_us, draft_step_us, draft_row_us = 0.02, 400.0, 30.0
    drafter = Measurements()
    for b in (1, 2, 4, 8):
        for ctx in (100, 900):
            context = b * (ctx + 24.0)
            draft = draft_step_us + draft_row_us * b
            us = BASE_US[2 * b] + KV_US * context + draft + verify_us * 1 * context
            drafter.decode.append(
                DecodeMeasurement(b, ctx, 40, context, us * 1e-6, us * 1e-6, 40, "standard",
                                  engine_draft_s=draft * 1e-6, engine_draft_steps=40)
            )  # fmt: skip
    measured = {"standard": synthetic(), DRAFTER: drafter}
    fit = fit_all(measured, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET,
                  draft_tokens=1)  # fmt: skip
    d = fit.drafter
    assert d is not None and d.verify_context_us is not None
    assert (d.step_us.value, d.row_us.value) == pytest.approx((draft_step_us, draft_row_us))
    assert d.verify_context_us.value == pytest.approx(verify_us)
    assert len(d.verify_residuals) == 8
    assert max(abs(r["error"]) for r in d.verify_residuals) < 1e-9
    # without k, or with one context only, there is no such term
    assert fit_all(measured, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET
                   ).drafter.verify_context_us is None  # fmt: skip
    prov = Provenance(
        "vllm", "1", "cpu", "m", "http://x", "2026-01-01", "agentab calibrate", "engine"
    )
    text = render_profile(
        name="t", fit=fit, facts=facts(), provenance=prov, kv_blocks=1000, kv_blocks_tag="[E]",
        gpu_count=1, gpu_tag="[E]", tp=1, allowed=("decode.specialized",),
    )  # fmt: skip
    assert parse_profile(text.encode(), "t").verify_context_token_us == pytest.approx(verify_us)
    # k from the load: as recorded, else by the drafter phases' (1 + k) times as many steps
    assert _loaded_draft_tokens({"standard": {"decode": [(1, 64, 96)]}}) == 0
    recorded = {"decode": [(1, 64, 768)], "draft_tokens": 7}
    assert _loaded_draft_tokens({"standard": {"decode": [(1, 64, 96)]}, DRAFTER: recorded}) == 7
    older = {"standard": {"decode": [(1, 64, 96)]}, DRAFTER: {"decode": [(1, 64, 384)]}}
    assert _loaded_draft_tokens(older) == 3


def mixed_verify_plan(rows: int, computed: int, k: int, new: int) -> StepPlan:
    """A step of a server that drafts k: `rows` verify rows of 1 + k tokens beside a prompt of
    `new` tokens (computed from the start)."""
    n = rows + 1
    num_sched = np.array([1 + k] * rows + [new], dtype=np.int64)
    return StepPlan(
        slots=np.arange(n, dtype=np.int64), num_sched=num_sched,
        computed_before=np.array([computed] * rows + [0], dtype=np.int64),
        is_decode=np.array([True] * rows + [False]),
        drafts=np.array([k] * rows + [0], dtype=np.int64),
        keys=np.arange(n, dtype=np.int64), spec_index=np.zeros(n, dtype=np.int64),
        path="standard", total_tokens=int(num_sched.sum()), padded_tokens=int(num_sched.sum()),
        preempted=[], num_running=n, num_waiting=0,
    )  # fmt: skip


def test_the_verify_rows_cost_in_a_mixed_step_is_recovered_from_a_simulator_that_prices_it() -> (
    None
):
    """The drafter's mixed phases run a prompt beside verify rows of 1 + k tokens. A simulator
    whose profile prices `mixed_verify_row_us` times them (each step priced by
    SimExecutor.step_seconds); the fit recovers the value, writes it [C], and the profile
    it writes prices those steps as the simulator did."""
    from agentab.calibrate.fit import DRAFTER

    k, truth_us, computed = 1, 420.0, 130
    drafter = Measurements()
    for b in (1, 2, 4, 8):
        for ctx in (100, 900):
            context = b * (ctx + 24.0)
            draft = 400.0 + 30.0 * b
            us = BASE_US[2 * b] + KV_US * context + draft + 0.02 * context
            drafter.decode.append(
                DecodeMeasurement(b, ctx, 40, context, us * 1e-6, us * 1e-6, 40, "standard",
                                  engine_draft_s=draft * 1e-6, engine_draft_steps=40)
            )  # fmt: skip
    measured = {"standard": synthetic(), DRAFTER: drafter}
    prov = Provenance(
        "agentab-local", "1", "cpu", "m", "http://x", "2026-01-01", "agentab calibrate", "engine"
    )

    def render_fit(fit: object) -> str:
        return render_profile(
            name="t", fit=fit, facts=facts(), provenance=prov, kv_blocks=1000,
            kv_blocks_tag="[E]", gpu_count=1, gpu_tag="[E]", tp=1,
            allowed=("decode.specialized",),
        )  # fmt: skip

    first = fit_all(measured, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET,
                    draft_tokens=k)  # fmt: skip
    assert first.drafter is not None and first.drafter.mixed_verify is None
    text = render_fit(first)
    assert "mixed_verify_row_us" not in text  # no mixed phase on the drafter: no such key
    truth = parse_profile(
        text.replace("[spec_decode]\n", f"[spec_decode]\nmixed_verify_row_us = {truth_us}\n")
        .encode(), "truth",
    )  # fmt: skip
    sim = SimExecutor(truth, num_draft_tokens=k)
    for rows in (2, 4, 7):
        for _ in range(3):
            s = sim.step_seconds(mixed_verify_plan(rows, computed, k, MIX_NEW))
            measured[DRAFTER].mixed.append(
                MixedMeasurement(rows, MIX_NEW, rows * (computed + 1.0), s, s, 2e-3)
            )
    fit = fit_all(measured, timing="engine", graph_max=1, max_num_batched_tokens=BUDGET,
                  draft_tokens=k)  # fmt: skip
    mv = fit.drafter.mixed_verify
    assert mv is not None and [r["rows"] for r in mv.residuals] == [2, 4, 7]
    assert mv.us_per_decode_row.value == pytest.approx(truth_us, rel=1e-4)
    assert mv.offset_us.value == pytest.approx(0.0, abs=0.5)
    assert max(abs(r["error"]) for r in mv.residuals) < 1e-5
    written = parse_profile(render_fit(fit).encode(), "t")
    assert written.mixed_verify_row_us == pytest.approx(truth_us, rel=1e-4)
    plan = mixed_verify_plan(4, computed, k, MIX_NEW)
    assert SimExecutor(written, num_draft_tokens=k).step_seconds(plan) == pytest.approx(
        sim.step_seconds(plan), rel=1e-5
    )
    # the field prices verify rows of mixed steps only: without drafts, or without the field,
    # the step is priced as before
    before = parse_profile(text.encode(), "t")
    assert SimExecutor(truth).step_seconds(plan) == SimExecutor(before).step_seconds(plan)
    without = SimExecutor(before, num_draft_tokens=k).step_seconds(plan)
    assert sim.step_seconds(plan) - without == pytest.approx(4 * truth_us * 1e-6, rel=1e-9)


def test_the_specialized_path_is_timed_up_to_the_engines_own_limit() -> None:
    """A local engine with `specialized_max_tokens` runs wider steps on the standard path
    (as the simulator does with the same option): the specialized server's decode phases stop
    there, so no standard-path step is fitted into the specialized table."""
    from agentab.calibrate.calibrate import specialized_limit

    assert specialized_limit(facts()) == 64  # vLLM states no such limit: the path's own
    assert specialized_limit(facts(raw={"specialized_max_tokens": 16})) == 16
    assert specialized_limit(facts(raw={"specialized_max_tokens": 128})) == 64


GRAPHS = (128, 256, 384, 512, 1024)  # an engine's prefill graph sizes (steps pad up to them)


def padded_engine() -> Measurements:
    """The synthetic engine, its prefill and mixed steps padded up to GRAPHS: each padded token
    costs a prompt token (P_US); prompts off the sizes, and mixed steps whose rows push the
    step past MIX_NEW, pay for it."""
    m = synthetic()
    m.prefill = []
    for new, cached in ((128, 0), (300, 0), (700, 0), (2048, 0), (100, 1024), (450, 1024)):
        pairs = new * cached + new * (new + 1) / 2
        pad = graph_padding(new, GRAPHS)
        us = TAIL_US + P_US * (new + pad) + Q_US * pairs + CTX_US * cached
        m.prefill.append(PrefillMeasurement(new, cached, us * 1e-6, us * 1e-6, 1))
    for r in m.mixed:
        us = mixed_step_us(r.rows, r.context_tokens) + P_US * graph_padding(
            r.rows + MIX_NEW, GRAPHS
        )
        r.client_s = r.engine_s = us * 1e-6
    return m


def test_the_fit_counts_a_steps_graph_padding_as_prompt_tokens() -> None:
    """With the engine's graph sizes every term of a padding engine is recovered exactly; without
    them the same measurements leave residuals, and the per-row slope takes the padding that
    shrinks as rows fill the graph."""
    kw = {"timing": "engine", "graph_max": 1, "max_num_batched_tokens": BUDGET}
    fit = fit_all({"standard": padded_engine()}, graph_tokens=GRAPHS, **kw)
    p, mixed = fit.prefill, fit.mixed
    assert p is not None and mixed is not None
    assert (p.us_per_token.value, p.us_per_pair.value) == pytest.approx((P_US, Q_US))
    assert p.us_per_context_token is not None
    assert p.us_per_context_token.value == pytest.approx(CTX_US)
    assert mixed.us_per_decode_row.value == pytest.approx(MIX_US)
    assert max(abs(r["error"]) for r in p.residuals + mixed.residuals) < 1e-9
    blind = fit_all({"standard": padded_engine()}, **kw)
    assert blind.prefill is not None and blind.mixed is not None
    assert max(abs(r["error"]) for r in blind.prefill.residuals) > 1e-3
    assert blind.mixed.us_per_decode_row.value < MIX_US


def test_the_profile_states_the_graph_sizes_and_where_they_came_from() -> None:
    described = facts(prefill_graph_tokens=list(GRAPHS))
    described.sources["prefill_graph_tokens"] = "/agentab/describe"
    text = render(described, ("decode.specialized", "spec_decode.drafter_step_us"))
    assert "graph_tokens = [128, 256, 384, 512, 1024]  # [E] /agentab/describe" in text
    assert parse_profile(text.encode(), "t").prefill_graph_tokens == GRAPHS
    stated = _with_graph_tokens(facts(), GRAPHS)
    text = render(stated, ("decode.specialized", "spec_decode.drafter_step_us"))
    assert "graph_tokens = [128, 256, 384, 512, 1024]  # [U] --prefill-graph-tokens" in text
    plain = render(facts(), ("decode.specialized", "spec_decode.drafter_step_us"))
    assert "graph_tokens" not in plain
    assert parse_profile(plain.encode(), "t").prefill_graph_tokens == ()


def test_stated_graph_sizes_must_agree_with_the_engines_and_increase() -> None:
    assert _with_graph_tokens(facts(), None).prefill_graph_tokens is None
    same = _with_graph_tokens(facts(prefill_graph_tokens=[16, 32]), (16, 32))
    assert same.prefill_graph_tokens == [16, 32]
    with pytest.raises(AgentabError, match=r"--prefill-graph-tokens \[16, 64\]: the engine "):
        _with_graph_tokens(facts(prefill_graph_tokens=[16, 32]), (16, 64))
    with pytest.raises(AgentabError, match=r"--prefill-graph-tokens \[64, 16\]: must be strictly"):
        _with_graph_tokens(facts(), (64, 16))


def test_the_local_engines_described_graph_sizes_become_a_fact() -> None:
    from agentab.calibrate.facts import _agentab_facts

    described = {"engine": "agentab-local", "device": "cuda", "scheduler": {"max_num_seqs": 8}}
    on = _agentab_facts("http://x", {**described, "prefill_graph_tokens": [16, 32, 2048]})
    assert on.prefill_graph_tokens == [16, 32, 2048]
    assert on.sources["prefill_graph_tokens"] == "/agentab/describe"
    off = _agentab_facts("http://x", {**described, "prefill_graph_tokens": None})
    assert off.prefill_graph_tokens is None and "prefill_graph_tokens" not in off.sources

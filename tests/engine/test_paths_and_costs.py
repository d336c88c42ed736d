"""Decode-path selection at the per-q request limits, and step prices from the profile."""

from __future__ import annotations

import numpy as np
import pytest

from agentab.engine.executor import SimExecutor
from agentab.engine.options import DecodeBackend
from agentab.engine.outputs import WindowPlan
from agentab.engine.paths import graph_padding, padded_tokens, specialized_ok
from agentab.engine.profile import load_profile
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.spec_decode import SpecConfig

LIMITS = (64, 32, 19, 16, 12, 10, 8, 8)  # docs/engine.md, "Decode paths", q = 1..8


def decoding_scheduler(q: int, n: int, specialized: bool = True) -> Scheduler:
    """n requests, all past prefill, verifying q = 1 + k tokens per step."""
    k = q - 1
    spec = SpecConfig(num_draft_tokens=k, acceptance_length=1 if k else None)
    s = Scheduler(
        SchedulerConfig(
            num_blocks=10000,
            block_size=16,
            max_num_batched_tokens=8192,
            spec=spec,
            decode_backend=DecodeBackend.LATENCY_SPECIALIZED if specialized else DecodeBackend.AUTO,
        )
    )
    for i in range(n):
        s.add(f"r{i}", np.arange(1 + 100 * i, 33 + 100 * i), 100)
    plan = s.schedule()  # all prompts in one step
    assert plan.path == "standard" and plan.num_prefill_tokens == 32 * n
    s.update(plan)
    return s


@pytest.mark.parametrize("q", range(1, 9))
def test_path_at_the_request_limit_and_just_above(q):
    limit = LIMITS[q - 1]
    at = decoding_scheduler(q, limit).schedule()
    assert at.num_sched.tolist() == [q] * limit
    assert at.path == "specialized"
    assert at.padded_tokens <= 64
    above = decoding_scheduler(q, limit + 1).schedule()
    assert above.path == "standard"
    # the same step under decode_backend=auto always runs standard
    assert decoding_scheduler(q, limit, specialized=False).schedule().path == "standard"


def test_padding_and_limits_table():
    assert [padded_tokens(t, 512) for t in (1, 2, 3, 4, 5, 8, 9, 57, 64, 65, 512, 513)] == [
        1, 2, 4, 4, 8, 8, 16, 64, 64, 72, 512, 513,
    ]  # fmt: skip
    # q = 7: 9 requests pad to 64 tokens, but the limit is 8 requests
    assert not specialized_ok(np.full(9, 7), 6, 64, LIMITS, 512)
    # a step whose rows are not all the same q (partial drafts) never runs specialized
    assert not specialized_ok(np.array([8, 8, 5]), 7, 64, LIMITS, 512)
    # q = 1 rows while speculative decoding is on are not a uniform verify of k drafts
    assert not specialized_ok(np.ones(4, dtype=int), 7, 64, LIMITS, 512)


def test_mixed_step_runs_standard():
    s = decoding_scheduler(1, 4)
    s.add("late", np.arange(90000, 90040), 10)
    plan = s.schedule()
    assert plan.num_decode_tokens == 4 and plan.num_prefill_tokens == 40
    assert plan.path == "standard"


def test_step_prices_from_the_gb300_profile():
    prof = load_profile("gb300-tp16-kimi-k3")
    ex = SimExecutor(prof, 0)
    kv = 56 * 656 / 8.0e12 * 1e6  # us per context token
    s = decoding_scheduler(1, 1)
    plan = s.schedule()  # one decode row: computed 32, 1 token -> 33 context tokens
    assert plan.path == "specialized"
    assert ex.step_seconds(plan) == pytest.approx((36.2 + 56 * 69.0 + 33 * kv) * 1e-6, rel=1e-12)
    s = decoding_scheduler(1, 1, specialized=False)
    plan = s.schedule()
    assert ex.step_seconds(plan) == pytest.approx((52.3 + 56 * 130.0 + 33 * kv) * 1e-6, rel=1e-12)
    # 3 rows pad to 4 tokens: the table at 4
    plan = decoding_scheduler(1, 3).schedule()
    assert plan.padded_tokens == 4
    want = 36.2 + 56 * 89.6 + 3 * 33 * kv
    assert ex.step_seconds(plan) == pytest.approx(want * 1e-6, rel=1e-12)
    # a prefill of 1000 tokens from scratch: standard at T=1000 (clipped to the 512 entry)
    # + 1000 / (31250 * 16) s + causal pairs 1000 * 1001 / 2 * 2.294e6 / (1e15 * 16) s
    s = Scheduler(SchedulerConfig(num_blocks=1000))
    s.add("p", np.arange(1, 1001), 5)
    plan = s.schedule()
    want_us = 52.3 + 56 * 650.68 + 1000 / (31250 * 16) * 1e6 + 500500 * 2.294e6 / 16e15 * 1e6
    assert SimExecutor(prof, 0).step_seconds(plan) == pytest.approx(want_us * 1e-6, rel=1e-12)


def test_drafter_cost_on_decode_steps_only_when_speculating():
    prof = load_profile("gb300-tp16-kimi-k3")
    s = decoding_scheduler(8, 1)
    plan = s.schedule()
    assert plan.path == "specialized" and plan.padded_tokens == 8
    kv = 56 * 656 / 8.0e12 * 1e6
    want = 36.2 + 56 * 115.13 + 967.2 + (32 + 8) * kv
    assert SimExecutor(prof, 7).step_seconds(plan) == pytest.approx(want * 1e-6, rel=1e-12)


def verify_window(steps: int) -> WindowPlan:
    """A window of `steps` verify steps of 3 rows x 8 tokens over 120 context tokens a step."""
    return WindowPlan(
        slots=np.arange(3), q=8, path="standard", padded_tokens=24,
        emitted=np.ones((steps, 3), dtype=np.int64), accepted=np.zeros((steps, 3), dtype=np.int64),
        context=np.full(steps, 120), computed0=np.zeros(3, dtype=np.int64),
        cum_uncapped=np.ones((steps, 3), dtype=np.int64), num_running=3, num_waiting=0,
    )  # fmt: skip


def test_the_drafter_pays_per_row_it_drafts_for_when_the_profile_prices_it():
    """[spec_decode] drafter_row_us: per row that drafts, on a verify step and on every step
    of a window of them; nothing without drafts; profiles without the key price it 0."""
    import dataclasses

    prof = load_profile("gb300-tp16-kimi-k3")
    assert prof.drafter_row_us == 0.0
    priced = dataclasses.replace(prof, drafter_row_us=250.0)
    s = decoding_scheduler(8, 3, specialized=False)
    plan = s.schedule()
    assert int(np.count_nonzero(plan.drafts)) == 3
    extra = SimExecutor(priced, 7).step_seconds(plan) - SimExecutor(prof, 7).step_seconds(plan)
    assert extra == pytest.approx(3 * 250.0 * 1e-6, rel=1e-9)
    plain = decoding_scheduler(1, 3, specialized=False).schedule()
    assert SimExecutor(priced, 0).step_seconds(plain) == SimExecutor(prof, 0).step_seconds(plain)
    steps = 4
    window = verify_window(steps)
    diff = SimExecutor(priced, 7).window_seconds(window)
    diff -= SimExecutor(prof, 7).window_seconds(window)
    assert diff == pytest.approx(np.full(steps, 3 * 250.0 * 1e-6), rel=1e-9)


def test_a_verify_row_pays_its_context_per_draft_token_when_the_profile_prices_it():
    """[spec_decode] verify_context_token_us: per context token per draft token of a verify
    row, on a verify step (as a step of its own and in a window) and on a step that also
    carries a prompt; nothing on plain decode rows; profiles without the key price it 0."""
    import dataclasses

    prof = load_profile("gb300-tp16-kimi-k3")
    assert prof.verify_context_token_us == 0.0
    priced = dataclasses.replace(prof, verify_context_token_us=0.5)
    s = decoding_scheduler(8, 3, specialized=False)
    plan = s.schedule()
    ctx = plan.computed_before + plan.num_sched
    assert ctx.tolist() == [40, 40, 40] and plan.drafts.tolist() == [7, 7, 7]
    extra = SimExecutor(priced, 7).step_seconds(plan) - SimExecutor(prof, 7).step_seconds(plan)
    assert extra == pytest.approx(0.5 * 7 * 120 * 1e-6, rel=1e-9)
    plain = decoding_scheduler(1, 3, specialized=False).schedule()
    assert SimExecutor(priced, 0).step_seconds(plain) == SimExecutor(prof, 0).step_seconds(plain)
    s.update(plan)
    s.add("p", np.arange(5000, 5100), 5)  # a prompt joins the verify rows: a mixed step
    mixed = s.schedule()
    assert mixed.num_prefill_tokens == 100
    verify = mixed.is_decode & (mixed.drafts > 0)
    vctx = int((mixed.drafts[verify] * (mixed.computed_before + mixed.num_sched)[verify]).sum())
    assert vctx > 0
    extra = SimExecutor(priced, 7).step_seconds(mixed) - SimExecutor(prof, 7).step_seconds(mixed)
    assert extra == pytest.approx(0.5 * vctx * 1e-6, rel=1e-9)
    steps = 4
    window = verify_window(steps)
    diff = SimExecutor(priced, 7).window_seconds(window)
    diff -= SimExecutor(prof, 7).window_seconds(window)
    assert diff == pytest.approx(np.full(steps, 0.5 * 7 * 120 * 1e-6), rel=1e-9)


def test_a_prefill_chunk_pays_for_its_computed_context_when_the_profile_prices_it():
    """[prefill] context_token_us: per token a prefill row has already computed (here the
    first chunk's 512), per step; profiles without the key price it 0."""
    import dataclasses

    prof = load_profile("gb300-tp16-kimi-k3")
    assert prof.prefill_context_token_us == 0.0
    priced = dataclasses.replace(prof, prefill_context_token_us=2.0)
    s = Scheduler(SchedulerConfig(num_blocks=1000, max_num_batched_tokens=512))
    s.add("p", np.arange(1, 1001), 5)
    first = s.schedule()
    assert first.num_prefill_tokens == 512
    assert SimExecutor(priced, 0).step_seconds(first) == SimExecutor(prof, 0).step_seconds(first)
    s.update(first)
    second = s.schedule()
    assert second.num_prefill_tokens == 488 and int(second.computed_before.sum()) == 512
    extra = SimExecutor(priced, 0).step_seconds(second) - SimExecutor(prof, 0).step_seconds(second)
    assert extra == pytest.approx(2.0 * 512 * 1e-6, rel=1e-9)


def test_a_mixed_step_pays_per_decode_row_when_the_profile_prices_it():
    """[prefill] mixed_decode_row_us: per decode row of a step that also computes a prompt;
    a decode-only step and a prefill-only step pay nothing; profiles without the key price 0."""
    import dataclasses

    prof = load_profile("gb300-tp16-kimi-k3")
    assert prof.mixed_decode_row_us == 0.0
    priced = dataclasses.replace(prof, mixed_decode_row_us=1800.0)
    plain, per_row = SimExecutor(prof, 0), SimExecutor(priced, 0)
    s = decoding_scheduler(1, 5, specialized=False)
    decode_only = s.schedule()
    assert per_row.step_seconds(decode_only) == plain.step_seconds(decode_only)
    s.add("late", np.arange(90000, 90300), 10)
    mixed = s.schedule()
    assert mixed.num_decode_tokens == 5 and mixed.num_prefill_tokens == 300
    extra = per_row.step_seconds(mixed) - plain.step_seconds(mixed)
    assert extra == pytest.approx(5 * 1800.0 * 1e-6, rel=1e-9)
    fresh = Scheduler(SchedulerConfig(num_blocks=1000))
    fresh.add("p", np.arange(1, 301), 5)
    prefill_only = fresh.schedule()
    assert per_row.step_seconds(prefill_only) == plain.step_seconds(prefill_only)


def test_a_verify_row_of_a_mixed_step_pays_its_own_row_cost_when_the_profile_prices_it():
    """[spec_decode] mixed_verify_row_us: per verify row of a step that also computes a
    prompt, beside mixed_decode_row_us; pure verify steps (as a step and in a window), plain
    decode rows of a mixed step and an engine without drafts pay nothing."""
    import dataclasses

    prof = dataclasses.replace(load_profile("gb300-tp16-kimi-k3"), mixed_decode_row_us=100.0)
    assert prof.mixed_verify_row_us == 0.0
    priced = dataclasses.replace(prof, mixed_verify_row_us=700.0)
    s = decoding_scheduler(4, 3, specialized=False)
    verify_only = s.schedule()
    assert verify_only.drafts.tolist() == [3, 3, 3] and verify_only.num_prefill_tokens == 0
    assert SimExecutor(priced, 3).step_seconds(verify_only) == SimExecutor(prof, 3).step_seconds(
        verify_only
    )
    s.update(verify_only)
    s.add("p", np.arange(5000, 5100), 5)
    mixed = s.schedule()
    assert mixed.num_prefill_tokens == 100 and mixed.drafts.tolist() == [3, 3, 3, 0]
    extra = SimExecutor(priced, 3).step_seconds(mixed) - SimExecutor(prof, 3).step_seconds(mixed)
    assert extra == pytest.approx(3 * 700.0 * 1e-6, rel=1e-9)
    assert SimExecutor(priced, 0).step_seconds(mixed) == SimExecutor(prof, 0).step_seconds(mixed)
    plain = decoding_scheduler(1, 5, specialized=False)
    plain.add("late", np.arange(90000, 90300), 10)
    one_token_rows = plain.schedule()
    assert one_token_rows.num_decode_tokens == 5 and one_token_rows.num_prefill_tokens == 300
    assert SimExecutor(priced, 0).step_seconds(one_token_rows) == SimExecutor(prof, 0).step_seconds(
        one_token_rows
    )
    window = verify_window(4)
    assert (
        SimExecutor(priced, 7).window_seconds(window).tolist()
        == SimExecutor(prof, 7).window_seconds(window).tolist()
    )


def test_profile_keys_of_the_mixed_row_cost_and_async_scheduling(tmp_path):
    """Both are optional (a profile without them prices and schedules as before); a wrong
    type is a one-line error naming the file and key."""
    from importlib import resources

    from agentab.errors import AgentabError

    text = (resources.files("agentab.engine") / "profiles" / "gb300-tp16-kimi-k3.toml").read_text()
    assert load_profile("gb300-tp16-kimi-k3").async_scheduling is False
    path = tmp_path / "p.toml"
    path.write_text(text + "mixed_decode_row_us = 12.5\n\n[engine]\nasync_scheduling = true\n")
    p = load_profile(path)
    assert (p.mixed_decode_row_us, p.async_scheduling) == (12.5, True)
    with_verify = text.replace("[spec_decode]\n", "[spec_decode]\nmixed_verify_row_us = 40.0\n")
    assert with_verify != text
    path.write_text(with_verify)
    assert load_profile(path).mixed_verify_row_us == 40.0
    path.write_text(with_verify.replace("= 40.0", "= -1.0"))
    with pytest.raises(AgentabError, match=r"spec_decode\.mixed_verify_row_us: -1\.0 must be"):
        load_profile(path)
    path.write_text(text + '\n[engine]\nasync_scheduling = "yes"\n')
    with pytest.raises(AgentabError, match=r"p\.toml: engine\.async_scheduling: must be true"):
        load_profile(path)
    path.write_text(text + "\n[engine]\nasync = true\n")
    with pytest.raises(AgentabError, match=r"engine\.async: unknown key"):
        load_profile(path)


def test_graph_padding_up_to_the_next_size_and_none_past_the_largest():
    sizes = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    got = [graph_padding(n, sizes) for n in (1, 16, 17, 300, 512, 513, 1099, 2048, 2049, 9000)]
    assert got == [15, 0, 15, 212, 0, 255, 181, 0, 0, 0]
    assert graph_padding(300, ()) == 0 and graph_padding(0, sizes) == 0


def test_a_step_with_prefill_pays_its_graph_padding_when_the_profile_states_the_sizes():
    """[prefill] graph_tokens: a step with prefill tokens of up to the largest size runs padded
    to the next one, each padded token at the prefill per-token rate; a step past the largest
    runs unpadded, and decode-only steps and windows keep their own (decode graph) padding."""
    import dataclasses

    prof = load_profile("gb300-tp16-kimi-k3")
    assert prof.prefill_graph_tokens == ()
    priced = dataclasses.replace(prof, prefill_graph_tokens=(128, 256, 512))
    plain, padded = SimExecutor(prof, 0), SimExecutor(priced, 0)
    per_token = 1e6 / (prof.prefill_tokens_per_s_per_gpu * prof.gpu_count)
    s = decoding_scheduler(1, 5, specialized=False)
    decode_only = s.schedule()
    assert padded.step_seconds(decode_only) == plain.step_seconds(decode_only)
    s.add("late", np.arange(90000, 90300), 10)
    mixed = s.schedule()
    assert mixed.total_tokens == 305  # 5 decode rows + 300 prompt tokens -> 512
    extra = padded.step_seconds(mixed) - plain.step_seconds(mixed)
    assert extra == pytest.approx(207 * per_token * 1e-6, rel=1e-9)
    fresh = Scheduler(SchedulerConfig(num_blocks=1000))
    fresh.add("p", np.arange(1, 601), 5)
    past_the_largest = fresh.schedule()
    assert past_the_largest.total_tokens == 600
    assert padded.step_seconds(past_the_largest) == plain.step_seconds(past_the_largest)
    window = verify_window(1)
    assert padded.window_seconds(window).tolist() == plain.window_seconds(window).tolist()


def test_profile_key_of_the_prefill_graph_sizes(tmp_path):
    """Optional (absent: no padding); sizes must be integers >= 1, strictly increasing, and a
    wrong value is a one-line error naming the file and key."""
    from importlib import resources

    from agentab.errors import AgentabError

    text = (resources.files("agentab.engine") / "profiles" / "gb300-tp16-kimi-k3.toml").read_text()
    path = tmp_path / "p.toml"
    path.write_text(text + "graph_tokens = [16, 32, 2048]\n")
    assert load_profile(path).prefill_graph_tokens == (16, 32, 2048)
    path.write_text(text + "graph_tokens = [32, 16]\n")
    with pytest.raises(
        AgentabError, match=r"p\.toml: prefill\.graph_tokens: must be strictly incr"
    ):
        load_profile(path)
    path.write_text(text + "graph_tokens = [0, 16]\n")
    with pytest.raises(AgentabError, match=r"prefill\.graph_tokens: must be a list of integers"):
        load_profile(path)


@pytest.mark.parametrize("seed", range(3))
def test_the_price_sums_pass_matches_numpy_compiled_and_plain(seed: int) -> None:
    """price_numba.step_sums (compiled, and its plain-Python function) gives the sums the
    price formula used to take with numpy masks, for mixed, decode-only and prefill-only
    rows (drafts only on decoding rows, as the scheduler plans them)."""
    from agentab.engine import price_numba

    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(1, 80))
        sched = rng.integers(1, 9000, size=n).astype(np.int64)
        comp = rng.integers(0, 300_000, size=n).astype(np.int64)
        dec = rng.random(n) < [0.0, 0.5, 1.0][int(rng.integers(3))]
        drafts = np.where(dec, rng.integers(0, 8, size=n), 0).astype(np.int64)
        pre = ~dec
        nf, cf = sched[pre].astype(np.float64), comp[pre].astype(np.float64)
        v = dec & (drafts > 0)
        want = (
            int(np.count_nonzero(dec)),
            int((comp[dec] + sched[dec]).sum()),
            int(np.count_nonzero(drafts)),
            float((drafts[v].astype(np.float64) * (comp[v] + sched[v])).sum()),
            float(nf.sum()),
            float((nf * cf + nf * (nf + 1) / 2).sum()),
            float(cf.sum()),
            int(np.count_nonzero(pre)),
        )
        for fn in (price_numba.step_sums, getattr(price_numba.step_sums, "py_func", None)):
            if fn is None:
                continue
            got = fn(sched, comp, dec, drafts)
            assert tuple(type(w)(g) for w, g in zip(want, got, strict=True)) == want

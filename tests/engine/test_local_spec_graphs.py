"""The GPU's speculative step logic, run on the CPU: drafts made by the drafter's graphs and
verify steps run as token rows of the decode graphs (engine.local.cuda), each replay eager.

The same engine as the GPU's except that nothing is captured and the eager standard layer
stands in for the compiled one, so these tests check what the graphs are handed: every
token's position, slot and block table, the drafts' places in the token pool, the pending
tokens of a step scheduled ahead, and the emitted tokens gathered after the verify step.
Tokens must be those of the CPU's eager engine, which has its own tests against plain greedy
decoding.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.build import OPTIONS, local_engine_from  # noqa: E402
from agentab.engine.options import LocalOptions, decode_options  # noqa: E402

from .test_local_spec import (  # noqa: E402
    ASYNC_JOBS,
    LAYERS,
    MIXED,
    engine,
    greedy_spec,
    prompt,
    run,
    serve_all,
    spec_counters,
    spec_metrics,
    synthetic,
)


def graph_engine(backend: str = "auto", spec: dict | None = None, **options):
    opts = decode_options(
        LocalOptions,
        {"preset": "tiny", "decode_backend": backend, "device": "cpu", "seed": 3,
         "speculative_config": spec, "max_model_len": 256, **options},
        known=OPTIONS,
    )  # fmt: skip
    return local_engine_from(opts, graphs_on_cpu=True)


def graph_steps(eng) -> float:
    return eng.metrics()["agentab:graph_steps_total"]


def test_plain_decode_steps_in_graphs_give_the_eager_engines_tokens():
    plain = run(engine(max_num_batched_tokens=10), MIXED).tokens
    eng = graph_engine(max_num_batched_tokens=10)
    assert run(eng, MIXED).tokens == plain
    assert graph_steps(eng) > 0


@pytest.mark.parametrize("layers", [1, 3])
def test_verify_steps_in_graphs_give_the_tokens_of_plain_greedy_decoding(layers):
    plain = run(engine(max_num_batched_tokens=10), MIXED).tokens
    eng = graph_engine("auto", greedy_spec(3, layers), max_num_batched_tokens=10)
    d = run(eng, MIXED)
    assert d.tokens == plain
    verify = [v for r in "ABCD" for v in d.verifies(r)]
    drafts, draft_tokens, accepted, per_pos = spec_counters(eng)
    assert drafts == len(verify) and draft_tokens == sum(n for n, _ in verify)
    assert accepted == sum(a for _, a in verify) < draft_tokens
    assert any(n < 3 for n, _ in verify)  # partial verify rows: fewer drafts for some rows
    assert per_pos == [sum(a > i for _, a in verify) for i in range(3)]
    pure = [p for p, _ in d.steps if (p.drafts > 0).any() and p.is_decode.all()]
    assert graph_steps(eng) >= len(pure) > 0  # every pure verify step ran in graphs


def test_the_self_drafting_graphs_accept_every_draft():
    plain = run(engine(), MIXED).tokens
    eng = graph_engine("auto", greedy_spec(3, LAYERS))
    d = run(eng, MIXED)
    assert d.tokens == plain
    verify = [v for r in "ABCD" for v in d.verifies(r)]
    assert verify and all(a == n == 3 for n, a in verify)
    assert spec_counters(eng)[3] == [len(verify)] * 3


def test_synthetic_length_6_with_7_drafts_in_graphs_accepts_5_at_every_step():
    eng = graph_engine("auto", synthetic(7, length=6))
    d = run(eng, {0: [("A", prompt(20, 1), 31), ("B", prompt(9, 4), 25)]})
    assert d.verifies("A") == [(7, 5)] * 5
    assert d.verifies("B") == [(7, 5)] * 4
    _, _, accepted, per_pos = spec_counters(eng)
    assert accepted == 45 and per_pos == [9, 9, 9, 9, 9, 0, 0]
    # the emitted tokens are the accepted drafts and the target's next token, as the eager
    # engine emits them
    eager = run(engine("auto", synthetic(7, length=6)),
                {0: [("A", prompt(20, 1), 31), ("B", prompt(9, 4), 25)]})  # fmt: skip
    assert d.tokens == eager.tokens


def test_preempted_requests_in_graphs_recompute_to_the_same_tokens():
    reqs = {0: [("P", prompt(60, 21), 40), ("Q", prompt(60, 33), 40)]}
    roomy = run(engine(), reqs).tokens
    tight = graph_engine("auto", greedy_spec(3, 2), kv_blocks=10)
    assert run(tight, reqs).tokens == roomy
    assert tight.scheduler.counters["num_preemptions"] >= 1


@pytest.mark.parametrize(
    "spec", [greedy_spec(3, 1), synthetic(7, length=3.8), synthetic(3, rates=[0.9, 0.6, 0.3])]
)
def test_scheduled_ahead_the_graphs_take_pending_tokens_and_shift_by_what_was_accepted(spec):
    """One step ahead, a verify row's first token is the step in flight's (read from the pool
    by the first draft and by the verify step) and its positions shift by that step's accepted
    drafts: tokens and counters equal the eager engine's scheduled one step at a time."""
    ahead_engine = graph_engine("auto", spec)
    ahead = asyncio.run(serve_all(ahead_engine, True))
    stepwise_engine = engine("auto", spec)
    assert ahead == asyncio.run(serve_all(stepwise_engine, False))
    assert spec_metrics(ahead_engine) == spec_metrics(stepwise_engine)
    assert graph_steps(ahead_engine) > 0
    assert [len(ahead[j[0]]) for j in ASYNC_JOBS] == [j[2] for j in ASYNC_JOBS]

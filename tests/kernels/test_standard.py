"""The standard path on the tiny preset matches the fp32 reference stage by stage."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentab.kernels.compare import REL_TOL, compare_step  # noqa: E402
from agentab.kernels.config import PRESETS  # noqa: E402
from agentab.kernels.standard import StandardPath  # noqa: E402
from agentab.kernels.weights import init_state, init_weights  # noqa: E402

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
def test_standard_path_matches_reference(batch: int) -> None:
    w = init_weights(TINY, 11)
    path = StandardPath(TINY, w, max_position=64)
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, TINY.hidden, generator=gen).to(torch.bfloat16)
    before = init_state(TINY, batch, 48, seed=batch, ragged=True)
    state = before.clone()
    so = path.step(x, state)
    c = compare_step(
        TINY, w, x, before, so.out, so.h1, so.ids, so.weights, so.router_in,
        so.router_in_normed, state.cache,
    )  # fmt: skip
    assert c.ok, c
    assert c.expert_mismatches == 0
    assert c.e2e_err <= REL_TOL
    # Only the new token's row of the cache changed.
    changed = (state.cache != before.cache).any(-1)
    rows = torch.arange(batch)
    expect = torch.zeros_like(changed)
    expect[rows, before.positions.long()] = True
    assert torch.equal(changed | expect, expect)


def test_compare_flags_a_wrong_output() -> None:
    w = init_weights(TINY, 12)
    path = StandardPath(TINY, w, max_position=16)
    x = torch.randn(2, TINY.hidden).to(torch.bfloat16)
    before = init_state(TINY, 2, 8, seed=1)
    state = before.clone()
    so = path.step(x, state)
    bad = so.out.clone()
    bad[1, :5] = float("nan")
    c = compare_step(
        TINY, w, x, before, bad, so.h1, so.ids, so.weights, so.router_in, True, state.cache
    )
    assert not c.ok and not c.all_written
    wrong_ids = so.ids.clone()
    wrong_ids[0, 0] = (wrong_ids[0, 0] + 1) % TINY.n_experts
    while wrong_ids[0, 0].item() in wrong_ids[0, 1:].tolist():
        wrong_ids[0, 0] = (wrong_ids[0, 0] + 1) % TINY.n_experts
    c2 = compare_step(
        TINY, w, x, before, so.out, so.h1, wrong_ids, so.weights, so.router_in, True, state.cache
    )
    assert c2.expert_mismatches == 1 and not c2.ok


def test_the_two_moe_combines_agree() -> None:
    """Prefill-sized batches put routed rows back with a gather, decode-sized ones with an
    index_add_: the same tokens give the same output either way."""
    from agentab.kernels.standard import GATHER_COMBINE_TOKENS, grouped_topk

    w = init_weights(TINY, 12)
    path = StandardPath(TINY, w, max_position=64)
    gen = torch.Generator().manual_seed(5)
    n = GATHER_COMBINE_TOKENS + 44
    hn = torch.randn(n, TINY.hidden, generator=gen).to(torch.bfloat16)
    ids, weights = grouped_topk(TINY, (hn.float() @ w.w_gate.float().t()), w.gate_bias)
    whole = path.moe(hn, ids, weights)  # one batch: the gather
    parts = torch.cat(
        [
            path.moe(hn[i : i + 100], ids[i : i + 100], weights[i : i + 100])
            for i in range(0, n, 100)
        ]
    )  # batches under the threshold: index_add_
    torch.testing.assert_close(whole.float(), parts.float(), rtol=2e-2, atol=2e-2)

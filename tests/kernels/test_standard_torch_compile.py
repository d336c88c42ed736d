"""The compiled standard path (`standard`) on the tiny preset: inductor on the CPU, the Triton
fused MoE in Triton's interpreter, against the eager path and the fp32 reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentab.kernels.attention import PagedKV, split_plan  # noqa: E402
from agentab.kernels.compare import REL_TOL, compare_step  # noqa: E402
from agentab.kernels.config import PRESETS  # noqa: E402
from agentab.kernels.paths import make_path  # noqa: E402
from agentab.kernels.standard import StandardPath  # noqa: E402
from agentab.kernels.weights import DecodeState, init_state, init_weights  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # triton (the gpu extra); compiles take ~30 s

TINY = PRESETS["tiny"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_compiled_path_matches_the_reference_and_the_eager_path() -> None:
    """Batch 1 (its own specialized graph), then 2 and 5 (one graph, dynamic batch)."""
    w = init_weights(TINY, 11)
    compiled = make_path("standard", TINY, w, 64, 1)
    eager = make_path("standard-eager", TINY, w, 64, 1)
    assert (compiled.name, compiled.impl) == ("standard", "torch-compile+triton-moe")
    assert isinstance(eager, StandardPath) and eager.name == "standard-eager"
    for batch in (1, 2, 5):
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, TINY.hidden, generator=gen).to(torch.bfloat16)
        before = init_state(TINY, batch, 48, seed=batch, ragged=True)
        state, eager_state = before.clone(), before.clone()
        so = compiled.step(x, state)
        eo = eager.step(x, eager_state)
        c = compare_step(
            TINY, w, x, before, so.out, so.h1, so.ids, so.weights, so.router_in,
            so.router_in_normed, state.cache,
        )  # fmt: skip
        assert c.ok and c.expert_mismatches == 0 and c.e2e_err <= REL_TOL, (batch, c)
        # same experts and cache entries as the eager path; outputs within bf16 noise of it
        assert torch.equal(so.ids.long().sort(1).values, eo.ids.sort(1).values)
        assert torch.equal(state.cache, eager_state.cache)
        assert _rel(so.out, eo.out) < 1e-2 and _rel(so.h1, eo.h1) < 1e-2


def test_compiled_path_on_a_paged_cache_writes_the_named_slots() -> None:
    batch, ctx, bs = 3, 40, 16
    w = init_weights(TINY, 5)
    compiled = make_path("standard", TINY, w, 64, batch)
    eager = make_path("standard-eager", TINY, w, 64, batch)
    x = torch.randn(batch, TINY.hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    dense = init_state(TINY, batch, ctx, seed=9, ragged=True)
    per_seq = -(-(ctx + 1) // bs)
    table = torch.randperm(batch * per_seq + 5, generator=torch.Generator().manual_seed(4))
    table = table[: batch * per_seq].view(batch, per_seq)
    idx = torch.arange(ctx + 1)
    where = table[:, idx // bs] * bs + idx % bs
    pos = dense.positions
    new = where[torch.arange(batch), pos.long()]

    def paged_state() -> DecodeState:
        slots = torch.zeros((batch * per_seq + 5) * bs, TINY.kv_width, dtype=torch.bfloat16)
        slots[where.flatten()] = dense.cache.reshape(-1, TINY.kv_width)
        paged = PagedKV(cache=slots, block_table=table.int(), new_slots=new,
                        positions_and_slots=torch.stack([pos, new.int()]), block_size=bs,
                        max_len=ctx + 1,
                        split_len=torch.tensor([split_plan(batch, ctx + 1)[1]],
                                               dtype=torch.int32))  # fmt: skip
        return DecodeState(cache=slots, positions=pos, paged=paged)

    a_state, b_state = paged_state(), paged_state()
    before = a_state.cache.clone()
    a = compiled.step(x, a_state)
    b = eager.step(x, b_state)
    assert torch.equal(a_state.cache, b_state.cache)
    changed = (a_state.cache != before).any(-1).nonzero().flatten()
    assert set(changed.tolist()) == set(new.tolist())
    assert torch.equal(a.ids.long().sort(1).values, b.ids.sort(1).values)
    assert _rel(a.out, b.out) < 1e-2

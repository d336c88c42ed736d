"""The paged form of the decode state (the serving engine's block-table cache)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentab.kernels.attention import PagedKV, paged_splits, split_plan  # noqa: E402
from agentab.kernels.config import PRESETS  # noqa: E402
from agentab.kernels.standard import StandardPath  # noqa: E402
from agentab.kernels.weights import DecodeState, init_state, init_weights  # noqa: E402

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("batch", [1, 3, 8, 64])
@pytest.mark.parametrize("max_len", [64, 4096, 36864])
def test_the_paged_split_grid_covers_every_length(batch: int, max_len: int) -> None:
    grid = paged_splits(batch, max_len)
    for n in range(1, max_len + 1, 13):
        splits, length = split_plan(batch, n)
        assert splits <= grid and splits * length >= n


def test_standard_step_on_a_paged_cache_equals_the_contiguous_one() -> None:
    """Same tokens scattered over shuffled 16-token blocks: same outputs, and the new entries
    land in the slots the block table names (and nowhere else)."""
    batch, ctx, bs = 3, 40, 16
    w = init_weights(TINY, 5)
    path = StandardPath(TINY, w, max_position=64)
    x = torch.randn(batch, TINY.hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    dense = init_state(TINY, batch, ctx, seed=9, ragged=True)
    blocks_per_seq = -(-(ctx + 1) // bs)
    table = torch.randperm(batch * blocks_per_seq + 5, generator=torch.Generator().manual_seed(4))
    table = table[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    slots = torch.zeros((batch * blocks_per_seq + 5) * bs, TINY.kv_width, dtype=torch.bfloat16)
    idx = torch.arange(ctx + 1)
    where = table[:, idx // bs] * bs + idx % bs  # (batch, ctx + 1) slot of each position
    slots[where.flatten()] = dense.cache.reshape(-1, TINY.kv_width)
    pos = dense.positions
    new = where[torch.arange(batch), pos.long()]
    paged = PagedKV(
        cache=slots,
        block_table=table.int(),
        new_slots=new,
        positions_and_slots=torch.stack([pos, new.int()]),
        block_size=bs,
        max_len=ctx + 1,
        split_len=torch.tensor([split_plan(batch, ctx + 1)[1]], dtype=torch.int32),
    )
    before = slots.clone()
    a = path.step(x, dense.clone()).out
    b = path.step(x, DecodeState(cache=slots, positions=pos, paged=paged)).out
    assert torch.equal(a, b)
    changed = (slots != before).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(new.tolist())

"""A dense decode state scattered over shuffled cache blocks: the paged form the serving
engine uses, for tests that compare the two."""

from __future__ import annotations

import torch

from agentab.kernels.attention import PagedKV, split_plan
from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import DecodeState


def scatter_into_blocks(
    cfg: LayerConfig, dense: DecodeState, block_size: int, seed: int, max_len: int | None = None
) -> PagedKV:
    """The same tokens in shuffled `block_size`-token blocks; `max_len` (default: the dense
    cache's length) sizes the split grid, the split length follows the longest row."""
    batch, length = dense.cache.shape[:2]
    max_len = length if max_len is None else max_len
    blocks = -(-length // block_size)
    table = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(seed))
    table = table.view(batch, blocks)
    slots = torch.zeros(batch * blocks * block_size, cfg.kv_width, dtype=dense.cache.dtype)
    idx = torch.arange(length)
    where = table[:, idx // block_size] * block_size + idx % block_size
    slots[where.flatten()] = dense.cache.reshape(-1, cfg.kv_width)
    pos = dense.positions
    new = where[torch.arange(batch), pos.long()]
    pad = -(-max_len // block_size) - blocks
    return PagedKV(
        cache=slots,
        block_table=torch.nn.functional.pad(table, (0, max(0, pad))).int(),
        new_slots=new,
        positions_and_slots=torch.stack([pos, new.int()]),
        block_size=block_size,
        max_len=max_len,
        split_len=torch.tensor([split_plan(batch, int(pos.max()) + 1)[1]], dtype=torch.int32),
    )

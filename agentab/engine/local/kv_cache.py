"""The paged latent KV cache: one tensor per layer, addressed through the scheduler's blocks.

MLA caches `kv_lora + qk_rope` values per token per layer (576 for Kimi-K2): the compressed kv
and the shared rope key. The cache holds `num_blocks * block_size` token slots per layer; a
token's slot is `block id * block_size + offset`, and the block ids are exactly the scheduler's
(`engine.kv_cache.BlockPool`), so a prefix-cache hit in the scheduler is KV data already here
(its prefill is skipped for real) and a preempted request's freed blocks are memory that other
requests overwrite.
"""

from __future__ import annotations

import torch


class PagedLatentCache:
    """`layers x (num_blocks * block_size) x kv_width` bf16 slots."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_width: int,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_width = kv_width
        self.data = torch.zeros(
            num_layers, num_blocks * block_size, kv_width, device=device, dtype=torch.bfloat16
        )

    def layer(self, index: int) -> torch.Tensor:
        """Layer `index`'s slots, (num_blocks * block_size, kv_width)."""
        return self.data[index]

    @staticmethod
    def slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
        """Slot indices of positions [0, length) of a sequence with this block table."""
        pos = torch.arange(length, device=block_table.device)
        return block_table[pos // block_size] * block_size + pos % block_size

    @staticmethod
    def bytes_for(num_layers: int, num_blocks: int, block_size: int, kv_width: int) -> int:
        return num_layers * num_blocks * block_size * kv_width * 2

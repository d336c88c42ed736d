"""The shared attention core's split plan and the MoE's token form, per batch size."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from agentab.kernels import attention


def test_split_kernel_runs_64_token_tiles_on_4_warps() -> None:
    assert attention.split_config() == (64, 1, 4, 2)


def test_split_plans_at_context_4096() -> None:
    # 4097 cache rows = 65 tiles of 64: one per split at batch 1, five splits of 13 at batch 64
    assert attention.split_plan(1, 4097) == (65, 64)
    assert attention.split_plan(4, 4097) == (65, 64)
    assert attention.split_plan(64, 4097) == (5, 832)
    assert attention.split_plan(1, 1) == (1, 64)


def test_the_paged_grid_covers_every_length_it_may_meet() -> None:
    for batch in (1, 3, 8, 64):
        grid = attention.paged_splits(batch, 8192)
        assert all(attention.split_plan(batch, n)[0] <= grid for n in range(1, 8193, 37))
    assert attention.paged_splits(1, 4097) == 65


def test_combine_tiles_narrow_until_two_programs_per_sm() -> None:
    assert attention.combine_tile(1, 16, 512) == 32  # 256 programs
    assert attention.combine_tile(4, 16, 512) == 64
    assert attention.combine_tile(5, 16, 512) == 128
    assert attention.combine_tile(1, 4, 64) == 32  # never below 32 channels


def test_moe_up_reads_normalized_tokens_above_batch_4() -> None:
    from agentab.kernels.specialized import prenorm_tokens

    assert [prenorm_tokens(b) for b in (1, 4, 5, 64)] == [False, False, True, True]

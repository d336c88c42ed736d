"""The shared attention core's Triton kernels (split + combine), run through the Triton
interpreter on the CPU against the torch math, on contiguous and paged caches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from agentab.kernels.attention import mla_decode_torch, mla_decode_triton, split_plan  # noqa: E402
from agentab.kernels.config import PRESETS  # noqa: E402
from agentab.kernels.weights import init_state  # noqa: E402
from tests.kernels.paged_cache import scatter_into_blocks  # noqa: E402

TINY = PRESETS["tiny"]


def _queries(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(batch, TINY.n_heads, TINY.kv_lora, generator=gen).bfloat16()
    q_pe = torch.randn(batch, TINY.n_heads, TINY.qk_rope, generator=gen).bfloat16()
    return q_lat, q_pe


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("batch", "ctx"), [(1, 40), (1, 300), (3, 150)])
def test_split_and_combine_match_the_torch_attention(batch: int, ctx: int) -> None:
    """One split or several, rows of different lengths (ragged positions)."""
    q_lat, q_pe = _queries(batch, seed=ctx)
    state = init_state(TINY, batch, ctx, seed=batch, ragged=True)
    got = mla_decode_triton(TINY, q_lat, q_pe, state.cache, state.positions)
    want = mla_decode_torch(
        TINY, q_lat.double(), q_pe.double(), state.cache.double(), state.positions, torch.float64
    )
    assert split_plan(batch, ctx + 1)[0] > 1 or ctx < 64
    assert _rel_err(got, want) < 1e-2  # the bf16 output's rounding


def test_the_paged_cache_reads_the_same_tokens() -> None:
    batch, ctx, bs = 3, 70, 16
    q_lat, q_pe = _queries(batch, seed=5)
    dense = init_state(TINY, batch, ctx, seed=7, ragged=True)
    paged = scatter_into_blocks(TINY, dense, bs, seed=3)
    pos = dense.positions
    got = mla_decode_triton(TINY, q_lat, q_pe, paged.cache, pos, paged)
    want = mla_decode_torch(
        TINY, q_lat.double(), q_pe.double(), dense.cache.double(), pos, torch.float64
    )
    assert _rel_err(got, want) < 1e-2

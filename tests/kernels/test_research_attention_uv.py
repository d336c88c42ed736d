"""The research variant of the attention tail with the combine folded into the value projection
(`benchmarks.kernels.research.attention_uv`), run through the Triton interpreter on the CPU
against the torch math of the same step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from agentab.kernels.attention import mla_decode_torch, paged_splits, split_plan  # noqa: E402
from agentab.kernels.config import PRESETS  # noqa: E402
from agentab.kernels.weights import init_state  # noqa: E402
from benchmarks.kernels.research.attention_uv import mla_decode_uv  # noqa: E402
from tests.kernels.paged_cache import scatter_into_blocks  # noqa: E402

TINY = PRESETS["tiny"]


def _inputs(batch: int, ctx: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    nh = TINY.n_heads
    q_lat = torch.randn(batch, nh, TINY.kv_lora, generator=gen).bfloat16()
    q_pe = torch.randn(batch, nh, TINY.qk_rope, generator=gen).bfloat16()
    w_uv = (torch.randn(nh, TINY.v_head, TINY.kv_lora, generator=gen) * 0.1).bfloat16()
    state = init_state(TINY, batch, ctx, seed=seed + 1, ragged=True)
    return q_lat, q_pe, w_uv, state


def _expected(q_lat, q_pe, w_uv, cache, positions) -> torch.Tensor:
    o_lat = mla_decode_torch(
        TINY, q_lat.double(), q_pe.double(), cache.double(), positions, torch.float64
    )
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv.double()).reshape(q_lat.shape[0], -1)


@pytest.mark.parametrize(
    "options", [{}, {"rows": 8}, {"rows": 32}, {"split_chunk": 2}, {"channels": 16}]
)
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_value_projection_matches_the_torch_step(batch: int, options: dict) -> None:
    """Every plan of the fused kernel (splits summed in one load or in chunks)."""
    q_lat, q_pe, w_uv, state = _inputs(batch, 150, seed=batch)
    out = torch.full((batch, TINY.n_heads * TINY.v_head), float("nan"), dtype=torch.bfloat16)
    mla_decode_uv(TINY, q_lat, q_pe, state.cache, state.positions, w_uv, out, **options)
    want = _expected(q_lat, q_pe, w_uv, state.cache, state.positions)
    assert not out.isnan().any()
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err  # bf16 output rounding; the combine itself runs in fp32


def test_fused_value_projection_on_a_paged_cache_with_a_longer_grid() -> None:
    """Shuffled blocks, a split grid sized for a far longer max_len than the rows (the serving
    engine's graph), the split length read on the device: the same step as the dense math."""
    batch, ctx, bs, max_len = 3, 70, 16, 4096
    q_lat, q_pe, w_uv, dense = _inputs(batch, ctx, seed=7)
    paged = scatter_into_blocks(TINY, dense, bs, seed=3, max_len=max_len)
    pos = dense.positions
    assert paged_splits(batch, max_len) > split_plan(batch, ctx + 1)[0]
    out = torch.full((batch, TINY.n_heads * TINY.v_head), float("nan"), dtype=torch.bfloat16)
    mla_decode_uv(TINY, q_lat, q_pe, paged.cache, pos, w_uv, out, paged=paged)
    want = _expected(q_lat, q_pe, w_uv, dense.cache, pos)
    assert not out.isnan().any()
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err


def test_bad_shapes_are_named() -> None:
    q_lat, q_pe, w_uv, state = _inputs(1, 20, seed=1)
    out = torch.zeros(1, TINY.n_heads * TINY.v_head, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w_uv"):
        mla_decode_uv(TINY, q_lat, q_pe, state.cache, state.positions, w_uv[:, :, :-1], out)
    with pytest.raises(ValueError, match="rows"):
        mla_decode_uv(TINY, q_lat, q_pe, state.cache, state.positions, w_uv, out, rows=12)

"""A mixed step of the local engine's standard forward: decode rows batched beside prefill chunks.

The step's decode rows attend in one batched call per layer and its prefill chunks one by one;
every row must get exactly what it gets attended on its own. The batch is built by hand: decode
rows whose contexts end on either side of a block boundary (and one with a context of a single
token), prefill chunks with and without a cached prefix, rows interleaved, each row's blocks
scattered over the cache, and block-table padding that no valid read can touch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.config import model_config  # noqa: E402
from agentab.engine.local.forward import (  # noqa: E402
    DeviceBatch,
    decode_attention,
    prefill_attention,
    rows_attention,
    standard_forward,
)
from agentab.engine.local.kv_cache import PagedLatentCache  # noqa: E402
from agentab.engine.local.model import build_weights  # noqa: E402
from agentab.engine.outputs import StepInputs  # noqa: E402
from agentab.kernels.config import PRESETS  # noqa: E402
from agentab.kernels.weights import init_weights  # noqa: E402

CPU = torch.device("cpu")
BLOCK = 16
NUM_BLOCKS = 64
NO_BLOCK = 10**6  # table padding: a read through it would index past the cache and raise
# (cached tokens, new tokens) per row, in step order. Decode rows (one new token): contexts of
# 17 (the token opens a block), 48 (it closes one), 41, 71 (the longest) and 1 (a one-token
# prompt). Prefill chunks: 20 tokens after 12 cached (crossing a block), a 7-token prompt.
ROWS = [(16, 1), (12, 20), (40, 1), (47, 1), (0, 7), (0, 1), (70, 1)]
DECODE = [i for i, (_, n) in enumerate(ROWS) if n == 1]


def hand_step(rows: list[tuple[int, int]], seed: int = 0) -> StepInputs:
    """The step's inputs as the scheduler would give them, each row's blocks drawn at random
    from the cache (no two rows share one)."""
    rng = np.random.default_rng(seed)
    ctx = np.array([c + n for c, n in rows], dtype=np.int64)
    need = [-(-int(n) // BLOCK) for n in ctx]
    width = max(need)
    free = rng.permutation(NUM_BLOCKS)
    tables = np.full((len(rows), width), NO_BLOCK, dtype=np.int64)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = free[used : used + k]
        used += k
    cached = np.array([c for c, _ in rows], dtype=np.int64)
    new = np.array([n for _, n in rows], dtype=np.int64)
    tokens = rng.integers(1, 32000, size=int(new.sum())).astype(np.int64)
    return StepInputs.of_rows(cached, new, tables, tokens, BLOCK)


def test_the_step_splits_into_batched_decode_rows_and_prefill_chunks():
    b = DeviceBatch.of(hand_step(ROWS), CPU)
    assert b.prefill_rows == [1, 4]
    assert b.decode is not None
    assert b.decode.tokens.tolist() == [0, 21, 22, 30, 31]  # each row's one token, flat index
    assert b.decode.positions.tolist() == [16, 40, 47, 0, 70]
    assert b.decode.max_len == 71


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_batched_decode_rows_equal_each_row_attended_alone(dtype, tol):
    """Every row's attention in the mixed step against the absorbed form over the row's own
    gathered context (`decode_attention`, one token at a time) and the prefill chunk's expanded
    form: equal to rounding (fp64: 1e-12; fp32, the CPU engine's dtype: 2e-6)."""
    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 5)
    w = type(w)(**{k: v.to(dtype) for k, v in w.tensors().items()})
    inputs = hand_step(ROWS, seed=1)
    b = DeviceBatch.of(inputs, CPU)
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(NUM_BLOCKS * BLOCK, cfg.kv_width, generator=gen, dtype=dtype)
    t = len(inputs.token_ids)
    q_nope = torch.randn(t, cfg.n_heads, cfg.qk_nope, generator=gen, dtype=dtype)
    q_pe = torch.randn(t, cfg.n_heads, cfg.qk_rope, generator=gen, dtype=dtype)

    got = rows_attention(cfg, w, q_nope, q_pe, kv, b)

    for i, (cached, new) in enumerate(ROWS):
        first, last = int(inputs.starts[i]), int(inputs.starts[i + 1])
        table = torch.from_numpy(inputs.block_tables[i])
        ctx = kv[PagedLatentCache.slots(table, cached + new, BLOCK)]
        if new == 1:
            want = decode_attention(cfg, w, q_nope[first], q_pe[first], ctx)[None]
        else:
            want = prefill_attention(cfg, w, q_nope[first:last], q_pe[first:last], ctx)
        torch.testing.assert_close(got[first:last], want, rtol=tol, atol=tol)


# A verify row (a decoding row's token and 3 drafts, 33 cached) beside a prefill chunk and a
# one-token decode row
VERIFY_ROWS = [(12, 20), (33, 4), (40, 1)]


def verify_step(seed: int) -> StepInputs:
    inputs = hand_step(VERIFY_ROWS, seed=seed)
    inputs.is_decode[:] = [False, True, True]
    return inputs


def test_a_verify_rows_tokens_are_batched_decode_queries_at_their_own_positions():
    b = DeviceBatch.of(verify_step(0), CPU)
    assert b.prefill_rows == [0]
    assert b.decode is not None
    assert b.decode.tokens.tolist() == [20, 21, 22, 23, 24]
    assert b.decode.positions.tolist() == [33, 34, 35, 36, 40]
    assert b.decode.block_table[:4].tolist() == [b.block_tables[1].tolist()] * 4
    assert b.decode.max_len == 41


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_a_verify_row_attends_as_its_causal_chunk_would(dtype, tol):
    """Each verify token, a query of its own over its row's context up to its position, gets
    what the row's tokens get as one causal chunk in the expanded form (`prefill_attention`)."""
    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 5)
    w = type(w)(**{k: v.to(dtype) for k, v in w.tensors().items()})
    inputs = verify_step(seed=1)
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(NUM_BLOCKS * BLOCK, cfg.kv_width, generator=gen, dtype=dtype)
    t = len(inputs.token_ids)
    q_nope = torch.randn(t, cfg.n_heads, cfg.qk_nope, generator=gen, dtype=dtype)
    q_pe = torch.randn(t, cfg.n_heads, cfg.qk_rope, generator=gen, dtype=dtype)

    got = rows_attention(cfg, w, q_nope, q_pe, kv, DeviceBatch.of(inputs, CPU))

    for i, (cached, new) in enumerate(VERIFY_ROWS):
        first, last = int(inputs.starts[i]), int(inputs.starts[i + 1])
        table = torch.from_numpy(inputs.block_tables[i])
        ctx = kv[PagedLatentCache.slots(table, cached + new, BLOCK)]
        want = prefill_attention(cfg, w, q_nope[first:last], q_pe[first:last], ctx)
        torch.testing.assert_close(got[first:last], want, rtol=tol, atol=tol)


def test_a_mixed_step_gives_each_row_what_it_gets_as_a_step_alone():
    """The whole standard forward (4 layers, fp64 activations over the bf16 cache): the mixed
    step's last hidden state of every row equals that of the row run as a step of its own, to
    the router's fp32 rounding (its logits are fp32 whatever the activations' dtype, and a GEMM's
    rounding depends on how many tokens it multiplies: 1e-5), and so do the latent entries the
    step writes (bf16)."""
    cfg = model_config("tiny", num_layers=4, weight_sets=2)
    w = build_weights(cfg, CPU, 3, torch.float64)
    cache = PagedLatentCache(cfg.num_layers, NUM_BLOCKS, BLOCK, cfg.layer.kv_width, CPU)
    gen = torch.Generator().manual_seed(4)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))  # earlier tokens' entries
    inputs = hand_step(ROWS, seed=6)
    before = cache.data.clone()

    mixed = standard_forward(cfg, w, cache, DeviceBatch.of(inputs, CPU), torch.float64)
    mixed_cache = cache.data.clone()

    for i in range(len(ROWS)):
        cache.data.copy_(before)
        alone = StepInputs(
            token_ids=inputs.token_ids[inputs.starts[i] : inputs.starts[i + 1]],
            positions=inputs.positions[inputs.starts[i] : inputs.starts[i + 1]],
            starts=inputs.starts[i : i + 2] - inputs.starts[i],
            context_lens=inputs.context_lens[i : i + 1],
            block_tables=inputs.block_tables[i : i + 1],
            slot_mapping=inputs.slot_mapping[inputs.starts[i] : inputs.starts[i + 1]],
            is_decode=inputs.is_decode[i : i + 1],
            block_size=BLOCK,
        )
        x = standard_forward(cfg, w, cache, DeviceBatch.of(alone, CPU), torch.float64)
        torch.testing.assert_close(mixed[i : i + 1], x, rtol=1e-5, atol=1e-5)
        slots = torch.from_numpy(alone.slot_mapping)
        torch.testing.assert_close(mixed_cache[:, slots], cache.data[:, slots])

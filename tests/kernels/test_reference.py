"""The fp32 reference: exact values where the math gives them, and the preset byte counts."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from agentab.errors import AgentabError  # noqa: E402
from agentab.kernels import reference as R  # noqa: E402
from agentab.kernels.config import PRESETS, get_preset  # noqa: E402
from agentab.kernels.weights import init_state, init_weights  # noqa: E402

TINY = PRESETS["tiny"]
K2 = PRESETS["k2-tp8-shard"]


def test_k2_shard_reads_178_mb_at_batch_1_and_3_2_gb_at_batch_64() -> None:
    # docs/kernels.md: 178 MB of bf16 weights at batch 1, 3.2 GB at batch 64.
    dense = (
        2 * 7168  # two norms
        + 2 * 384  # fp32 router bias
        + (1536 + 576) * 7168  # q_a + kv_a
        + 1536 + 512  # low-rank norms
        + 16 * 192 * 1536  # q_b
        + 2 * 16 * 128 * 512  # W_UK, W_UV
        + 7168 * 2048  # o_proj
        + 384 * 7168  # router
        + 3 * 256 * 7168  # shared expert
    )  # fmt: skip
    assert K2.dense_weight_elems() == dense == 44_909_312
    assert K2.expert_weight_elems() == 3 * 256 * 7168
    assert K2.step_bytes(1, 0, touched_experts=8) == 2 * (dense + 8 * 3 * 256 * 7168) + 2 * (
        576 + 2 * 7168
    )
    assert round(K2.step_bytes(1, 0, touched_experts=8) / 1e6) == 178
    assert round(K2.step_bytes(64, 0) / 1e9, 1) == 3.2
    assert K2.expected_touched_experts(1) == pytest.approx(8.0)


def test_unknown_preset_is_a_one_line_error() -> None:
    with pytest.raises(AgentabError, match="unknown preset 'nope'"):
        get_preset("nope")


def test_rms_norm_exact() -> None:
    x = torch.tensor([[3.0, 4.0]])
    y = R.rms_norm(x, torch.tensor([1.0, 2.0]), eps=0.0)
    rms = math.sqrt((9 + 16) / 2)
    assert torch.allclose(y, torch.tensor([[3 / rms, 8 / rms]]))


def test_rope_is_identity_at_position_0_and_keeps_norm() -> None:
    x = torch.randn(2, 3, TINY.qk_rope)
    cos, sin = R.rope_cos_sin(TINY, torch.tensor([0, 7]))
    y = R.apply_rope(x, cos, sin)
    assert torch.equal(y[0], x[0])
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_rope_rotates_each_pair_by_its_angle_in_fp32() -> None:
    # x = [1 0 | 0 1] (pairs (x1[i], x2[i]) = (1, 0) and (0, 1)) rotated by 90 and 30 degrees
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.bfloat16)
    angle = torch.tensor([[math.pi / 2, math.pi / 6]])
    y = R.apply_rope(x, torch.cos(angle), torch.sin(angle))
    assert y.dtype == torch.float32
    expected = torch.tensor([[math.cos(math.pi / 2), -math.sin(math.pi / 6),
                              math.sin(math.pi / 2), math.cos(math.pi / 6)]])  # fmt: skip
    assert torch.allclose(y, expected, atol=1e-7)
    # cos and sin shaped to broadcast already (the local engine's) give the same bits
    heads = torch.randn(5, 3, TINY.qk_rope)
    cos, sin = R.rope_cos_sin(TINY, torch.arange(5) * 11)
    assert torch.equal(
        R.apply_rope(heads, cos, sin), R.apply_rope(heads, cos[:, None], sin[:, None])
    )


def test_grouped_topk_keeps_only_the_best_groups() -> None:
    # 16 experts, 4 groups of 4, keep 2 groups, top-4. Group scores = sum of the two best.
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 3.0  # group 0: one strong expert (group score ~0.95 + 0.018)
    logits[0, 4:6] = torch.tensor([1.0, 1.0])  # group 1: two good experts (~1.46)
    logits[0, 8:10] = torch.tensor([0.9, 0.8])  # group 2: (~1.40)
    bias = torch.zeros(16)
    r = R.route(TINY, logits, bias)
    assert sorted(r.ids[0].tolist()) == [4, 5, 8, 9]  # expert 0 loses: its group ranks third
    scores = torch.sigmoid(logits[0, [4, 5, 8, 9]])
    expect = scores / scores.sum() * TINY.routed_scaling
    got = r.weights[0][r.ids[0].argsort()]
    assert torch.allclose(got, expect)
    # The correction bias steers selection but not the weights.
    bias[0] = 1.0
    r2 = R.route(TINY, logits, bias)
    assert 0 in r2.ids[0].tolist()


def test_attention_over_a_single_token_returns_its_value() -> None:
    # With only the new token in the cache, softmax is 1 and o_lat is that token's latent.
    cfg = TINY
    w = init_weights(cfg, 3)
    x = torch.randn(2, cfg.hidden).to(torch.bfloat16)
    st = init_state(cfg, 2, 0, 4)
    a = R.attention_stage(cfg, w, x, st)
    entry = a.cache_entry.float()
    o = torch.einsum("bc,hvc->bhv", entry[:, : cfg.kv_lora], w.w_uv.float()).reshape(2, -1)
    assert torch.allclose(a.h1, x.float() + o @ w.w_o.float().t(), atol=1e-5)


def test_moe_stage_with_given_ids_uses_them() -> None:
    cfg = TINY
    w = init_weights(cfg, 5)
    h1 = torch.randn(3, cfg.hidden)
    free = R.moe_stage(cfg, w, h1)
    forced = R.moe_stage(cfg, w, h1, ids=free.routing.ids)
    assert torch.allclose(free.out, forced.out)
    assert torch.allclose(free.routing.weights, forced.routing.weights)


def test_safetensors_round_trip(tmp_path) -> None:
    pytest.importorskip("safetensors")
    from agentab.kernels.weights import load_safetensors, save_safetensors

    w = init_weights(TINY, 9)
    save_safetensors(w, TINY, tmp_path / "layer.safetensors")
    w2 = load_safetensors(TINY, tmp_path / "layer.safetensors")
    for name, t in w.tensors().items():
        assert torch.equal(t, getattr(w2, name)), name
    assert w2.shared_fused
    with pytest.raises(AgentabError, match="shape"):
        load_safetensors(PRESETS["k2-tp8-shard"], tmp_path / "layer.safetensors")

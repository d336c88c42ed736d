"""The Triton fused MoE (vLLM's design) in Triton's interpreter against an fp32 reference.

The interpreter runs the kernels' own code on CPU tensors (tests/conftest.py switches it on),
so these tests check the alignment, the block-sparse GEMMs' indexing and masks, the fused
SiLU * up and the router weight for every tile config the H200 file holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentab.errors import AgentabError

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu  # needs triton (the gpu extra)

E, H, INTER = 32, 256, 64


def _moe():
    from agentab.kernels import triton_moe

    return triton_moe


def _weights(seed: int, experts: int = E, hidden: int = H, inter: int = INTER):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts + 1, 2 * inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts + 1, hidden, inter, generator=gen) / inter**0.5).bfloat16()
    return w13, w2


def _routing(m: int, top_k: int, seed: int, experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(m, experts, generator=gen)
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(m, top_k, generator=gen) + 0.1
    return ids, weights


def _reference(hidden, w13, w2, ids, weights) -> torch.Tensor:
    """Per (token, choice) in fp32; the activation rounded to bf16 as the kernel stores it."""
    inter = w13.shape[1] // 2
    out = torch.empty(ids.shape[0], ids.shape[1], hidden.shape[1])
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = hidden[t].float() @ w13[e].float().t()
            act = (torch.nn.functional.silu(gu[:inter]) * gu[inter:]).bfloat16().float()
            out[t, j] = (act @ w2[e].float().t()) * weights[t, j]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("m", "top_k"), [(1, 8), (3, 8), (8, 8), (64, 8), (5, 4)])
def test_fused_experts_match_the_reference(m: int, top_k: int) -> None:
    moe = _moe()
    w13, w2 = _weights(m)
    hidden = torch.randn(m, H, generator=torch.Generator().manual_seed(100 + m)).bfloat16()
    ids, weights = _routing(m, top_k, seed=m)
    got = moe.fused_experts(hidden, w13, w2, ids.to(torch.int32), weights, E)
    assert got.shape == (m, top_k, H) and got.dtype == torch.bfloat16
    ref = _reference(hidden, w13, w2, ids, weights)
    # the only difference left is the output's bf16 rounding (its own error is ~1.7e-3)
    floor = _rel(ref.bfloat16().float(), ref)
    assert _rel(got.float(), ref) <= floor * 1.05 + 1e-5


def test_every_h200_config_runs_correctly_at_small_shapes() -> None:
    """Each tile shape of the tuned-config file, at shapes where its tiles overhang (K and N
    smaller than some tiles, the wrapped N offsets and the K masks in use)."""
    moe = _moe()
    path = moe.config_file(384, 256, "NVIDIA H200")
    configs = set(moe.load_configs(path).values())
    assert len(configs) >= 5
    w13, w2 = _weights(7, inter=48)
    hidden = torch.randn(6, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    ids, weights = _routing(6, 8, seed=9)
    ref = _reference(hidden, w13, w2, ids, weights)
    floor = _rel(ref.bfloat16().float(), ref)
    for cfg in sorted(configs, key=repr):
        got = moe.fused_experts(hidden, w13, w2, ids, weights, E, config=cfg)
        assert _rel(got.float(), ref) <= floor * 1.05 + 1e-5, cfg


@pytest.mark.parametrize(("m", "top_k", "experts", "block_m"), [
    (1, 8, 384, 16), (2, 8, 384, 16), (3, 8, 32, 16), (64, 8, 384, 16), (40, 4, 16, 32),
    (64, 8, 16, 64),
])  # fmt: skip  # 8 and 16 pairs take the in-register placement, the others the atomic one
def test_alignment_groups_pairs_by_expert_in_padded_blocks(
    m: int, top_k: int, experts: int, block_m: int
) -> None:
    moe = _moe()
    ids, _w = _routing(m, top_k, seed=m + experts, experts=experts)
    al = moe.moe_align_block_size(ids.to(torch.int32), experts, block_m)
    flat = ids.flatten().tolist()
    pairs = len(flat)
    counts = [flat.count(e) for e in range(experts)]
    padded = [(c + block_m - 1) // block_m * block_m for c in counts]
    assert int(al.total) == sum(padded)
    assert al.max_rows == -(-moe.max_padded_rows(pairs, experts, block_m) // block_m) * block_m
    rows = al.sorted_ids[: sum(padded)].tolist()
    blocks = al.expert_ids.tolist()
    n_used = sum(padded) // block_m
    assert all(b == -1 for b in blocks[n_used:])
    expect_blocks = [e for e in range(experts) for _ in range(padded[e] // block_m)]
    assert blocks[:n_used] == expect_blocks
    # every pair exactly once, in pair order within its expert, in a block of its expert
    assert sorted(r for r in rows if r < pairs) == list(range(pairs))
    assert rows.count(pairs) == sum(padded) - pairs
    for i, r in enumerate(rows):
        if r < pairs:
            assert flat[r] == blocks[i // block_m]
    for e in range(experts):
        mine = [r for i, r in enumerate(rows) if r < pairs and blocks[i // block_m] == e]
        assert mine == sorted(mine) and len(mine) == counts[e]


def test_configs_by_token_count_and_their_errors(tmp_path) -> None:
    moe = _moe()
    path = moe.config_file(384, 256, "NVIDIA H200")
    table = moe.load_configs(path)
    assert moe.get_config(1, 384, 256, "NVIDIA H200") == table[1]
    assert moe.get_config(60, 384, 256, "NVIDIA H200") == table[64]
    assert moe.get_config(3, 16, 32, None) == moe.default_config(3)
    assert moe.get_config(3, 384, 256, "Some Other GPU") == moe.default_config(3)
    assert moe.max_padded_rows(8, 384, 16) == 128  # batch 1: 8 blocks, not one per expert
    assert moe.max_padded_rows(512, 384, 16) == 512 + 384 * 15
    up = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "num_stages": 4}
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"1": {"up": up, "down": up}}))
    with pytest.raises(AgentabError, match=r"big\.json: entry '1' up: \d+ bytes of shared"):
        moe.load_configs(big)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"4": {"up": {"BLOCK_SIZE_M": 16}}}))
    with pytest.raises(AgentabError, match=r"broken\.json: entry '4'"):
        moe.load_configs(broken)


def test_cpu_tensors_without_the_interpreter_are_a_clear_error() -> None:
    code = (
        "import torch\n"
        "from agentab.errors import AgentabError\n"
        "from agentab.kernels.triton_moe import fused_experts\n"
        "h = torch.zeros(1, 64, dtype=torch.bfloat16)\n"
        "w13 = torch.zeros(5, 32, 64, dtype=torch.bfloat16)\n"
        "w2 = torch.zeros(5, 64, 16, dtype=torch.bfloat16)\n"
        "try:\n"
        "    fused_experts(h, w13, w2, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2), 4)\n"
        "except AgentabError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=120)  # fmt: skip
    assert "need a CUDA device, or TRITON_INTERPRET=1" in out.stdout

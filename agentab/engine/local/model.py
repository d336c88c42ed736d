"""The model's weights on one device: embedding, D layer weight sets, final norm, LM head.

Layer weights come from `agentab.kernels.weights.init_weights` (seeded, bf16, the layouts both
decode paths read), so the engine serves the very layer that `agentab kernels check` verifies.
On the CPU the weights are kept in fp32 (their values are still the bf16 ones): CPU steps run
in fp32, where both decode backends compute the same math to about 1e-6 and greedy tokens
agree, which is what the CPU tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentab.engine.local.config import ModelConfig
from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import LayerWeights, assemble, expected_shapes, init_weights


@dataclass
class ModelWeights:
    """Everything the forward pass reads, on one device."""

    embed: torch.Tensor  # (vocab_rows, hidden)
    lm_head: torch.Tensor  # (vocab_rows, hidden)
    final_norm: torch.Tensor  # (hidden,)
    sets: list[LayerWeights]  # weight_sets distinct layers; layer l uses sets[l % D]

    def layer(self, index: int) -> LayerWeights:
        return self.sets[index % len(self.sets)]


def _as_dtype(w: LayerWeights, dtype: torch.dtype) -> LayerWeights:
    """The layer with every bf16 tensor cast (the fp32 router bias stays fp32)."""
    t = w.tensors()
    cast = {k: (v if v.dtype == torch.float32 else v.to(dtype)) for k, v in t.items()}
    out = LayerWeights(**cast)
    n_experts = w.w_gate.shape[0]
    if w.shared_fused:  # keep the shared expert a view of the stacked experts, as it was
        out.ws13 = out.w13_all[n_experts:]
        out.ws2 = out.w2_all[n_experts:]
    return out


def bf16_weights(cfg: LayerConfig, seed: int, device: torch.device) -> LayerWeights:
    """The statistics of `init_weights` (N(0, 1/fan_in) linears, 1 + N(0, 0.1^2) norms, a
    small router bias), drawn directly in bf16 one tensor at a time: a 4 GB layer in well under
    a second on a GPU, where `init_weights` draws each expert in fp32. Different values for the
    same seed, which a random model does not care about."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "gate_bias":
            t[name] = torch.randn(shape, generator=gen, device=device).mul_(0.01)
            continue
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        t[name] = x.mul_(0.1).add_(1.0) if name.endswith("norm") else x.mul_(shape[-1] ** -0.5)
    return assemble(cfg, t)


def build_weights(
    cfg: ModelConfig, device: torch.device, seed: int, dtype: torch.dtype, rank: int = 0
) -> ModelWeights:
    """Seeded random weights: set i from seed + i, the vocabulary from seed + D. On the CPU
    `init_weights` (the kernels' own, fp32 draws); on the GPU `bf16_weights`. With tp > 1 every
    rank draws the whole model and keeps its slice, so the ranks together are the tp = 1 model."""
    from agentab.engine.local.tensor_parallel import shard_layer, shard_rows

    sets = []
    for i in range(cfg.weight_sets):
        if device.type == "cuda":
            w = bf16_weights(cfg.layer, seed + i, device)
        else:
            w = init_weights(cfg.layer, seed + i, device)
        w = shard_layer(w, cfg.layer, rank, cfg.tp)
        sets.append(w if dtype == torch.bfloat16 else _as_dtype(w, dtype))
    gen = torch.Generator(device=device).manual_seed(seed + cfg.weight_sets)
    h = cfg.layer.hidden

    def table() -> torch.Tensor:
        t = torch.randn(cfg.vocab_rows, h, generator=gen, device=device, dtype=torch.float32)
        return t.to(torch.bfloat16).to(dtype)

    embed = shard_rows(table(), rank, cfg.tp)
    lm_head = shard_rows(table().mul_(h**-0.5), rank, cfg.tp)
    final_norm = torch.ones(h, device=device, dtype=dtype)
    return ModelWeights(embed=embed, lm_head=lm_head, final_norm=final_norm, sets=sets)

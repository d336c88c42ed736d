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
from agentab.kernels.weights import LayerWeights, init_weights


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


def build_weights(
    cfg: ModelConfig, device: torch.device, seed: int, dtype: torch.dtype
) -> ModelWeights:
    """Seeded random weights: set i from seed + i, the vocabulary from seed + D."""
    sets = []
    for i in range(cfg.weight_sets):
        w = init_weights(cfg.layer, seed + i, device)
        sets.append(w if dtype == torch.bfloat16 else _as_dtype(w, dtype))
    gen = torch.Generator(device=device).manual_seed(seed + cfg.weight_sets)
    h = cfg.layer.hidden

    def table() -> torch.Tensor:
        t = torch.randn(cfg.vocab_rows, h, generator=gen, device=device, dtype=torch.float32)
        return t.to(torch.bfloat16).to(dtype)

    embed = table()
    lm_head = table().mul_(h**-0.5)
    final_norm = torch.ones(h, device=device, dtype=dtype)
    return ModelWeights(embed=embed, lm_head=lm_head, final_norm=final_norm, sets=sets)

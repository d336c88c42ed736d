"""Tensor parallelism for the local engine: how a layer splits over ranks, and the collectives.

The split is vLLM's for DeepSeek-V3 / Kimi-K2 MLA + MoE: the low-rank projections (q_a, kv_a),
the norms and the router are replicated; attention heads are split (q_b, W_UK, W_UV by head,
o_proj by its input columns, so each rank's o_proj output is a partial sum); every expert's
intermediate dimension is split (gate/up by rows, down by columns: partial sums again); one
all-reduce after attention and one after the MoE. The vocabulary is split too: each rank embeds
the ids in its range (an all-reduce completes the embedding) and computes its logits (an
all-gather gives the argmax the whole vocabulary). The latent KV cache is not split (every head
reads all of it), so every rank holds the same cache, as vLLM's MLA does.

`TPGroup` wraps `torch.distributed` (gloo on the CPU, NCCL on GPUs); with one rank every
collective is a no-op, so the single-rank engine runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from agentab.errors import AgentabError
from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import LayerWeights, assemble


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` side by side on the last dimension, in rank order."""
        if self.world == 1:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the step each worker runs, or "stop")."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def shard_config(cfg: LayerConfig, tp: int) -> LayerConfig:
    """One rank's layer: heads and expert intermediates divided by `tp`."""
    for name in ("n_heads", "moe_inter", "shared_inter"):
        value = getattr(cfg, name)
        if value % tp:
            raise AgentabError(f"tp: {tp} does not divide {name} = {value} of layer {cfg.name}")
    return replace(
        cfg,
        name=f"{cfg.name}/tp{tp}" if tp > 1 else cfg.name,
        n_heads=cfg.n_heads // tp,
        moe_inter=cfg.moe_inter // tp,
        shared_inter=cfg.shared_inter // tp,
    )


def shard_layer(w: LayerWeights, full: LayerConfig, rank: int, tp: int) -> LayerWeights:
    """Rank `rank`'s slice of a full layer (the split in the module docstring)."""
    if tp == 1:
        return w
    nh, qk, v = full.n_heads // tp, full.qk_head, full.v_head
    heads = slice(rank * nh, (rank + 1) * nh)

    def experts13(t: torch.Tensor, inter: int) -> torch.Tensor:  # (E, 2I, hidden): gate | up
        part = inter // tp
        gate = t[:, rank * part : (rank + 1) * part]
        up = t[:, inter + rank * part : inter + (rank + 1) * part]
        return torch.cat([gate, up], dim=1).contiguous()

    def experts2(t: torch.Tensor, inter: int) -> torch.Tensor:  # (E, hidden, I)
        part = inter // tp
        return t[:, :, rank * part : (rank + 1) * part].contiguous()

    n_experts = w.w_gate.shape[0]
    t = {
        "attn_norm": w.attn_norm,
        "w_qkv_a": w.w_qkv_a,
        "q_a_norm": w.q_a_norm,
        "kv_a_norm": w.kv_a_norm,
        "w_q_b": w.w_q_b[rank * nh * qk : (rank + 1) * nh * qk].contiguous(),
        "w_uk_t": w.w_uk_t[heads].contiguous(),
        "w_uv": w.w_uv[heads].contiguous(),
        "w_o": w.w_o[:, rank * nh * v : (rank + 1) * nh * v].contiguous(),
        "ffn_norm": w.ffn_norm,
        "w_gate": w.w_gate,
        "gate_bias": w.gate_bias,
        "w13": experts13(w.w13_all[:n_experts], full.moe_inter),
        "w2": experts2(w.w2_all[:n_experts], full.moe_inter),
        "ws13": experts13(w.ws13, full.shared_inter),
        "ws2": experts2(w.ws2, full.shared_inter),
    }
    return assemble(shard_config(full, tp), t)


def shard_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s block of rows (the vocabulary split)."""
    rows = t.shape[0] // tp
    return t[rank * rows : (rank + 1) * rows].contiguous()

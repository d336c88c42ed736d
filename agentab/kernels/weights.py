"""The layer's weights (bf16, seeded random or loaded from safetensors) and its decode state.

The layouts suit both decode paths, so neither pays a copy the other does not:
- `w_qkv_a` stacks q_a and kv_a (vLLM's fused_qkv_a_proj does the same), rows
  [q_lora | kv_lora | qk_rope].
- `w_uk_t[h]` is kv_b's key part for head h transposed to (kv_lora, qk_nope): the absorbed query
  is `q_lat[h] = w_uk_t[h] @ q_nope[h]`, one contiguous row per output (what 128-bit loads want).
- `w_uv[h]` is kv_b's value part, (v_head, kv_lora): `o[h] = w_uv[h] @ o_lat[h]`.
- Experts: `w13_all[e]` stacks gate rows [0, inter) and up rows [inter, 2 inter); `w2_all[e]` is
  the down projection (hidden, inter). When the shared expert has the routed experts' shape it is
  stored as the last entry (index n_experts) of the same tensors, so a kernel can treat it as one
  more expert that every token visits with weight 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from agentab.errors import AgentabError
from agentab.kernels.config import LayerConfig

if TYPE_CHECKING:
    import torch

    from agentab.kernels.attention import PagedKV


@dataclass
class LayerWeights:
    """All parameters of one decoder layer on one rank."""

    attn_norm: torch.Tensor  # (hidden,)
    w_qkv_a: torch.Tensor  # (q_lora + kv_lora + qk_rope, hidden)
    q_a_norm: torch.Tensor  # (q_lora,)
    kv_a_norm: torch.Tensor  # (kv_lora,)
    w_q_b: torch.Tensor  # (n_heads * qk_head, q_lora); per head [nope | rope]
    w_uk_t: torch.Tensor  # (n_heads, kv_lora, qk_nope)
    w_uv: torch.Tensor  # (n_heads, v_head, kv_lora)
    w_o: torch.Tensor  # (hidden, n_heads * v_head)
    ffn_norm: torch.Tensor  # (hidden,)
    w_gate: torch.Tensor  # (n_experts, hidden)
    gate_bias: torch.Tensor  # (n_experts,) fp32 correction bias
    w13_all: torch.Tensor  # (n_experts [+1], 2 * moe_inter, hidden)
    w2_all: torch.Tensor  # (n_experts [+1], hidden, moe_inter)
    ws13: torch.Tensor  # (n_shared, 2 * shared_inter, hidden); a view into w13_all when fused
    ws2: torch.Tensor  # (n_shared, hidden, shared_inter)

    @property
    def shared_fused(self) -> bool:
        """Whether the shared expert is the last entry of w13_all/w2_all."""
        return self.w13_all.shape[0] == self.ws13.shape[0] + self.w_gate.shape[0] and (
            self.ws13.data_ptr() == self.w13_all[-1].data_ptr()
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def expected_shapes(cfg: LayerConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in `LayerWeights` for `cfg` (the shared expert kept separate)."""
    h, nh = cfg.hidden, cfg.n_heads
    return {
        "attn_norm": (h,),
        "w_qkv_a": (cfg.q_lora + cfg.kv_width, h),
        "q_a_norm": (cfg.q_lora,),
        "kv_a_norm": (cfg.kv_lora,),
        "w_q_b": (nh * cfg.qk_head, cfg.q_lora),
        "w_uk_t": (nh, cfg.kv_lora, cfg.qk_nope),
        "w_uv": (nh, cfg.v_head, cfg.kv_lora),
        "w_o": (h, nh * cfg.v_head),
        "ffn_norm": (h,),
        "w_gate": (cfg.n_experts, h),
        "gate_bias": (cfg.n_experts,),
        "w13": (cfg.n_experts, 2 * cfg.moe_inter, h),
        "w2": (cfg.n_experts, h, cfg.moe_inter),
        "ws13": (cfg.n_shared, 2 * cfg.shared_inter, h),
        "ws2": (cfg.n_shared, h, cfg.shared_inter),
    }


def _can_fuse_shared(cfg: LayerConfig) -> bool:
    return cfg.n_shared == 1 and cfg.shared_inter == cfg.moe_inter


def assemble(cfg: LayerConfig, t: dict[str, torch.Tensor]) -> LayerWeights:
    """Build LayerWeights from tensors named as in `expected_shapes`, appending the shared
    expert to the routed ones when it has their shape."""
    import torch

    if _can_fuse_shared(cfg):
        w13_all = torch.cat([t["w13"], t["ws13"]], dim=0)
        w2_all = torch.cat([t["w2"], t["ws2"]], dim=0)
        ws13, ws2 = w13_all[cfg.n_experts :], w2_all[cfg.n_experts :]
    else:
        w13_all, w2_all, ws13, ws2 = t["w13"], t["w2"], t["ws13"], t["ws2"]
    return LayerWeights(
        attn_norm=t["attn_norm"],
        w_qkv_a=t["w_qkv_a"],
        q_a_norm=t["q_a_norm"],
        kv_a_norm=t["kv_a_norm"],
        w_q_b=t["w_q_b"],
        w_uk_t=t["w_uk_t"],
        w_uv=t["w_uv"],
        w_o=t["w_o"],
        ffn_norm=t["ffn_norm"],
        w_gate=t["w_gate"],
        gate_bias=t["gate_bias"],
        w13_all=w13_all,
        w2_all=w2_all,
        ws13=ws13,
        ws2=ws2,
    )


def init_weights(cfg: LayerConfig, seed: int, device: str | torch.device = "cpu") -> LayerWeights:
    """Seeded random bf16 weights scaled so activations stay O(1) through the layer.

    Linear weights are N(0, 1/fan_in); norm weights 1 + N(0, 0.1^2); the router bias N(0, 0.01^2).
    The same seed gives the same weights on the same device type (CPU and CUDA generators differ).
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def lin(*shape: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        return w.mul_(shape[-1] ** -0.5).to(bf16)

    def norm(n: int) -> torch.Tensor:
        w = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        return w.mul_(0.1).add_(1.0).to(bf16)

    shapes = expected_shapes(cfg)
    t: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm"):
            t[name] = norm(shape[0])
        elif name == "gate_bias":
            # Small: a trained correction bias balances expert load, so routing stays near
            # uniform (a large random bias would concentrate tokens on a few experts).
            t[name] = torch.randn(shape, generator=gen, device=device).mul_(0.01)
        elif name in ("w13", "w2"):
            # Expert by expert: a float32 temporary of all 384 experts would need 17 GB.
            t[name] = torch.stack([lin(*shape[1:]) for _ in range(shape[0])])
        else:
            t[name] = lin(*shape)
    return assemble(cfg, t)


def save_safetensors(weights: LayerWeights, cfg: LayerConfig, path: str | Path) -> None:
    """Write the weights under the names of `expected_shapes` (shared expert separate)."""
    from safetensors.torch import save_file

    t = weights.tensors()
    out = {name: t[name].contiguous() for name in expected_shapes(cfg) if name in t}
    out["w13"] = weights.w13_all[: cfg.n_experts].contiguous()
    out["w2"] = weights.w2_all[: cfg.n_experts].contiguous()
    out["ws13"] = weights.ws13.contiguous()
    out["ws2"] = weights.ws2.contiguous()
    save_file(out, str(path))


def load_safetensors(
    cfg: LayerConfig, path: str | Path, device: str | torch.device = "cpu"
) -> LayerWeights:
    """Load a layer saved by `save_safetensors` (or converted to its names); checks shapes."""
    import torch
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise AgentabError(f"{path}: no such weights file")
    t: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        names = set(f.keys())
        for name, shape in expected_shapes(cfg).items():
            if name not in names:
                raise AgentabError(f"{path}: tensor {name!r} missing (preset {cfg.name})")
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != shape:
                raise AgentabError(
                    f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"preset {cfg.name} needs {shape}"
                )
            want = torch.float32 if name == "gate_bias" else torch.bfloat16
            t[name] = tensor.to(want)
    return assemble(cfg, t)


@dataclass
class DecodeState:
    """The latent KV cache of a batch and where each sequence's new token goes.

    `cache[b, :positions[b]]` holds earlier tokens; the step writes its token at `positions[b]`
    and attends over `[0, positions[b]]` inclusive. With `paged` (an
    `agentab.kernels.attention.PagedKV`, the serving engine's block-table cache) `cache` is one
    layer's (slots, kv_width) slots and the new token goes to `paged.new_slots[b]`.
    """

    cache: torch.Tensor  # (batch, max_len, kv_width) bf16, or (slots, kv_width) when paged
    positions: torch.Tensor  # (batch,) int32
    paged: PagedKV | None = None

    def clone(self) -> DecodeState:
        return DecodeState(self.cache.clone(), self.positions.clone(), self.paged)


def init_state(
    cfg: LayerConfig,
    batch: int,
    context: int,
    seed: int,
    device: str | torch.device = "cpu",
    *,
    ragged: bool = False,
) -> DecodeState:
    """A cache of `context` random earlier tokens per sequence (fewer, at random, when `ragged`).

    The cache entries have the statistics of real ones: the compressed part is RMS-normalized
    scale, the rope part unit scale.
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(
        batch, context + 1, cfg.kv_width, generator=gen, device=device, dtype=torch.float32
    ).to(torch.bfloat16)
    if ragged and context > 1:
        pos = torch.randint(1, context + 1, (batch,), generator=gen, device=device)
    else:
        pos = torch.full((batch,), context, device=device)
    return DecodeState(cache=cache, positions=pos.to(torch.int32))

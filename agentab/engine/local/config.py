"""What the local engine's model is: a stack of Kimi-K2-shaped decoder layers and its presets.

The layer is `agentab.kernels.config.LayerConfig` (one tensor-parallel rank's shard), so the
engine runs exactly the layer the kernels are written and checked for. Around it: an embedding
and an LM head over the rank's vocabulary shard, a final RMSNorm, and `num_layers` layers.

A full-depth model (61 layers) of the `k2-tp8-shard` layer does not fit one GPU (61 x 4.2 GB of
weights), so `weight_sets` distinct weight sets are cycled over the layers (layer l uses set
l mod D). Each set is several GB, far larger than the GPU's L2 cache, so every layer still
reads its weights from HBM and a step costs what a model of distinct layers would; the
outputs are a different (but equally random) model's. Nothing here is a trained model: weights
are seeded random, and greedy sampling of random weights makes arbitrary but reproducible
tokens, which is all a serving measurement needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from agentab.errors import AgentabError
from agentab.kernels.config import BF16_BYTES, LayerConfig, get_preset


@dataclass(frozen=True)
class ModelConfig:
    """The model the local engine serves (one rank's shard)."""

    name: str
    layer: LayerConfig
    num_layers: int
    weight_sets: int
    vocab_rows: int  # embedding / LM-head rows (the model's vocabulary shard)
    vocab_size: int = 32000  # ids a client may send; an id maps to row id mod vocab_rows
    tp: int = 1  # tensor-parallel ranks this model is split over (engine.local.tensor_parallel)

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "weight_sets", "vocab_rows", "vocab_size", "tp"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise AgentabError(f"{field_name}: {value!r} must be an integer >= 1")
        if self.weight_sets > self.num_layers:
            raise AgentabError(
                f"weight_sets: {self.weight_sets} is more than num_layers {self.num_layers}"
            )
        if self.vocab_rows % self.tp:
            raise AgentabError(f"tp: {self.tp} does not divide the {self.vocab_rows} vocab rows")
        self.rank_layer  # noqa: B018  (refuses a tp that does not divide heads or experts)

    @property
    def rank_layer(self) -> LayerConfig:
        """One rank's layer: heads and expert intermediates divided by tp."""
        from agentab.engine.local.tensor_parallel import shard_config

        return shard_config(self.layer, self.tp)

    @property
    def rank_vocab_rows(self) -> int:
        return self.vocab_rows // self.tp

    def layer_weight_bytes(self) -> int:
        """Bytes of one layer's weights on one rank: every routed expert's slice plus the dense
        part (bf16)."""
        c = self.rank_layer
        return (c.dense_weight_elems() + c.n_experts * c.expert_weight_elems()) * BF16_BYTES

    def weight_bytes(self) -> int:
        """Bytes of all weights on one rank: the layer sets, embedding, LM head, final norm."""
        vocab = 2 * self.rank_vocab_rows * self.layer.hidden + self.layer.hidden
        return self.weight_sets * self.layer_weight_bytes() + vocab * BF16_BYTES

    def kv_bytes_per_token(self) -> int:
        """Latent-cache bytes per token: kv_lora + qk_rope bf16 values in every layer."""
        return self.num_layers * self.layer.kv_width * BF16_BYTES

    def describe(self) -> dict[str, object]:
        return {
            "preset": self.name,
            "num_layers": self.num_layers,
            "weight_sets": self.weight_sets,
            "vocab_rows": self.vocab_rows,
            "tp": self.tp,
            "layer": asdict(self.layer),
        }


# name: (layer preset, default layers, default weight sets, vocabulary rows)
PRESETS: dict[str, tuple[str, int, int, int]] = {
    # CPU, seconds: every code path at toy sizes (4 layers over 2 weight sets).
    "tiny": ("tiny", 4, 2, 32000),
    # One TP8 rank of Kimi-K2: 61 layers over 8 weight sets (~34 GB of layer weights), and the
    # rank's eighth of the 163,840-token vocabulary.
    "k2-tp8-shard": ("k2-tp8-shard", 61, 8, 163840 // 8),
}


def model_config(
    preset: str,
    *,
    num_layers: int | None = None,
    weight_sets: int | None = None,
    tp: int | None = None,
) -> ModelConfig:
    """The preset's model, with its depth and weight sets overridable."""
    if preset not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise AgentabError(f"preset: unknown local-engine preset {preset!r} (known: {known})")
    layer_name, layers, sets, vocab = PRESETS[preset]
    layers = layers if num_layers is None else num_layers
    sets = min(sets, layers) if weight_sets is None else weight_sets
    return ModelConfig(
        name=preset,
        layer=get_preset(layer_name),
        num_layers=layers,
        weight_sets=sets,
        vocab_rows=vocab,
        tp=1 if tp is None else tp,
    )

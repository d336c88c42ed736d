"""Build a decode path by name (the only place that imports the CuTe DSL path lazily)."""

from __future__ import annotations

from typing import Any

from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import LayerWeights

PATH_NAMES = ("standard", "specialized")


def make_path(name: str, cfg: LayerConfig, weights: LayerWeights, context: int, batch: int) -> Any:
    """A path object with `step(x, state) -> StepOut` for caches of `context + 1` tokens."""
    if name == "standard":
        from agentab.kernels.standard import StandardPath

        return StandardPath(cfg, weights, max_position=context)
    if name == "specialized":
        from agentab.kernels.specialized import SpecializedPath

        return SpecializedPath(cfg, weights, context, batch, max_len=context + 1)
    raise ValueError(f"unknown path {name!r}")

"""Build a decode path by name (the only place that imports the CuTe DSL path lazily)."""

from __future__ import annotations

from typing import Any

from agentab.errors import AgentabError
from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import LayerWeights

# standard: the layer under torch.compile with the Triton fused MoE (vLLM's design);
# standard-eager: the same math op by op; specialized: the CuTe DSL decoder.
PATH_NAMES = ("standard-eager", "standard", "specialized")
STANDARD_PATHS = ("standard-eager", "standard")


def check_path_names(names: tuple[str, ...] | list[str]) -> None:
    """A one-line error naming an unknown path (and the known ones)."""
    for name in names:
        if name not in PATH_NAMES:
            raise AgentabError(f"--paths: unknown path {name!r} (known: {', '.join(PATH_NAMES)})")


def result_key(name: str) -> str:
    """The results documents' key prefix of a path: standard-eager -> standard_eager."""
    return name.replace("-", "_")


def make_path(
    name: str,
    cfg: LayerConfig,
    weights: LayerWeights,
    context: int,
    batch: int,
    paged_slots: int | None = None,
) -> Any:
    """A path object with `step(x, state) -> StepOut` for caches of `context + 1` tokens; with
    `paged_slots`, for the local engine's paged cache of that many slots per layer, positions
    up to `context` (built as `engine.local.cuda` builds its graphs' layers)."""
    if paged_slots is not None and name == "specialized":
        from agentab.kernels.specialized import SpecializedPath

        return SpecializedPath(cfg, weights, context, batch, paged_slots, paged=True)
    if name == "standard-eager":
        from agentab.kernels.standard import StandardPath

        return StandardPath(cfg, weights, max_position=context)
    if name == "standard":
        from agentab.kernels.standard_torch_compile import TorchCompileStandardPath

        return TorchCompileStandardPath(cfg, weights, max_position=context)
    if name == "specialized":
        from agentab.kernels.specialized import SpecializedPath

        return SpecializedPath(cfg, weights, context, batch, max_len=context + 1)
    raise ValueError(f"unknown path {name!r}")

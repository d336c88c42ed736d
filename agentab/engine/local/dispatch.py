"""Which steps the local engine's specialized backend serves when the options do not say.

vLLM's `latency_specialized` path serves every pure decode or uniform verify step of up to 64
padded tokens and falls back to the standard path for the rest. The local engine's CuTe DSL
decoder is not vLLM's kernel: it beats the compiled standard layer at 1, 2 and 4 token rows
and loses from 8 up, verify shapes included (docs/kernels.md; the measurements below). A
backend that serves the shapes where it loses is not one anybody would deploy, so on a device
where those measurements exist the engine routes the losing shapes to the standard path by
default, as vLLM's path routes the steps it does not support, and says so in its description.
Setting `specialized_max_tokens` (up to 64) overrides the table: 64 measures the decoder at
every shape vLLM's path would give it.

A device without a measured row keeps vLLM's rule and the description says that no
measurement stands behind it; the CPU's reference decoder (its timings mean nothing) does too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeasuredDispatch:
    """The widest step (padded token rows) a device's decoder wins at, and the evidence."""

    gpu_name: str
    preset: str
    max_tokens: int
    evidence: str


MEASURED: tuple[MeasuredDispatch, ...] = (
    MeasuredDispatch(
        gpu_name="NVIDIA H200",
        preset="k2-tp8-shard",
        max_tokens=4,
        # per layer, specialized / compiled standard, contexts 4096 and 32768
        evidence=(
            "kernels bench on the H200: decode 1.46x / 1.30x / 1.13x at 1 / 2 / 4 tokens, "
            "0.81-0.93x from 8 to 64; verify 1x4 1.12x, every wider verify shape 0.81-0.95x "
            "(benchmarks/results/kernels-h200.json, kernels-h200-verify-shapes/)"
        ),
    ),
)


@dataclass(frozen=True)
class SpecializedLimit:
    """The padded token count up to which the specialized path serves steps, and why."""

    max_tokens: int
    source: str  # "option", "measured" or "vllm-rule"
    reason: str


def specialized_limit(
    asked: int | None, gpu_name: str | None, preset: str, vllm_limit: int
) -> SpecializedLimit:
    """The engine's limit: the option where set, else the measured row for this device and
    preset (`gpu_name` None: no GPU), else vLLM's rule."""
    if asked is not None:
        return SpecializedLimit(
            min(asked, vllm_limit), "option", f"specialized_max_tokens = {asked}"
        )
    for row in MEASURED:
        if gpu_name == row.gpu_name and preset == row.preset:
            return SpecializedLimit(min(row.max_tokens, vllm_limit), "measured", row.evidence)
    where = f"{gpu_name} and {preset}" if gpu_name else f"the CPU reference decoder and {preset}"
    return SpecializedLimit(
        vllm_limit, "vllm-rule", f"no measured dispatch for {where}: vLLM's rule"
    )

"""TorchExecutor: runs each scheduled step through the model and samples greedily.

The step's path is the scheduler's decision (`StepPlan.path`, vLLM's `latency_specialized`
rules): "specialized" steps, which are always pure decode, run the arm's specialized decoder;
every other step (prefill, mixed, decode under `auto`, decode the specialized path does not
serve) runs the standard forward. The executor counts what it computed, so a prefix-cache hit
shows up as prefill tokens *not* computed, and it measures each step's duration.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from agentab.engine.local.config import ModelConfig
from agentab.engine.local.forward import (
    DeviceBatch,
    greedy,
    specialized_decode_cpu,
    standard_forward,
)
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.outputs import StepInputs, StepOutput
from agentab.engine.scheduler import StepPlan


class TorchExecutor:
    """The local engine's executor (one device, one rank)."""

    measured = True
    needs_inputs = True

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        cache: PagedLatentCache,
        *,
        device: torch.device,
        dtype: torch.dtype,
        decoder_impl: str,
    ) -> None:
        self.cfg = cfg
        self.w = weights
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.decoder_impl = decoder_impl
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "prefill_tokens_computed",
                "decode_tokens_computed",
                "step_seconds_standard",
                "step_seconds_specialized",
            ),
            0.0,
        )

    def execute(self, plan: StepPlan, inputs: StepInputs | None = None) -> StepOutput:
        assert inputs is not None
        t0 = time.perf_counter()
        with torch.inference_mode():
            b = DeviceBatch.of(inputs, self.device)
            if plan.path == "specialized":
                x = specialized_decode_cpu(self.cfg, self.w, self.cache, b)
            else:
                x = standard_forward(self.cfg, self.w, self.cache, b, self.dtype)
            sampled = greedy(self.cfg, self.w, x).cpu().numpy().astype(np.int64)
        duration = time.perf_counter() - t0
        c = self.counters
        c["prefill_tokens_computed"] += plan.num_prefill_tokens
        c["decode_tokens_computed"] += plan.num_decode_tokens
        c["step_seconds_" + plan.path] += duration
        return StepOutput(duration_s=duration, sampled=sampled)

    def describe(self) -> dict[str, Any]:
        return {
            "decoder_impl": self.decoder_impl,
            "device": str(self.device),
            "activation_dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": "bfloat16",
            "weight_dtype": "bfloat16",  # values; the CPU holds them as float32
            "torch_version": torch.__version__,
        }

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "agentab:prefill_tokens_computed_total": c["prefill_tokens_computed"],
            "agentab:decode_tokens_computed_total": c["decode_tokens_computed"],
            "agentab:step_seconds_standard_total": c["step_seconds_standard"],
            "agentab:step_seconds_specialized_total": c["step_seconds_specialized"],
        }

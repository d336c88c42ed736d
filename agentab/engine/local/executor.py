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
from agentab.engine.local.cuda import greedy_cuda
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
        graphs: dict[str, Any] | None = None,
        grouped: list[Any] | None = None,
    ) -> None:
        """`graphs`: on the GPU, each decode path's `cuda.DecodeGraphs`; `grouped`: the weight
        sets' `StandardPath`s, whose grouped MoE the GPU's eager steps use."""
        self.cfg = cfg
        self.w = weights
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.decoder_impl = decoder_impl
        self.graphs = graphs or {}
        self.grouped = grouped
        self._last_end: Any = None  # the previous step's end event (device idle time)
        self._last_return: float | None = None  # when the previous step returned (host)
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "prefill_tokens_computed",
                "decode_tokens_computed",
                "step_seconds_standard",
                "step_seconds_specialized",
                "graph_steps",
                "eager_steps",
                "device_busy_seconds",
                "device_idle_seconds",
                "decode_device_busy_seconds",
                "decode_device_idle_seconds",
                "host_between_steps_seconds",
                "host_launch_seconds",
            ),
            0.0,
        )

    def execute(self, plan: StepPlan, inputs: StepInputs | None = None) -> StepOutput:
        assert inputs is not None
        t0 = time.perf_counter()
        if self._last_return is not None:  # the engine's share of the host overhead
            self.counters["host_between_steps_seconds"] += t0 - self._last_return
        cuda = self.device.type == "cuda"
        with torch.inference_mode():
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
            graphs = self.graphs.get(plan.path)
            size = graphs.size_for(inputs.num_rows) if graphs is not None else None
            if cuda and size is not None and bool(plan.is_decode.all()):
                graphs.load(inputs, size)
                start.record()
                ids = graphs.replay(size)[: inputs.num_rows]
                self.counters["graph_steps"] += 1
            else:
                if plan.path == "specialized" and not cuda:
                    b = DeviceBatch.of(inputs, self.device)
                    x = specialized_decode_cpu(self.cfg, self.w, self.cache, b)
                else:
                    if cuda:
                        start.record()
                    b = DeviceBatch.of(inputs, self.device)
                    x = standard_forward(self.cfg, self.w, self.cache, b, self.dtype, self.grouped)
                ids = (greedy_cuda if cuda else greedy)(self.cfg, self.w, x)
                self.counters["eager_steps"] += 1
            if cuda:
                end.record()
            launched = time.perf_counter()
            sampled = ids.cpu().numpy().astype(np.int64)
        self._last_return = time.perf_counter()
        duration = self._last_return - t0
        self.counters["host_launch_seconds"] += launched - t0
        c = self.counters
        c["prefill_tokens_computed"] += plan.num_prefill_tokens
        c["decode_tokens_computed"] += plan.num_decode_tokens
        c["step_seconds_" + plan.path] += duration
        out = StepOutput(duration_s=duration, sampled=sampled)
        if cuda:
            self._device_times(out, start, end, decode=bool(plan.is_decode.all()))
        return out

    def _device_times(self, out: StepOutput, start: Any, end: Any, *, decode: bool) -> None:
        """Device busy time of the step and the device's idle gap since the previous step
        (host overhead: scheduling, input copies, the sampled ids' return)."""
        c = self.counters
        out.device_s = start.elapsed_time(end) / 1e3
        c["device_busy_seconds"] += out.device_s
        if decode:
            c["decode_device_busy_seconds"] += out.device_s
        if self._last_end is not None:
            out.idle_s = max(self._last_end.elapsed_time(start) / 1e3, 0.0)
            c["device_idle_seconds"] += out.idle_s
            if decode:
                c["decode_device_idle_seconds"] += out.idle_s
        self._last_end = end

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
            "agentab:graph_steps_total": c["graph_steps"],
            "agentab:eager_steps_total": c["eager_steps"],
            "agentab:device_busy_seconds_total": c["device_busy_seconds"],
            "agentab:device_idle_seconds_total": c["device_idle_seconds"],
            "agentab:decode_device_busy_seconds_total": c["decode_device_busy_seconds"],
            "agentab:decode_device_idle_seconds_total": c["decode_device_idle_seconds"],
            # host time from a step's return to the next step's start (scheduling, the engine
            # loop) and from a step's start to its launch (inputs, copies, graph launch)
            "agentab:host_between_steps_seconds_total": c["host_between_steps_seconds"],
            "agentab:host_launch_seconds_total": c["host_launch_seconds"],
        }

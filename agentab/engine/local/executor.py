"""TorchExecutor: runs each scheduled step through the model and samples greedily.

The step's path is the scheduler's decision (`StepPlan.path`, vLLM's `latency_specialized`
rules): "specialized" steps, which are always pure decode, run the arm's specialized decoder;
every other step (prefill, mixed, decode under `auto`, decode the specialized path does not
serve) runs the standard forward. The executor counts what it computed, so a prefix-cache hit
shows up as prefill tokens *not* computed, and it measures each step's duration.

A step is `launch`ed (inputs copied, work queued on the device, the sampled ids' copy back
queued) and later `collect`ed (wait, read the ids): the engine launches the next step before it
collects this one (async scheduling), so the device never waits for the host between steps.
The next step's inputs may name tokens this step is still sampling (`StepInputs.prev_rows`):
every step leaves its sampled ids in one device buffer, from which the next step takes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
from agentab.engine.local.spec import EarlyExitDrafter, VerifyLayout, accept
from agentab.engine.local.tensor_parallel import TPGroup
from agentab.engine.outputs import StepInputs, StepOutput, StepPlan, WindowPlan
from agentab.engine.spec_decode import SpecConfig
from agentab.errors import AgentabError

_HOST_RING = 3  # pinned buffers for sampled ids: more than the steps ever in flight (2)


@dataclass
class Launched:
    """A step whose work is queued on the device."""

    plan: StepPlan
    rows: int
    t0: float
    ids: torch.Tensor  # where the sampled ids arrive (pinned host memory on the GPU)
    events: tuple[Any, Any, Any] | None  # start, end, ids-copied (CUDA events)
    accepted: np.ndarray | None = None  # drafts accepted per row (a step with verify rows)


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
        standard_impl: str,
        max_rows: int,
        graphs: dict[str, Any] | None = None,
        grouped: list[Any] | None = None,
        last_sampled: torch.Tensor | None = None,
        tp: TPGroup | None = None,
        workers: list[Any] | None = None,
        drafter: EarlyExitDrafter | None = None,
        spec: SpecConfig | None = None,
    ) -> None:
        """`decoder_impl` / `standard_impl`: what the specialized and the standard decode steps
        run (the manifest records both: `cute-dsl` or `cpu-torch`; `torch-compile+triton-moe`
        for the GPU's standard decode graphs or `torch-eager`); `max_rows`: the most rows a
        step has (the scheduler's max_num_seqs); `graphs`: on
        the GPU, each decode path's `cuda.DecodeGraphs`, which write their sampled ids into
        `last_sampled`; `grouped`: the weight sets' `StandardPath`s, whose grouped MoE the GPU's
        eager steps use; `tp`: this rank's place in a tensor-parallel group, and on rank 0 the
        other ranks' processes (`workers`), which run every step rank 0 broadcasts;
        `drafter` and `spec`: speculative decoding (engine.local.spec), whose verify steps
        run here, eagerly."""
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.workers = workers or []
        self.w = weights
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.decoder_impl = decoder_impl
        self.standard_impl = standard_impl
        self.graphs = graphs or {}
        self.drafter = drafter
        self.spec = spec
        self.grouped = grouped
        self.cuda = device.type == "cuda"
        self.launches_async = self.cuda  # launch() queues work and returns (see Engine)
        if last_sampled is None:
            last_sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.last_sampled = last_sampled
        self._host = [
            torch.zeros(max_rows, dtype=torch.int64, pin_memory=self.cuda)
            for _ in range(_HOST_RING)
        ]
        self._next_host = 0
        self._last_end: Any = None  # the previous step's end event (device idle time)
        # drafts accepted per row by the previous step (rows of a step scheduled ahead of it
        # start that much later than planned: `_shifted`)
        self._prev_accepted = np.zeros(max_rows, dtype=np.int64)
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "prefill_tokens_computed",
                "decode_tokens_computed",
                "draft_tokens_computed",
                "step_seconds_standard",
                "step_seconds_specialized",
                "graph_steps",
                "eager_steps",
                "device_busy_seconds",
                "device_idle_seconds",
                "decode_device_busy_seconds",
                "decode_device_idle_seconds",
                "host_launch_seconds",
            ),
            0.0,
        )

    def execute(self, plan: StepPlan, inputs: StepInputs | None = None) -> StepOutput:
        """Run one step to completion (launch, then collect)."""
        return self.collect(self.launch(plan, inputs))

    def launch(self, plan: StepPlan, inputs: StepInputs | None = None) -> Launched:
        """Queue the step's work and the copy of its sampled ids; returns at once on a GPU."""
        assert inputs is not None
        t0 = time.perf_counter()
        n = inputs.num_rows
        if self.drafter is not None:
            inputs = self._shifted(inputs)
        if self.tp.active and self.tp.rank == 0:
            self.tp.broadcast(("step", plan, inputs))  # the other ranks run it alongside
        with torch.inference_mode():
            events = None
            if self.cuda:
                timed = torch.cuda.Event(enable_timing=True)
                events = (timed, torch.cuda.Event(enable_timing=True), torch.cuda.Event())
            graphs = self.graphs.get(plan.path)
            size = graphs.size_for(n) if graphs is not None else None
            accepted: np.ndarray | None = None
            if (
                graphs is not None
                and events is not None
                and size is not None
                and bool(plan.is_decode.all())
            ):  # (events exist on the GPU alone)
                graphs.load(inputs, size)
                events[0].record()
                ids = graphs.replay(size)[:n]  # the graph also writes last_sampled
                self.counters["graph_steps"] += 1
            elif self.drafter is not None and bool((plan.drafts > 0).any()):
                if events is not None:
                    events[0].record()
                ids, accepted = self._verify_step(plan, inputs)
                self.counters["eager_steps"] += 1
            else:
                if events is not None:
                    events[0].record()
                b = DeviceBatch.of(inputs, self.device, self.last_sampled)
                x = self._forward(plan, b)
                if self.cuda:
                    ids = greedy_cuda(self.cfg, self.w, x)
                else:
                    ids = greedy(self.cfg, self.w, x, self.tp)
                self.last_sampled[:n].copy_(ids)
                self.counters["eager_steps"] += 1
            if self.drafter is not None:
                self._prev_accepted[:n] = 0 if accepted is None else accepted
            if accepted is not None:  # (rows, 1 + k) tokens: a host tensor of its own
                host = ids.cpu()
                if events is not None:
                    events[1].record()
                    events[2].record()
            else:
                host = self._host[self._next_host][:n]
                self._next_host = (self._next_host + 1) % _HOST_RING
                if events is not None:
                    events[1].record()
                    host.copy_(ids, non_blocking=True)
                    events[2].record()
                else:
                    host.copy_(ids)
        self.counters["host_launch_seconds"] += time.perf_counter() - t0
        return Launched(plan=plan, rows=n, t0=t0, ids=host, events=events, accepted=accepted)

    def _shifted(self, inputs: StepInputs) -> StepInputs:
        """A step scheduled while the previous one ran (async scheduling with drafts): the
        scheduler planned each decoding row as if the previous step had accepted none of its
        drafts; a row that follows a verify row (its first token is that row's pending token)
        starts `accepted` positions later, in its lookahead slots (vLLM corrects its positions
        on the device the same way)."""
        prev = inputs.prev_rows
        if prev is None:
            return inputs
        first = inputs.starts[:-1]
        pending = prev[first]
        shift = np.where(inputs.is_decode & (pending >= 0), self._prev_accepted[pending], 0)
        if not shift.any():
            return inputs
        counts = np.diff(inputs.starts)
        positions = inputs.positions + np.repeat(shift, counts)
        row_of = np.repeat(np.arange(len(counts)), counts)
        bs = inputs.block_size
        tables = inputs.block_tables
        slots = tables[row_of, positions // bs] * bs + positions % bs
        return dataclasses.replace(
            inputs, positions=positions, slot_mapping=slots,
            context_lens=inputs.context_lens + shift,
        )  # fmt: skip

    def _forward(
        self, plan: StepPlan, b: DeviceBatch, out_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The target's hidden states of the tokens `out_index` (default: each row's last) on
        the step's path: the CPU's specialized steps through the reference layer."""
        if plan.path == "specialized" and not self.cuda:
            return specialized_decode_cpu(self.cfg, self.w, self.cache, b, self.tp,
                                          out_index=out_index)  # fmt: skip
        return standard_forward(self.cfg, self.w, self.cache, b, self.dtype, self.grouped,
                                self.tp, out_index=out_index)  # fmt: skip

    def _verify_step(self, plan: StepPlan, inputs: StepInputs) -> tuple[torch.Tensor, np.ndarray]:
        """A step with verify rows (engine.local.spec): draft, verify, accept. Returns the
        (rows, 1 + k) tokens each row emits (the first 1 + accepted of them) and the accepted
        drafts per row."""
        assert self.drafter is not None and self.spec is not None
        b = DeviceBatch.of(inputs, self.device, self.last_sampled)
        layout = VerifyLayout.of(plan, inputs, self.device)
        first = b.token_ids[torch.from_numpy(inputs.starts[layout.rows]).to(self.device)]
        drafted = self.drafter.propose(inputs, layout.rows, layout.drafts, first)
        mask = (
            torch.arange(drafted.shape[1], device=self.device)[None, :]
            < torch.from_numpy(layout.drafts).to(self.device)[:, None]
        )
        b.token_ids = b.token_ids.index_put((layout.draft_slots,), drafted[mask])
        x = self._forward(plan, b, layout.out_index)
        target = greedy(self.cfg, self.w, x, self.tp).cpu().numpy()
        width = 1 + int(plan.drafts.max())
        sampled, accepted = accept(layout, plan, drafted.cpu().numpy(), target, self.spec, width)
        self.counters["draft_tokens_computed"] += int(layout.drafts.sum())
        emitted = torch.from_numpy(sampled[np.arange(len(sampled)), accepted])
        self.last_sampled[: len(sampled)].copy_(emitted)
        return torch.from_numpy(sampled), accepted

    def collect(self, step: Launched) -> StepOutput:
        """Wait for a launched step; its sampled ids, duration and device times."""
        if step.events is not None:
            step.events[2].synchronize()
        sampled = step.ids.numpy().astype(np.int64)  # a copy: the pinned buffer is reused
        duration = time.perf_counter() - step.t0
        plan, c = step.plan, self.counters
        c["prefill_tokens_computed"] += plan.num_prefill_tokens
        c["decode_tokens_computed"] += plan.num_decode_tokens
        out = StepOutput(duration_s=duration, sampled=sampled, accepted=step.accepted)
        if step.events is not None:
            self._device_times(out, step.events[0], step.events[1], bool(plan.is_decode.all()))
        # Seconds by path: the device's time where it is measured, since under async scheduling
        # one step's launch-to-collect host time overlaps the next one's; on the CPU, which runs
        # a step when it is launched, the host time is the step's.
        c["step_seconds_" + plan.path] += duration if out.device_s is None else out.device_s
        return out

    def _device_times(self, out: StepOutput, start: Any, end: Any, decode: bool) -> None:
        """Device busy time of the step and the device's idle gap since the previous step
        (host overhead the launch-ahead did not hide: input copies, a late launch)."""
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

    def window_seconds(self, w: WindowPlan) -> np.ndarray:
        """Never called: a window is priced, and this executor runs its steps one by one."""
        raise AgentabError("the local engine runs steps one at a time; windows are priced")

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the process group."""
        if not (self.tp.active and self.tp.rank == 0):
            return
        import subprocess

        import torch.distributed as dist

        with contextlib.suppress(RuntimeError):  # a worker already gone needs no "stop"
            self.tp.broadcast(("stop",))
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()
        self.tp = TPGroup()

    def describe(self) -> dict[str, Any]:
        return {
            "decoder_impl": self.decoder_impl,
            "standard_impl": self.standard_impl,
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
            "agentab:draft_tokens_computed_total": c["draft_tokens_computed"],
            "agentab:step_seconds_standard_total": c["step_seconds_standard"],
            "agentab:step_seconds_specialized_total": c["step_seconds_specialized"],
            "agentab:graph_steps_total": c["graph_steps"],
            "agentab:eager_steps_total": c["eager_steps"],
            "agentab:device_busy_seconds_total": c["device_busy_seconds"],
            "agentab:device_idle_seconds_total": c["device_idle_seconds"],
            "agentab:decode_device_busy_seconds_total": c["decode_device_busy_seconds"],
            "agentab:decode_device_idle_seconds_total": c["decode_device_idle_seconds"],
            "agentab:host_launch_seconds_total": c["host_launch_seconds"],
        }


if TYPE_CHECKING:  # mypy checks that the local engine's executor is one
    from agentab.engine.executor import Executor

    _TORCH_IS_AN_EXECUTOR: type[Executor] = TorchExecutor

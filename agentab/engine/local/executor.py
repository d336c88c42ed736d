"""TorchExecutor: runs each scheduled step through the model and samples greedily.

The step's path is the scheduler's decision (`StepPlan.path`, vLLM's `latency_specialized`
rules): "specialized" steps, which are always pure decode, run the arm's specialized decoder;
every other step (prefill, mixed, decode under `auto`, decode the specialized path does not
serve) runs the standard forward: in the decode graphs where the step is pure decode and one
fits, else in the piecewise graphs (the `prefill_graphs` option, engine.local.piecewise) where
one of their token buckets holds it, else eagerly. The executor counts what it computed, so a
prefix-cache hit shows up as prefill tokens *not* computed, which of those three ran each step,
and each step's duration.

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
from agentab.engine.local.cuda import (
    DecodeGraphs,
    TokenPool,
    TokenRows,
    greedy_cuda,
    verify_token_rows,
)
from agentab.engine.local.forward import (
    DeviceBatch,
    greedy,
    specialized_decode_cpu,
    standard_forward,
    to_device,
)
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.local.piecewise import PiecewiseGraphs
from agentab.engine.local.spec import (
    EarlyExitDrafter,
    VerifyLayout,
    accept,
    graph_accepted,
    sampled_index,
)
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
    drafted: Any = None  # the CUDA event recorded when a verify step's drafts were made
    draft_s: float | None = None  # the drafts' time where the host measures it (the CPU)


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
        pool: TokenPool | None = None,
        tp: TPGroup | None = None,
        workers: list[Any] | None = None,
        drafter: EarlyExitDrafter | None = None,
        spec: SpecConfig | None = None,
        draft_graphs: DecodeGraphs | None = None,
        piecewise: PiecewiseGraphs | None = None,
    ) -> None:
        """`decoder_impl` / `standard_impl`: what the specialized and the standard decode steps
        run (the manifest records both: `cute-dsl` or `cpu-torch`; `torch-compile+triton-moe`
        for the GPU's standard decode graphs or `torch-eager`); `max_rows`: the most rows a
        step has (the scheduler's max_num_seqs); `graphs`: on the GPU, each decode path's
        `cuda.DecodeGraphs`, which serve pure-decode and verify steps and write their sampled
        ids into the token `pool`; `grouped`: the weight sets' `StandardPath`s, whose grouped
        MoE the GPU's eager steps use; `tp`: this rank's place in a tensor-parallel group, and
        on rank 0 the other ranks' processes (`workers`), which run every step rank 0
        broadcasts;
        `drafter` and `spec`: speculative decoding (engine.local.spec); `draft_graphs`: the
        drafter's graphs, which make the drafts of every verify step where they exist (the
        GPU), the verify step itself then running in the path's graphs when it is pure
        decode (the rest run eagerly)."""
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
        self.pool = pool or TokenPool(max_rows, device)
        self.last_sampled = self.pool.last
        self.draft_graphs = draft_graphs
        self.piecewise = piecewise
        self._piecewise_used = False  # whether this launch's forward ran the pieces
        self._draft_s: float | None = None  # this launch's drafts, timed by the host (the CPU)
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
                "draft_device_seconds",
                "draft_steps",
                "step_seconds_standard",
                "step_seconds_specialized",
                "graph_steps",
                "piecewise_steps",
                "piecewise_too_large_steps",
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
        self._draft_s = None
        self._piecewise_used = False
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
            verify = self.drafter is not None and bool((plan.drafts > 0).any())
            width = len(inputs.token_ids) if verify else n  # the graph's token rows
            size = graphs.size_for(width) if graphs is not None else None
            graphed = graphs is not None and size is not None and bool(plan.is_decode.all())
            accepted: np.ndarray | None = None
            drafted_event = None
            if events is not None:
                events[0].record()
            if verify and graphed and self.draft_graphs is not None:
                assert graphs is not None and size is not None
                ids, accepted, drafted_event = self._verify_in_graphs(plan, inputs, graphs, size)
                self.counters["graph_steps"] += 1
            elif verify:
                ids, accepted = self._verify_step(plan, inputs)
                self._count_eager()
            elif graphed:
                assert graphs is not None and size is not None
                graphs.load(inputs, size)
                ids = graphs.replay(size)[:n]  # the graph also writes last_sampled
                self.counters["graph_steps"] += 1
            else:
                b = DeviceBatch.of(inputs, self.device, self.last_sampled)
                ids = self._greedy(self._forward(plan, b))
                self.last_sampled[:n].copy_(ids)
                self._count_eager()
            if self.drafter is not None:
                self._prev_accepted[:n] = 0 if accepted is None else accepted
            if ids.device.type == "cpu":  # (a verify step's host tensor, or the CPU's ids)
                host = ids.clone()
                if events is not None:
                    events[1].record()
                    events[2].record()
            else:
                if accepted is None:
                    host = self._host[self._next_host][:n]
                    self._next_host = (self._next_host + 1) % _HOST_RING
                else:  # (rows, 1 + k) tokens: a pinned buffer of their own
                    host = torch.empty(ids.shape, dtype=torch.int64, pin_memory=True)
                assert events is not None
                events[1].record()
                host.copy_(ids, non_blocking=True)
                events[2].record()
        self.counters["host_launch_seconds"] += time.perf_counter() - t0
        return Launched(plan=plan, rows=n, t0=t0, ids=host, events=events, accepted=accepted,
                        drafted=drafted_event, draft_s=self._draft_s)  # fmt: skip

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

    def _count_eager(self) -> None:
        """A step that ran no whole-step graph: in the pieces, or eagerly (and whether the
        pieces were there but the step was larger than their largest bucket)."""
        c = self.counters
        if self._piecewise_used:
            c["piecewise_steps"] += 1
            return
        c["eager_steps"] += 1

    def _forward(
        self, plan: StepPlan, b: DeviceBatch, out_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The target's hidden states of the tokens `out_index` (default: each row's last) on
        the step's path: the CPU's specialized steps through the reference layer, the standard
        path in the piecewise graphs where the step fits one of their buckets."""
        if plan.path == "specialized" and not self.cuda:
            return specialized_decode_cpu(self.cfg, self.w, self.cache, b, self.tp,
                                          out_index=out_index)  # fmt: skip
        if self.piecewise is not None:
            bucket = self.piecewise.bucket_for(b.starts[-1])
            if bucket is not None:
                self._piecewise_used = True
                return self.piecewise.forward(b, bucket, out_index)
            self.counters["piecewise_too_large_steps"] += 1
        return standard_forward(self.cfg, self.w, self.cache, b, self.dtype, self.grouped,
                                self.tp, out_index=out_index)  # fmt: skip

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy ids of hidden states: the GPU's bf16 LM head with fp32 logits, or the CPU's."""
        if self.cuda:
            return greedy_cuda(self.cfg, self.w, x)
        return greedy(self.cfg, self.w, x, self.tp)

    def _verify_step(self, plan: StepPlan, inputs: StepInputs) -> tuple[torch.Tensor, np.ndarray]:
        """A step with verify rows (engine.local.spec): draft, verify, accept. Returns the
        (rows, 1 + k) tokens each row emits (the first 1 + accepted of them) and the accepted
        drafts per row."""
        assert self.drafter is not None and self.spec is not None
        b = DeviceBatch.of(inputs, self.device, self.last_sampled)
        layout = VerifyLayout.of(plan, inputs, self.device)
        t0 = time.perf_counter()
        if self.draft_graphs is not None:
            self._draft_in_graphs(inputs, layout)
            drafted = self._drafts_of(layout)
        else:
            first = b.token_ids[torch.from_numpy(inputs.starts[layout.rows]).to(self.device)]
            drafted = self.drafter.propose(inputs, layout.rows, layout.drafts, first)
        if not self.cuda:  # the CPU computes as it goes: its host time is the drafts' time
            self._draft_s = time.perf_counter() - t0
        mask = (
            torch.arange(drafted.shape[1], device=self.device)[None, :]
            < torch.from_numpy(layout.drafts).to(self.device)[:, None]
        )
        b.token_ids = b.token_ids.index_put((layout.draft_slots,), drafted[mask])
        x = self._forward(plan, b, layout.out_index)
        target = self._greedy(x).cpu().numpy()
        width = 1 + int(plan.drafts.max())
        sampled, accepted = accept(layout, plan, drafted.cpu().numpy(), target, self.spec, width)
        self.counters["draft_tokens_computed"] += int(layout.drafts.sum())
        emitted = torch.from_numpy(sampled[np.arange(len(sampled)), accepted])
        self.last_sampled[: len(sampled)].copy_(emitted)
        return torch.from_numpy(sampled), accepted

    def _draft_in_graphs(self, inputs: StepInputs, layout: VerifyLayout) -> None:
        """The verify rows' drafts, made by the drafter's graph in one replay: draft j of a
        row is the greedy token after its token at position p + j (its first token, then
        draft j - 1), written into the token pool at the draft's index in the step's flat
        batch, where the verify step reads it (`cuda.DecodeGraphs._draft_loop`). Nothing here
        waits for the device: one pinned copy, one replay."""
        dg, pool = self.draft_graphs, self.pool
        assert dg is not None
        bs = inputs.block_size
        first = inputs.starts[layout.rows]
        d = layout.drafts
        p = inputs.positions[first]
        tables = inputs.block_tables[layout.rows]
        prev = np.full(len(first), -1, dtype=np.int64)
        if inputs.prev_rows is not None:
            prev = inputs.prev_rows[first]
        slots = tables[np.arange(len(first)), p // bs] * bs + p % bs
        size = dg.size_for(len(first))
        if size is None:
            raise AgentabError(f"{len(first)} rows draft; the drafter's graphs hold fewer")
        rows = TokenRows(inputs.token_ids[first], p, slots, prev, pool.draft_base + first + 1,
                         tables, drafts=d)  # fmt: skip
        dg.load_rows(rows, size, int(p.max() + d.max()))
        dg.replay(size)

    def _drafts_of(self, layout: VerifyLayout) -> torch.Tensor:
        """The verify rows' drafts from the token pool, as the eager verify step takes them:
        (verify rows, most drafts), 0 past a row's own."""
        pool = self.pool
        at = layout.draft_at_rows  # flat index, -1 past a row's own
        where = torch.from_numpy(np.where(at >= 0, pool.draft_base + at, pool.scratch))
        drafted = pool.data[where.to(self.device).view(-1)].view(at.shape)
        return torch.where(torch.from_numpy(at >= 0).to(self.device), drafted, 0)

    def _verify_in_graphs(
        self, plan: StepPlan, inputs: StepInputs, graphs: DecodeGraphs, size: int
    ) -> tuple[torch.Tensor, np.ndarray, Any]:
        """A pure-decode step with verify rows, in graphs end to end: the drafts (the drafter's
        graphs), then every token of the step as a row of the path's graph of padded `size`
        (a verify row's drafts read from the pool), then the emitted tokens gathered on the
        device. Returns the (rows, 1 + k) emitted tokens (a device tensor), the drafts accepted
        per row and the event recorded after drafting (None on the CPU).

        Synthetic acceptance is decided on the host before the step (`graph_accepted`), so
        nothing waits for the device; `standard` compares drafts with the target's tokens,
        which waits for the step's ids (a GPU run for the counters' sake keeps `synthetic`)."""
        assert self.spec is not None
        pool, n = self.pool, inputs.num_rows
        layout = VerifyLayout.of(plan, inputs, self.device)
        t0 = time.perf_counter()
        self._draft_in_graphs(inputs, layout)
        drafted_event = None
        if self.cuda:
            drafted_event = torch.cuda.Event(enable_timing=True)
            drafted_event.record()
        else:
            self._draft_s = time.perf_counter() - t0
        tokens = len(inputs.token_ids)
        prev = np.full(tokens, -1, dtype=np.int64)
        if inputs.prev_rows is not None:
            prev[:] = inputs.prev_rows
        prev[layout.draft_at] = pool.draft_base + layout.draft_at
        dest = np.full(tokens, pool.scratch, dtype=np.int64)  # gathered below instead
        rows = verify_token_rows(inputs, prev, dest)
        graphs.load_rows(rows, size, int(inputs.context_lens.max()))
        target = graphs.replay(size)[:tokens]
        src = torch.cat([target, pool.data[pool.draft_base : pool.draft_base + tokens]])
        accepted = graph_accepted(layout, plan, self.spec, src, tokens)
        width = 1 + int(plan.drafts.max())
        index, emit = sampled_index(inputs.starts, layout, accepted, width, tokens)
        where = to_device(np.concatenate([index.ravel(), emit]), self.device)
        picked = src.index_select(0, where)
        self.last_sampled[:n].copy_(picked[n * width :])
        self.counters["draft_tokens_computed"] += int(layout.drafts.sum())
        return picked[: n * width].view(n, width), accepted, drafted_event

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
        if step.drafted is not None and step.events is not None:
            c["draft_device_seconds"] += step.events[0].elapsed_time(step.drafted) / 1e3
            c["draft_steps"] += 1
        elif step.draft_s is not None:
            c["draft_device_seconds"] += step.draft_s
            c["draft_steps"] += 1
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
            "agentab:draft_device_seconds_total": c["draft_device_seconds"],
            "agentab:draft_steps_total": c["draft_steps"],
            "agentab:step_seconds_standard_total": c["step_seconds_standard"],
            "agentab:step_seconds_specialized_total": c["step_seconds_specialized"],
            "agentab:graph_steps_total": c["graph_steps"],
            "agentab:piecewise_steps_total": c["piecewise_steps"],
            "agentab:piecewise_too_large_steps_total": c["piecewise_too_large_steps"],
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

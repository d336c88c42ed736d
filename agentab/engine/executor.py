"""The executor side of the engine: the protocol, and SimExecutor (a step's price, no model).

An executor takes a scheduled step and returns what it produced (`outputs.StepOutput`); the
scheduler updates its requests from that output only. Two kinds exist:
- `measured = False` (the simulator): `execute` returns at once with the step's *price*; the
  engine sleeps for it on its clock (virtual or real).
- `measured = True` (a real model, `agentab.engine.local`): the step runs on the device and
  returns the measured duration and the sampled tokens; the engine launches and collects it in
  a worker thread so the server keeps streaming while the device works, and on a GPU launches
  the next step before collecting this one (async scheduling, `launches_async`).

SimExecutor prices a step from a HardwareProfile.

Decode-only steps (every row decoding or verifying) run on the step's path:
    fixed[path] + layers * layer_time[path](padded tokens) + context tokens * kv_read + drafter
    + verify_context_token_us * sum over verify rows of (drafts * context tokens).
Steps with prefill tokens run the standard path, and the mixed-step rule is additive: the decode
part priced as above at the step's total token count (clipped at the table's end, unpadded), plus
compute-bound prefill (tokens / (tokens_per_s_per_gpu * gpu_count)) plus causal attention FLOPs of
the prefill chunks over their context, plus `mixed_decode_row_us` per decode row (what an engine
that attends a mixed step's decode rows one by one pays beyond that), plus `mixed_verify_row_us`
per verify row of a mixed step (its 1 + k query tokens beside the prompt's chunk; 0 unless the
profile prices it), plus, where the profile states the engine's prefill graph sizes
(`prefill_graph_tokens`), the step's padding up to the next size at the prefill per-token rate.
The drafter's cost is added to every step that has a decoding row when speculative decoding is
on, and so is the verify rows' extra KV read (`verify_context_token_us`, 0 unless the profile
prices it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from agentab.engine import price_numba
from agentab.engine.noise import StepNoise
from agentab.engine.outputs import StepInputs, StepOutput, StepPlan, WindowPlan, synthetic_outcome
from agentab.engine.paths import graph_padding
from agentab.engine.profile import HardwareProfile
from agentab.engine.spec_decode import SpecConfig


class Executor(Protocol):
    """Everything the engine calls on an executor (agentab.engine.core).

    A step is `launch`ed and later `collect`ed: a measured executor queues the step's work on
    its device in `launch` and waits for it in `collect` (the engine runs both in worker
    threads); a priced one knows the outcome at once, so `launch` returns it and `collect` hands
    it back. `execute` is the two in one.
    """

    # True: steps do real work and their durations are measured (a model on a device); False:
    # steps are priced by a cost model and the engine sleeps for the price on its clock
    measured: bool
    # True: launch() needs the step's StepInputs (tokens, positions, block tables)
    needs_inputs: bool
    # True: launch() returns before the work is done, so the engine schedules the next step
    # while this one runs (async scheduling of a measured executor)
    launches_async: bool

    def launch(self, plan: StepPlan, inputs: StepInputs | None = None) -> Any:
        """Start the step; returns a handle for `collect`."""
        ...

    def collect(self, launched: Any) -> StepOutput:
        """The outcome of a launched step (waits for its work)."""
        ...

    def execute(self, plan: StepPlan, inputs: StepInputs | None = None) -> StepOutput:
        """Launch and collect one step."""
        ...

    def window_seconds(self, w: WindowPlan) -> np.ndarray:
        """Each step's duration in a window of pure-decode steps (the simulator's fast path,
        agentab.engine.window); a measured executor, which runs steps, raises."""
        ...

    def describe(self) -> dict[str, Any]:
        """What a run manifest records about the executor."""
        ...

    def metrics(self) -> dict[str, float]:
        """Its counters, under Prometheus names."""
        ...

    def close(self) -> None:
        """Release what it holds (another process, a device); called once, at the engine's stop."""
        ...


class SimExecutor:
    """Prices steps; holds no state, so one profile can price any number of engines."""

    measured = False
    needs_inputs = False
    launches_async = False

    def __init__(
        self,
        profile: HardwareProfile,
        num_draft_tokens: int = 0,
        spec: SpecConfig | None = None,
        noise: StepNoise | None = None,
    ) -> None:
        self.profile = profile
        # Timing noise (agentab.engine.noise): off unless asked for, so prices stay exact.
        self.noise = noise.sampler() if noise is not None and noise.active else None
        self.k = num_draft_tokens
        self.spec = spec if spec is not None else SpecConfig()
        self.kv_us = profile.kv_read_us_per_context_token()
        self.prefill_us_per_token = 1e6 / (profile.prefill_tokens_per_s_per_gpu * profile.gpu_count)
        self.attn_us_per_pair = (
            1e6
            * profile.attention_flops_per_token_pair
            / (profile.attention_flops_per_s_per_gpu * profile.gpu_count)
        )
        self.prefill_ctx_us = profile.prefill_context_token_us
        self.mixed_row_us = profile.mixed_decode_row_us
        self.prefill_graphs = profile.prefill_graph_tokens
        self.drafter_row_us = profile.drafter_row_us if num_draft_tokens else 0.0
        self.verify_ctx_us = profile.verify_context_token_us if num_draft_tokens else 0.0
        self.mixed_verify_us = profile.mixed_verify_row_us if num_draft_tokens else 0.0
        self._base_cache: dict[tuple[str, int], float] = {}

    def decode_base_us(self, path: str, tokens: int) -> float:
        """Fixed + per-layer cost of a decode step of `tokens` (padded) tokens on `path`."""
        key = (path, tokens)
        base = self._base_cache.get(key)
        if base is None:
            table = self.profile.table(path)
            t = min(tokens, table.max_tokens)
            base = table.step_fixed_us + self.profile.num_layers * table.layer_us(t)
            if self.k:
                base += self.profile.drafter_step_us
            self._base_cache[key] = base
        return base

    def execute(self, plan: StepPlan, inputs: StepInputs | None = None) -> StepOutput:
        """The step's price and its synthetic outcome (accepted drafts; output ids are fixed)."""
        seconds = self.step_seconds(plan)
        if self.noise is not None:
            seconds *= self.noise.one()
        return synthetic_outcome(plan, self.spec, seconds)

    def launch(self, plan: StepPlan, inputs: StepInputs | None = None) -> StepOutput:
        """The priced outcome (known at once)."""
        return self.execute(plan, inputs)

    def collect(self, launched: StepOutput) -> StepOutput:
        return launched

    def describe(self) -> dict[str, Any]:
        return {}

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None

    def step_seconds(self, plan: StepPlan) -> float:
        if plan.total_tokens == 0:
            return 0.0
        # the rows' sums in one pass (price_numba): decoding rows and their context, rows
        # with drafts and the verify rows' drafts x context, the prefill rows' terms
        dec_rows, ctx, drafted, verify, pre_tokens, pairs, pre_c0, pre_rows = price_numba.step_sums(
            plan.num_sched, plan.computed_before, plan.is_decode, plan.drafts
        )
        if pre_rows == 0:
            us = self.decode_base_us(plan.path, plan.padded_tokens) + self.kv_us * ctx
            if self.drafter_row_us:  # only profiles that price it
                us += self.drafter_row_us * drafted
            if self.verify_ctx_us:  # only profiles that price it
                us += self.verify_ctx_us * float(verify)
            return us * 1e-6
        table = self.profile.standard
        t = min(plan.total_tokens, table.max_tokens)
        us = table.step_fixed_us + self.profile.num_layers * table.layer_us(t)
        if self.k and dec_rows:
            us += self.profile.drafter_step_us
            us += self.drafter_row_us * drafted
        us += self.kv_us * ctx + self.prefill_us_per_token * float(pre_tokens)
        if self.prefill_graphs:  # only profiles that state them: the step's graph padding
            us += self.prefill_us_per_token * graph_padding(plan.total_tokens, self.prefill_graphs)
        us += self.attn_us_per_pair * float(pairs)
        if self.prefill_ctx_us:  # only profiles that price it
            us += self.prefill_ctx_us * float(pre_c0)
        if self.mixed_row_us:  # only profiles that price it
            us += self.mixed_row_us * dec_rows
        if self.verify_ctx_us:  # only profiles that price it
            us += self.verify_ctx_us * float(verify)
        if self.mixed_verify_us:  # only profiles that price it; a prefill row has no drafts
            us += self.mixed_verify_us * drafted
        return us * 1e-6

    def window_seconds(self, w: WindowPlan) -> np.ndarray:
        """Durations of each step of a pure-decode window (same formula as step_seconds)."""
        base = self.decode_base_us(w.path, w.padded_tokens)
        kv_us = self.kv_us
        if w.q > 1:  # a window of verify steps: every row drafts q - 1 tokens
            base += self.drafter_row_us * len(w.slots)
            kv_us += self.verify_ctx_us * (w.q - 1)
        seconds = (base + kv_us * w.context) * 1e-6
        if self.noise is not None:
            seconds = seconds * self.noise.many(len(seconds))
        return seconds


if TYPE_CHECKING:  # mypy checks that the simulator's executor is one
    _SIM_IS_AN_EXECUTOR: type[Executor] = SimExecutor

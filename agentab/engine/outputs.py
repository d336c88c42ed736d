"""What crosses the seam between the scheduler and an executor, in both directions.

The scheduler decides what a step runs (`StepPlan`, vLLM's `SchedulerOutput`); an executor runs
it and says what came out (`StepOutput`); the scheduler then updates its requests from that
output alone (`Scheduler.update`, vLLM's `update_from_output`) and says what that did
(`Advance`). An executor that runs a real model also needs the step's tokens, positions and KV
block tables (`StepInputs`), which the scheduler builds on request, so the simulator pays
nothing for them. `WindowPlan` is the simulator's fast path: many pure-decode steps of the
same rows planned at once (agentab.engine.window).

Speculative decoding uses the same types: a decoding row scheduled for 1 + k tokens verifies
`StepPlan.drafts[i]` draft tokens; the executor reports how many it accepted
(`StepOutput.accepted[i]`) and, for a real model, the 1 + accepted tokens it sampled
(`StepOutput.sampled[i, :1 + accepted]`); the scheduler rolls back the rejected drafts' KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from agentab.engine.spec_decode import SpecConfig

if TYPE_CHECKING:
    from agentab.engine.request import Request


@dataclass
class StepPlan:
    """What one step runs: rows (slots) in schedule order and their token counts."""

    slots: np.ndarray
    num_sched: np.ndarray
    computed_before: np.ndarray
    is_decode: np.ndarray
    drafts: np.ndarray  # draft tokens each decoding row verifies (0: a plain decode row)
    keys: np.ndarray  # rows' request keys (a synthetic acceptance draws from them)
    spec_index: np.ndarray  # rows' verify-step counters
    path: str
    total_tokens: int
    padded_tokens: int
    preempted: list[str]
    num_running: int
    num_waiting: int

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.num_sched[~self.is_decode].sum())

    @property
    def num_decode_tokens(self) -> int:
        return int(self.num_sched[self.is_decode].sum())

    @property
    def decode_context_tokens(self) -> int:
        """Context tokens the decode rows attend to (their KV read this step)."""
        d = self.is_decode
        return int((self.computed_before[d] + self.num_sched[d]).sum())


@dataclass
class WindowPlan:
    """`num_steps` pure-decode steps of the same rows, priced at once (agentab.engine.window)."""

    slots: np.ndarray
    q: int
    path: str
    padded_tokens: int
    emitted: np.ndarray  # (steps, rows) tokens emitted per step, capped at max_tokens
    accepted: np.ndarray  # (steps, rows) drafts accepted
    context: np.ndarray  # (steps,) context tokens read per step (sum over rows)
    computed0: np.ndarray  # (rows,) computed tokens at the window start
    cum_uncapped: np.ndarray  # (steps, rows) inclusive cumulative emitted before capping
    num_running: int
    num_waiting: int

    @property
    def num_steps(self) -> int:
        return int(self.emitted.shape[0])


@dataclass
class Advance:
    """What applying one step did: the requests that emit tokens (how many each, where in
    their token buffers, from which row of the step) and the requests that finished."""

    reqs: list[Request]
    counts: list[int]
    finished: list[Request]
    starts: list[int]
    rows: list[int]
    step: int = 0  # its number among the steps advanced ahead of their tokens (0: not one)


@dataclass
class StepOutput:
    """What one executed step produced.

    `sampled[i, j]` is the j-th token sampled for row i of the plan (j < 1 + drafts accepted);
    only the rows that emit tokens this step (decoding rows, and rows whose prompt the step
    completes) are read. None means the executor samples nothing itself: the request's output
    was fixed when it was admitted (the simulator's synthetic ids). `accepted[i]` is the number
    of draft tokens row i accepted (None: no speculative decoding). `duration_s` is the step's
    duration: priced by a cost model (the simulator) or measured on the device (a real model).
    """

    duration_s: float
    sampled: np.ndarray | None = None
    accepted: np.ndarray | None = None
    device_s: float | None = None  # measured device busy time of the step, where known
    idle_s: float | None = None  # device idle time between the previous step and this one


@dataclass
class StepInputs:
    """A model's view of one step: the flat token batch and each row's slice of the KV cache.

    Rows are in the plan's order. Row i's tokens are `token_ids[starts[i]:starts[i+1]]`, at
    positions `positions[...]` (the same slice); the row attends over its first
    `context_lens[i]` cached positions (earlier tokens plus this step's), which live in the
    blocks `block_tables[i, :ceil(context_lens[i] / block_size)]`. `slot_mapping` says where
    each new token's KV entry goes (block id * block size + offset).
    """

    token_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    starts: np.ndarray  # (rows + 1,) int64
    context_lens: np.ndarray  # (rows,) int64
    block_tables: np.ndarray  # (rows, max blocks) int64
    slot_mapping: np.ndarray  # (T,) int64
    is_decode: np.ndarray  # (rows,) bool
    block_size: int
    # (T,) int64: -1, or the row of the previous step whose sampled token this token is (it was
    # still being sampled when this step was scheduled; the executor takes it on the device)
    prev_rows: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @classmethod
    def of_rows(
        cls,
        computed: np.ndarray,
        num_new: np.ndarray,
        block_tables: np.ndarray,
        token_ids: np.ndarray,
        block_size: int,
    ) -> StepInputs:
        """A step built by hand (checks and benchmarks): row i computes `num_new[i]` tokens after
        its `computed[i]` cached ones, in the blocks of `block_tables[i]`; rows of one new token
        decode."""
        computed = np.asarray(computed, dtype=np.int64)
        num_new = np.asarray(num_new, dtype=np.int64)
        starts, positions, slot_mapping = flat_layout(computed, num_new, block_tables, block_size)
        return cls(
            token_ids=np.asarray(token_ids, dtype=np.int64),
            positions=positions,
            starts=starts,
            context_lens=computed + num_new,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            is_decode=num_new == 1,
            block_size=block_size,
        )


def flat_layout(
    computed: np.ndarray, num_new: np.ndarray, block_tables: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The flat batch of a step whose row i computes `num_new[i]` tokens after `computed[i]`:
    each row's start in it, every token's position, and the KV slot each token writes."""
    starts = np.zeros(len(num_new) + 1, dtype=np.int64)
    np.cumsum(num_new, out=starts[1:])
    row_of = np.repeat(np.arange(len(num_new)), num_new)
    positions = np.arange(int(starts[-1]), dtype=np.int64) - starts[row_of] + computed[row_of]
    slots = block_tables[row_of, positions // block_size] * block_size + positions % block_size
    return starts, positions, slots


def synthetic_outcome(plan: StepPlan, spec: SpecConfig, duration_s: float) -> StepOutput:
    """The simulator's outcome of a step: drafts accepted by the synthetic acceptance model
    (drawn per request and verify step, so independent of batching), no sampled tokens (the
    output ids were fixed at admission)."""
    accepted = None
    # (count_nonzero: `any` goes through numpy's Python wrapper, a few us a step)
    if spec.synthetic and np.count_nonzero(plan.is_decode):
        accepted = spec.accepted(plan.keys, plan.spec_index, plan.drafts)
    return StepOutput(duration_s=duration_s, accepted=accepted)

"""What a real model needs from the scheduler: a step's inputs, and its sampled tokens back.

Why apart: the simulator never builds inputs (its executor prices a plan) and never samples (its
output ids are fixed at admission), so none of this runs in a simulation; the local engine's
executor needs both. `model_inputs` lays a plan out as the model runs it (flat tokens,
positions, block tables, KV slots; outputs.StepInputs). `fill` writes what a step sampled
after each request's known tokens and hashes the blocks those tokens complete, so they can be
cached (with sampled output a block's prefix key is known only once its last token is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentab.engine.hashing import chain_hashes
from agentab.engine.outputs import Advance, StepInputs, StepPlan, flat_layout
from agentab.errors import AgentabError

if TYPE_CHECKING:
    from agentab.engine.scheduler import Scheduler


def model_inputs(s: Scheduler, plan: StepPlan) -> StepInputs:
    """The step as a model runs it. A token still being sampled by the step in flight (async
    scheduling) is named by its row there (`StepInputs.prev_rows`)."""
    rows = plan.slots
    n = plan.num_sched
    comp = plan.computed_before
    ctx = comp + n
    width = max(1, -(-int(ctx.max()) // s.bs)) if len(rows) else 1
    tables = s.state.block_table[rows, :width].copy()
    starts, positions, slot_mapping = flat_layout(comp, n, tables, s.bs)
    token_ids = np.empty(len(positions), dtype=np.int64)
    prev_rows = np.full(len(positions), -1, dtype=np.int64)
    for i, req in enumerate(s.requests_of(rows)):
        token_ids[starts[i] : starts[i + 1]] = req.tokens[comp[i] : comp[i] + n[i]]
        if req.pending_row >= 0:  # its latest token is being sampled by the step in flight
            prev_rows[starts[i + 1] - 1] = req.pending_row
    return StepInputs(
        token_ids=token_ids,
        positions=positions,
        starts=starts,
        context_lens=ctx,
        block_tables=tables,
        slot_mapping=slot_mapping,
        is_decode=plan.is_decode.copy(),
        block_size=s.bs,
        prev_rows=prev_rows,
    )


def fill(s: Scheduler, adv: Advance, sampled: np.ndarray) -> None:
    """Write a step's sampled tokens (`sampled[row, :count]`, rows as in its plan) after each
    request's known ones, hash the blocks they complete and clear their pending marks."""
    if s.cfg.synthetic_output:
        raise AgentabError("the executor sampled tokens, but this scheduler plans synthetic output")
    sampled = np.asarray(sampled)
    if sampled.ndim == 1:
        sampled = sampled[:, None]
    bs = s.bs
    for req, n, at, row in zip(adv.reqs, adv.counts, adv.starts, adv.rows, strict=True):
        req.tokens[at : at + n] = sampled[row, :n]
        if req.pending_step == adv.step:  # (a later step may have marked it since)
            req.pending_row = req.pending_step = -1
        done = len(req.hashes)
        full = (at + n) // bs
        if full <= done:
            continue
        keys, req.raw_hash = chain_hashes(req.tokens[done * bs : full * bs], bs, done, req.raw_hash)
        req.hashes = np.concatenate([req.hashes, keys])
        if req.is_running:  # (not finished, preempted or aborted)
            s.note_hashes(req, done, keys)

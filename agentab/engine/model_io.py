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
from agentab.engine.request import RequestStatus
from agentab.errors import AgentabError

if TYPE_CHECKING:
    from agentab.engine.request import Request
    from agentab.engine.scheduler import Scheduler


def model_inputs(s: Scheduler, plan: StepPlan) -> StepInputs:
    """The step as a model runs it. A token still being sampled by the step in flight (async
    scheduling) is named by its row there (`StepInputs.prev_rows`)."""
    rows = plan.slots
    n = plan.num_sched
    comp = plan.computed_before
    ctx = comp + n
    # (+ k: a row may start up to k tokens later than planned, once the verify step in flight
    # says how many drafts it accepted: the executor shifts it into its lookahead blocks)
    width = max(1, -(-(int(ctx.max()) + s.k) // s.bs)) if len(rows) else 1
    tables = s.state.block_table[rows, :width].copy()
    starts, positions, slot_mapping = flat_layout(comp, n, tables, s.bs)
    token_ids = np.empty(len(positions), dtype=np.int64)
    prev_rows = np.full(len(positions), -1, dtype=np.int64)
    for i, req in enumerate(s.requests_of(rows)):
        token_ids[starts[i] : starts[i + 1]] = req.tokens[comp[i] : comp[i] + n[i]]
        if req.pending_row >= 0:  # its latest token is being sampled by the step in flight
            # (a decoding row's first token: a verify row's drafts come after it)
            at = starts[i] if plan.is_decode[i] else starts[i + 1] - 1
            prev_rows[at] = req.pending_row
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


def fill(
    s: Scheduler,
    adv: Advance,
    sampled: np.ndarray,
    accepted: np.ndarray | None = None,
    drafts: np.ndarray | None = None,
) -> list[Request]:
    """Write a step's sampled tokens (`sampled[row, :count]`, rows as in its plan) after each
    request's known ones, hash the blocks they complete and clear their pending marks.

    A step with drafts applied ahead of its outcome (`advance`: every verify row counted as
    accepting none) is corrected here from `accepted`: each row emits 1 + accepted tokens
    (capped at max_tokens), and the difference goes to its counts (`adv.counts`, the running
    slot's computed, known and output tokens, the counters). Returns the requests this
    correction finished: those that reached max_tokens although a step ahead still holds them
    (its tokens for them are dropped when it is collected). `drafts`: the step's drafts per
    row, for the counters, which count the step's verifies and tokens here."""
    if s.cfg.synthetic_output:
        raise AgentabError("the executor sampled tokens, but this scheduler plans synthetic output")
    sampled = np.asarray(sampled)
    if sampled.ndim == 1:
        sampled = sampled[:, None]
    if s.k and adv.step > 0:  # applied ahead with drafts on (a step without verify rows too)
        none = np.zeros(len(sampled), dtype=np.int64)
        a = none if accepted is None else np.asarray(accepted)
        d = none if drafts is None else np.asarray(drafts)
        return _fill_corrected(s, adv, sampled, a, d)
    for req, n, at, row in zip(adv.reqs, adv.counts, adv.starts, adv.rows, strict=True):
        _write(s, req, sampled[row, :n], at, adv.step)
    return []


def _write(s: Scheduler, req: Request, ids: np.ndarray, at: int, step: int) -> None:
    """`ids` as the request's tokens from `at` on; the blocks they complete are hashed."""
    bs = s.bs
    n = len(ids)
    req.tokens[at : at + n] = ids
    req.known = max(req.known, at + n)
    if req.pending_step == step:  # (a later step may have marked it since)
        req.pending_row = req.pending_step = -1
    done = len(req.hashes)
    full = (at + n) // bs
    if full <= done:
        return
    keys, req.raw_hash = chain_hashes(req.tokens[done * bs : full * bs], bs, done, req.raw_hash)
    req.hashes = np.concatenate([req.hashes, keys])
    if req.is_running:  # (not finished, preempted or aborted)
        s.note_hashes(req, done, keys)


def _fill_corrected(
    s: Scheduler, adv: Advance, sampled: np.ndarray, accepted: np.ndarray, drafts: np.ndarray
) -> list[Request]:
    """`fill` of a step with drafts that was applied ahead as accepting none (see `fill`)."""
    st, c = s.state, s.counters
    now: list[Request] = []
    verify: list[int] = []
    for i, (req, n, row) in enumerate(zip(adv.reqs, adv.counts, adv.rows, strict=True)):
        if req.status is RequestStatus.FINISHED_ABORTED:
            continue  # (its usage went out when it was aborted)
        a = int(accepted[row])
        at = req.known
        m = max(0, min(1 + a, req.max_tokens - (at - req.prompt_len)))
        _write(s, req, sampled[row, :m], at, adv.step)
        adv.counts[i], adv.starts[i] = m, at
        delta = m - n
        # counted here, not when it was applied ahead (Scheduler.advance), and only what a
        # client got: a verify after its request's end (m = 0) is not counted
        c["generation_tokens"] += m
        if m and drafts[row]:
            c["spec_decode_num_drafts"] += 1
            c["spec_decode_num_draft_tokens"] += int(drafts[row])
            c["spec_decode_num_accepted_tokens"] += a
            verify.append(a)
        if req.is_running:  # the slot's state: what ran ahead, plus this step's correction
            slot = req.slot
            st.computed[slot] += a
            st.ntokens[slot] += delta
            st.output[slot] += delta
            if req.known - req.prompt_len >= req.max_tokens:
                now.append(req)
        else:  # finished or preempted while a step held it: its output as known now
            req.num_output = req.known - req.prompt_len
    if verify:
        s.count_positions(np.array(verify, dtype=np.int64))
    if now:
        s.finish(np.array([r.slot for r in now], dtype=np.int64))
        for req in now:
            req.num_output = req.known - req.prompt_len
    return now

"""The waiting queue's admission into a step (`Scheduler._admit`), one kernel call a request.

Why: at AgentX scale every request is admitted once, and its admission was two kernel calls
(the prefix lookup, then `admit_row`) with a dozen Python-level operations between and around
them (slicing the keys, the lookup's result arrays, the admission rule, the row's numbers).
Here the lookup, the rule and the row's admission are one call
(`BlockPool.admit_head`, transitions_numba.admit_head), and the running set's slot list is
extended once for the step's admissions. The rules are the scheduler's (module docstring of
agentab.engine.scheduler); a request whose admission must grow the slot arrays takes the
step-by-step path (`Scheduler._admit_one`), which gives the same result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentab.engine.request import RequestStatus

if TYPE_CHECKING:
    from agentab.engine.scheduler import Scheduler

_I64 = np.int64


def admit(
    s: Scheduler, budget: int, rows: np.ndarray, row_sched: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The running rows followed by the waiting requests admitted FCFS into what is left of
    the token budget (see agentab.engine.scheduler's docstring for the rules)."""
    bs, pool, k = s.bs, s.pool, s.k
    waiting, free_slots, slot_req = s.waiting, s._free_slots, s.slot_req
    synthetic = s.cfg.synthetic_output
    max_seqs = s.cfg.max_num_seqs
    new_rows: list[int] = []
    new_sched: list[int] = []
    pending: list[int] = []  # admitted slots not yet appended to `s.run`
    nrun = len(s.run)
    while waiting and budget > 0 and nrun < max_seqs:
        req = waiting[0]
        ntok = req.prompt_len + req.num_output
        st = s.state
        if not free_slots or -(-(req.capacity + 2 * k) // bs) > st.columns:
            # taking a slot grows the arrays: one step at a time (`_admit_one`)
            if pending:
                s.run = np.concatenate((s.run, np.array(pending, dtype=_I64)))
                pending = []
            hits, hits_free = pool.lookup_free(req.hashes[: (ntok - 1) // bs])
            n = min(ntok - len(hits) * bs, budget)
            whole = -(-(ntok + k) // bs) - len(hits)
            if whole + hits_free > pool.num_free:
                break  # head-of-line: nothing behind it is admitted this step
            s._admit_one(req, hits, n)
            slot = req.slot
        else:
            slot = free_slots[-1]
            hashes = req.hashes
            request = (ntok, req.num_output, req.max_tokens, req.spec_index, np.uint64(req.key))
            nfull = ntok if synthetic else len(hashes)
            nhit, n, registered = pool.admit_head(
                st, slot, hashes, (ntok - 1) // bs, budget, k, nfull, request, bs
            )
            if n < 0:
                break  # head-of-line: nothing behind it is admitted this step
            waiting.popleft()
            req.move_to(RequestStatus.RUNNING)
            hit_tokens = nhit * bs
            s._count_prefix_hit(req, ntok, hit_tokens)
            free_slots.pop()
            slot_req[slot] = req
            req.slot = slot
            if s.log is not None:
                req.since = s.log.n
            if not registered:
                full = min(min(hit_tokens + n, ntok) // bs, nfull)
                s.register_rows(np.array([slot], dtype=_I64), np.array([full], dtype=_I64))
            pending.append(slot)
        nrun += 1
        new_rows.append(slot)
        new_sched.append(n)
        budget -= n
    if pending:
        s.run = np.concatenate((s.run, np.array(pending, dtype=_I64)))
    if new_rows:
        rows = np.concatenate([rows, np.array(new_rows, dtype=_I64)])
        row_sched = np.concatenate([row_sched, np.array(new_sched, dtype=_I64)])
    return rows, row_sched

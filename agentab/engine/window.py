"""The simulator's fast path: a window of pure-decode steps planned and applied at once.

Why: while nothing changes but decode progress, every step of the simulator is the same few
array operations over the same rows, and at AgentX scale most steps are such steps. A window
prices up to `max_steps` of them in one pass (per-step acceptance draws, the blocks the rows
grow into, the context each step reads), the engine sleeps to the window's end or to the first
arrival, and `commit_window` applies exactly the steps that had started by then, leaving the
scheduler in the state those single steps would have left it in
(tests/engine/test_window.py runs both ways and compares every plan, state and event).

It is valid only while nothing else can happen: every running request is decoding with its
full 1 + k tokens and fits the token budget, the waiting head cannot be admitted (only a finish
frees blocks or a sequence slot, and a finish ends the window), and the blocks the rows grow
into are free, so nothing is preempted. A window ends at the first step in which a request
finishes; every step emits at least one token per row, so the smallest remaining output
bounds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentab.engine import loops_numba
from agentab.engine.outputs import WindowPlan
from agentab.engine.paths import padded_tokens, specialized_ok

if TYPE_CHECKING:
    from agentab.engine.request import Request
    from agentab.engine.scheduler import Scheduler

_I64 = np.int64
_NO_LOG = np.zeros((1, 1), dtype=np.int32)  # the emission log's place when there is none
_NO_ACCEPTED = np.zeros((0, 0), dtype=_I64)  # no drafts: none accepted
_NO_SEED, _NO_RATES = np.uint64(0), np.zeros(0)  # no drafts: nothing drawn


def plan_window(s: Scheduler, max_steps: int) -> WindowPlan | None:
    """Up to `max_steps` consecutive pure-decode steps of the running rows, or None when a
    normal step must run (see the module docstring for when a window is valid)."""
    run = s.run
    B = len(run)
    q = 1 + s.k
    if B == 0 or max_steps < 2 or B * q > s.cfg.max_num_batched_tokens:
        return None
    st = s.state
    remaining, computed0 = np.empty(B, dtype=_I64), np.empty(B, dtype=_I64)
    horizon = loops_numba.window_horizon(
        run, st.in_decode, st.ntokens, st.computed, st.maxtok, st.output, remaining, computed0
    )
    if horizon == 0:
        return None
    budget_left = s.cfg.max_num_batched_tokens - B * q
    if s.waiting and budget_left > 0 and s.admissible(s.waiting[0]):
        return None
    horizon = min(max_steps, horizon)
    k = s.k
    if k:  # the steps' acceptance draws are made as window_steps reaches them
        acc = np.empty((horizon, B), dtype=_I64)
        seed, cond, whole = s.cfg.spec.draws()
    else:
        acc, seed, cond, whole = _NO_ACCEPTED, _NO_SEED, _NO_RATES, -1
    cum = np.empty((horizon, B), dtype=_I64)
    emitted = np.empty((horizon, B), dtype=_I64)
    context = np.empty(horizon, dtype=_I64)
    n = loops_numba.window_steps(
        run, st.computed, remaining, st.nblocks, acc, st.keys, st.spec_idx, seed, cond, whole,
        k, s.bs, s.pool.num_free, cum, emitted, context,
    )  # fmt: skip
    if n < 0:
        return None
    path, padded = _path(s, B)
    return WindowPlan(
        slots=run.copy(),
        q=q,
        path=path,
        padded_tokens=padded,
        emitted=emitted[:n],
        accepted=acc[:n] if k else np.zeros((n, B), dtype=_I64),
        context=context[:n],
        computed0=computed0,
        cum_uncapped=cum[:n],
        num_running=B,
        num_waiting=len(s.waiting),
    )


def commit_window(s: Scheduler, w: WindowPlan, m: int) -> list[Request]:
    """Apply the first `m` steps of a window exactly as m single steps would have; returns the
    requests that finished. (The rows' requests, which only a streamed client needs, are
    `s.requests_of(w.slots)` read before this.)"""
    rows = w.slots
    log = s.log
    if log is not None:  # the window's m end times were logged last (log_times)
        counts, row = log.counts, log.n - m - log.base
    else:
        counts, row = _NO_LOG, -1
    done = np.empty(len(rows), dtype=_I64)
    # the rows' new blocks, their full blocks registered, their progress: one kernel call
    emitted, nfin = s.pool.commit_rows(
        s.state, rows, (w.computed0, w.cum_uncapped, w.emitted), m, s.k, s.bs,
        s.cfg.synthetic_output, (counts, row), done,
    )  # fmt: skip
    _count(s, w, m, emitted)
    return s.finish(done[:nfin]) if nfin else []


def _path(s: Scheduler, rows: int) -> tuple[str, int]:
    """(path, padded tokens) of a pure-decode step of `rows` rows of 1 + k tokens each."""
    got = s.window_paths.get(rows)
    if got is None:
        q = 1 + s.k
        cfg = s.cfg
        path = "standard"
        padded = padded_tokens(rows * q, cfg.cuda_graph_max_tokens)
        if cfg.decode_backend.specialized and specialized_ok(
            np.full(rows, q, dtype=_I64),
            s.k,
            cfg.specialized_max_padded,
            cfg.specialized_max_requests_by_q,
            cfg.cuda_graph_max_tokens,
        ):
            path = "specialized"
        got = s.window_paths[rows] = (path, padded)
    return got


def _count(s: Scheduler, w: WindowPlan, m: int, emitted: int) -> None:
    """The counters of the first `m` steps of a window (each a pure-decode verify step of
    every row when drafting) and the rows' verify counters."""
    c = s.counters
    c["steps_" + w.path] += m
    c["decode_steps_" + w.path] += m
    c["generation_tokens"] += emitted
    if s.k:
        acc = loops_numba.window_verified(w.slots, s.state.spec_idx, w.accepted, m,
                                          s.accepted_per_pos)  # fmt: skip
        rows = m * len(w.slots)
        s.count_verified(rows, rows * s.k, acc)

"""Continuous batching with vLLM V1 semantics over a struct-of-arrays running set.

Each step (docs/engine.md, "Scheduling semantics"): running requests first, in admission order,
each given min(remaining, budget) tokens of `max_num_batched_tokens` (a decoding request's
remaining work is 1 + k: its last sampled token plus k drafts); if a running request's blocks
cannot be allocated, the most recently admitted running request is preempted (recompute: blocks
freed with their hashes, back to the head of the waiting queue) until it fits or it preempted
itself. Then, only if nothing was preempted this step, waiting requests FCFS while the budget
lasts and fewer than `max_num_seqs` run: a request is admitted only if its whole prompt (less
its prefix hit) fits in free blocks, and the first one that does not fit stops admission
(head-of-line blocking). Prompts are chunked to the budget.

The interface is vLLM's: `schedule()` gives a `StepPlan`, an executor runs it, and
`update(plan, output)` applies what it produced. A request's status changes only in the
transition methods below (`add`, `_admit_one`, `_preempt_last`, `finish`, `abort`; the
lifecycle is in agentab.engine.request).

Speed: the simulator must not do Python work per running request per step. The running set's
state lives in arrays by slot (agentab.engine.slots), and each phase of a step (the running
rows' budget, the plan's rows, applying the outcome) is one loop over them in
agentab.engine.loops_numba, compiled by numba (a plain-Python run of the same functions gives the
same results, tests/engine/test_loops_numba_scheduler.py). Many pure-decode steps at once:
agentab.engine.window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from agentab.engine import admission, emissions, loops_numba, model_io, window
from agentab.engine.emissions import EmissionLog
from agentab.engine.hashing import PrefixHashes
from agentab.engine.kv_cache import BlockPool
from agentab.engine.options import DecodeBackend
from agentab.engine.outputs import (
    Advance,
    StepOutput,
    StepPlan,
    synthetic_outcome,
)
from agentab.engine.paths import padded_tokens, specialized_ok
from agentab.engine.request import Request, RequestStatus, checked_request, stable_head
from agentab.engine.slots import SlotState
from agentab.engine.spec_decode import SpecConfig
from agentab.engine.types import PromptPrefix
from agentab.errors import AgentabError

_I64 = np.int64
_NO_LOG = np.zeros((1, 1), dtype=np.int32)  # the emission log's place when there is none
_NO_ROWS = np.zeros(0, dtype=_I64)  # no per-row values (e.g. no drafts accepted)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits (vLLM's defaults on H100/H200 where they have one)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    spec: SpecConfig = field(default_factory=SpecConfig)
    # which decode path steps may take: the specialized one where it applies (paths.py)
    decode_backend: DecodeBackend = DecodeBackend.AUTO
    specialized_max_padded: int = 64
    specialized_max_requests_by_q: tuple[int, ...] = (64, 32, 19, 16, 12, 10, 8, 8)
    cuda_graph_max_tokens: int = 512
    vocab_size: int = 32000
    # True: a request's output is the simulator's synthetic ids, fixed at admission, so its
    # blocks are hashed up front. False: the executor samples the output (a real model) and
    # each block is hashed when its last token is known.
    synthetic_output: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise AgentabError(f"{name}: {value!r} must be an integer >= 1")
        if self.max_num_batched_tokens < 1 + self.spec.num_draft_tokens:
            raise AgentabError("max_num_batched_tokens: smaller than one verify step (1 + k)")


# vLLM's counter names (without "vllm:" and "_total") and agentab's own
_COUNTERS = (
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_preempted_queries",
    "prefix_cache_preempted_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "num_preemptions", "prompt_tokens", "generation_tokens",
    "request_success", "request_abort", "steps_standard", "steps_specialized",
    "decode_steps_standard", "decode_steps_specialized",
)  # fmt: skip


class Scheduler:
    """Requests, the running set (arrays by slot), the waiting queue and the block pool."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.cfg = config
        self.bs = config.block_size
        self.k = config.spec.num_draft_tokens
        self.pool = BlockPool(config.num_blocks)
        self._prefix_hashes = PrefixHashes(config.block_size)
        self.window_paths: dict[int, tuple[str, int]] = {}  # rows -> a window's (path, padded)
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, in admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.run = np.zeros(0, dtype=_I64)  # running slots in admission order
        self.log: EmissionLog | None = None  # set by an engine that collects timelines
        self._steps_advanced = 0
        self.state = SlotState.empty(16, 64)
        self.slot_req: list[Request | None] = [None] * 16
        self._free_slots: list[int] = list(range(15, -1, -1))
        self.counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
        # vLLM's spec_decode_num_accepted_tokens_per_pos: verify rows that accepted position i
        self.accepted_per_pos = np.zeros(self.k, dtype=np.int64)

    # -- slots ---------------------------------------------------------------------------------
    def _grow(self, cap: int, cols: int) -> None:
        """Room for `cap` slots and `cols` blocks per slot."""
        old_cap = self.state.capacity
        self.state.grow(cap, cols)
        if cap != old_cap:
            self.slot_req.extend([None] * (cap - old_cap))
            self._free_slots.extend(range(cap - 1, old_cap - 1, -1))

    def _take_slot(self, req: Request) -> int:
        # a verify step reaches k past the last token and reserves k lookahead slots beyond
        cols_needed = self._blocks_for(req.capacity + 2 * self.k)
        cap, cols = self.state.capacity, self.state.columns
        if not self._free_slots or cols_needed > cols:
            if not self._free_slots:
                cap *= 2
            while cols < cols_needed:
                cols *= 2
            self._grow(cap, cols)
        slot = self._free_slots.pop()
        self.slot_req[slot] = req
        req.slot = slot
        return slot

    def _leave_slot(self, req: Request) -> None:
        """Copy a running request's progress back to it, free its blocks (tail first) and its
        slot. The caller takes the slot out of `run` and sets the new status."""
        self._leave_slots([req], np.array([req.slot], dtype=_I64))

    def _leave_slots(
        self, reqs: list[Request], slots: np.ndarray, run: np.ndarray = _NO_ROWS
    ) -> np.ndarray:
        """`_leave_slot` of each of these requests (in `slots`), in order; returns the slots
        `run` less these (one kernel call with the freeing: BlockPool.free_rows)."""
        st = self.state
        if self.log is not None:
            for req in reqs:
                req.chunk_parts.append(self.span(req))
        progress, kept = self.pool.free_rows(st, slots, run)
        slot_req, free_slots = self.slot_req, self._free_slots
        outputs, spec = progress.tolist()
        for req, slot, out, idx in zip(reqs, slots.tolist(), outputs, spec, strict=True):
            req.num_output = out
            req.spec_index = idx
            slot_req[slot] = None
            free_slots.append(slot)
            req.slot = -1
        return kept

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def requests_of(self, slots: np.ndarray) -> list[Request]:
        """The running requests in these slots, in order."""
        slot_req = self.slot_req
        return [slot_req[x] for x in slots.tolist()]  # type: ignore[misc]

    # -- collected timelines (agentab.engine.emissions) ----------------------------------------
    collect_timelines = emissions.collect_timelines
    log_times = emissions.log_times
    span = emissions.span
    emitted_parts = emissions.emitted_parts

    # -- transitions ---------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: np.ndarray,
        max_tokens: int,
        prefix: PromptPrefix | None = None,
        draw_id: str | None = None,
    ) -> Request:
        """Queue a request (validated; WAITING); its block hashes cover prompt and output.

        `prefix`: the client's statement of the prompt it shares with an earlier one, which
        spares comparing the two (PromptPrefix); the keys are the same with or without it.
        `draw_id`: what its acceptance draws are keyed on (EngineRequest.draw_id)."""
        if request_id in self.requests:
            raise AgentabError(f"request {request_id!r}: id already in flight")
        prompt, max_tokens = checked_request(request_id, prompt, max_tokens)
        need = self._blocks_for(len(prompt) + max_tokens + self.k)
        if need > self.cfg.num_blocks:
            raise AgentabError(
                f"request {request_id!r}: {len(prompt)} prompt + {max_tokens} output tokens "
                f"need {need} KV blocks; the cache has {self.cfg.num_blocks}"
            )
        p = len(prompt)
        if self.cfg.synthetic_output:
            # the whole blocks a client leaves unchanged stay its array (PromptPrefix); the
            # request's own buffer holds only the ids after them and the output
            head = stable_head(prefix, p, self.bs)
            tokens = np.empty(p - head + max_tokens, dtype=_I64)
            req = Request(request_id, tokens, p, max_tokens, draw_id)
            keys, raw = self._prefix_hashes.with_output(
                prompt, tokens, head, self.cfg.vocab_size, prefix, req
            )
            if head:
                req.defer_prompt(prompt[:head])
        else:  # room for the output the executor will sample (and k drafts past it)
            tokens = np.zeros(p + max_tokens + self.k, dtype=_I64)
            tokens[:p] = prompt
            keys, raws = self._prefix_hashes.hashes(prompt, tokens, prefix)
            raw = int(raws[-1]) if len(raws) else 0
            req = Request(request_id, tokens, p, max_tokens, draw_id)
        req.hashes = keys
        req.raw_hash = raw
        self.requests[request_id] = req
        self.waiting.append(req)
        self.counters["prompt_tokens"] += len(prompt)
        return req

    def _admit_one(self, req: Request, hits: np.ndarray, n: int) -> None:
        """WAITING or PREEMPTED -> RUNNING: the waiting head takes a slot with its prefix hit
        `hits` (block ids) and `n` tokens scheduled in this step."""
        self.waiting.popleft()
        req.move_to(RequestStatus.RUNNING)
        bs = self.bs
        ntok = req.prompt_len + req.num_output
        hit_tokens = len(hits) * bs
        self._count_prefix_hit(req, ntok, hit_tokens)
        slot = self._take_slot(req)
        st = self.state  # (taking a slot may have grown the arrays)
        if self.log is not None:
            req.since = self.log.n
        fresh = self._blocks_for(hit_tokens + n + self.k) - len(hits)
        full = min(hit_tokens + n, ntok) // bs
        if not self.cfg.synthetic_output:
            full = min(full, len(req.hashes))
        fields = (ntok, req.num_output, req.max_tokens, req.spec_index, np.uint64(req.key))
        if not self.pool.admit_row(st, slot, hits, req.hashes, fields, fresh, full, bs):
            self.register_rows(np.array([slot], dtype=_I64), np.array([full], dtype=_I64))
        self.run = np.concatenate((self.run, np.array([slot], dtype=_I64)))

    def _count_prefix_hit(self, req: Request, ntok: int, hit_tokens: int) -> None:
        """vLLM's prefix-cache counters for an admission: a first admission's query and hit
        (and the request's cached tokens), a preempted request's apart."""
        c = self.counters
        if req.num_preemptions == 0:
            req.cached_tokens = hit_tokens
            c["prefix_cache_queries"] += ntok
            c["prefix_cache_hits"] += hit_tokens
        else:
            c["prefix_cache_preempted_queries"] += ntok
            c["prefix_cache_preempted_hits"] += hit_tokens

    def _preempt_last(self) -> Request:
        """RUNNING -> PREEMPTED: the most recently admitted running request, blocks freed
        (their hashes kept), back to the head of the waiting queue."""
        slot = int(self.run[-1])
        self.run = self.run[:-1]
        req = self.slot_req[slot]
        assert req is not None
        self._leave_slot(req)
        req.move_to(RequestStatus.PREEMPTED)
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.counters["num_preemptions"] += 1
        return req

    def finish(self, slots: np.ndarray) -> list[Request]:
        """RUNNING -> FINISHED_LENGTH for the requests in `slots` (they generated max_tokens)."""
        out = self.requests_of(slots)
        self.run = self._leave_slots(out, slots, self.run)
        for req in out:
            req.move_to(RequestStatus.FINISHED_LENGTH)
            del self.requests[req.id]
        self.counters["request_success"] += len(out)
        return out

    def abort(self, request_id: str) -> Request | None:
        """Any unfinished status -> FINISHED_ABORTED; returns the request, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.is_running:
            self.run = self.run[self.run != req.slot]
            self._leave_slot(req)
        else:
            self.waiting.remove(req)
        req.move_to(RequestStatus.FINISHED_ABORTED)
        self.counters["request_abort"] += 1
        return req

    def has_work(self) -> bool:
        return bool(len(self.run) or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.run)

    # -- block bookkeeping ---------------------------------------------------------------------
    def alloc_rows(self, slots: np.ndarray, need: np.ndarray, total: int | None = None) -> None:
        """Append `need[i]` fresh blocks to row slots[i]'s block table (`total`: their sum)."""
        if total is None:
            total = int(need.sum())
        if total:
            st = self.state
            self.pool.allocate_rows(total, st.block_table, st.nblocks, slots, need)

    def register_rows(self, slots: np.ndarray, full: np.ndarray) -> None:
        """Cache the blocks of rows that are now full of computed (or scheduled) tokens.

        With sampled output only blocks whose hash is known: a block whose last token is still
        being sampled by the step in flight is registered by a later step."""
        st = self.state
        if not self.cfg.synthetic_output:
            full = np.minimum(full, st.nhashed[slots])
        full = full.astype(_I64, copy=False)
        self.pool.register_rows(st.block_table, st.hash_table, st.ncached, slots, full)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step: the running rows' share of the budget, then admissions."""
        budget = self.cfg.max_num_batched_tokens
        k, bs, st = self.k, self.bs, self.state
        preempted: list[str] = []
        run = self.run
        B = len(run)
        if B:
            kept, kept_sched, full = (np.empty(B, dtype=_I64) for _ in range(3))
            out = (np.empty(B, dtype=_I64), kept, kept_sched, full)  # (sched first)
            got = self.pool.schedule_rows(st, run, k, bs, budget, self.cfg.synthetic_output, out)
            if got is None:  # the rows' blocks do not fit: one at a time, preempting
                rows, row_sched = self._schedule_running_under_pressure(budget, preempted)
                got = loops_numba.scheduled_rows(
                    rows, row_sched, st.computed, st.ntokens, bs, kept, kept_sched, full
                )
                if got[0]:
                    self.register_rows(kept[: got[0]], full[: got[0]])
            n, used = got
            budget -= used
            rows, row_sched = kept[:n], kept_sched[:n]
        else:
            rows = row_sched = _NO_ROWS
        if not preempted:  # a step under pressure admits nothing new
            rows, row_sched = self._admit(budget, rows, row_sched)
        st = self.state  # (an admission may have grown the arrays)
        n = len(rows)
        comp, drafts, spec_index = (np.empty(n, dtype=_I64) for _ in range(3))
        is_decode = np.empty(n, dtype=np.bool_)
        keys = np.empty(n, dtype=np.uint64)
        total, all_decode = loops_numba.step_rows(
            rows, row_sched, st.computed, st.ntokens, st.in_decode, st.keys,
            st.spec_idx, comp, is_decode, drafts, keys, spec_index,
        )  # fmt: skip
        path, padded = self._path(row_sched, total, all_decode)
        return StepPlan(
            slots=rows,
            num_sched=row_sched,
            computed_before=comp,
            is_decode=is_decode,
            drafts=drafts,
            keys=keys,
            spec_index=spec_index,
            path=path,
            total_tokens=total,
            padded_tokens=padded,
            preempted=preempted,
            num_running=len(self.run),
            num_waiting=len(self.waiting),
        )

    def _path(self, row_sched: np.ndarray, total: int, all_decode: bool) -> tuple[str, int]:
        """(path, padded tokens): a pure-decode step is padded to its graph size and goes to
        the specialized path where that path takes it."""
        if not (total and all_decode):
            return "standard", total
        cfg = self.cfg
        padded = padded_tokens(total, cfg.cuda_graph_max_tokens)
        if cfg.decode_backend.specialized and specialized_ok(
            row_sched,
            self.k,
            cfg.specialized_max_padded,
            cfg.specialized_max_requests_by_q,
            cfg.cuda_graph_max_tokens,
        ):
            return "specialized", padded
        return "standard", padded

    def _schedule_running_under_pressure(
        self, budget: int, preempted: list[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """vLLM's running loop one request at a time, preempting from the tail on failure."""
        k, st = self.k, self.state
        order = self.run.tolist()
        done_rows: list[int] = []
        done_sched: list[int] = []
        i = 0
        while i < len(order):
            slot = order[i]
            comp = int(st.computed[slot])
            rem = int(st.ntokens[slot]) - comp + (k if st.in_decode[slot] else 0)
            n = min(rem, budget)
            if n == 0:
                i += 1
                continue
            need = max(self._blocks_for(comp + n + k) - int(st.nblocks[slot]), 0)
            scheduled = True
            while need > self.pool.num_free:
                victim_slot = int(self.run[-1])
                victim = self._preempt_last()
                order.pop()
                preempted.append(victim.id)
                if victim_slot == slot:
                    scheduled = False  # it preempted itself: nothing left to free
                    break
            if not scheduled:
                break
            self.alloc_rows(np.array([slot], dtype=_I64), np.array([need], dtype=_I64))
            done_rows.append(slot)
            done_sched.append(n)
            budget -= n
            i += 1
        return np.array(done_rows, dtype=_I64), np.array(done_sched, dtype=_I64)

    _admit = admission.admit  # the waiting queue into a step (agentab.engine.admission)

    def admissible(self, req: Request) -> bool:
        """Would the waiting head be admitted now (ignoring the token budget)?"""
        if len(self.run) >= self.cfg.max_num_seqs:
            return False
        ntok = req.prompt_len + req.num_output
        whole = self._blocks_for(ntok + self.k)
        if whole <= self.pool.num_free:
            return True  # fits even without a prefix hit (a hit only lowers the need)
        hits, hits_free = self.pool.lookup_free(req.hashes[: (ntok - 1) // self.bs])
        return whole - len(hits) + hits_free <= self.pool.num_free

    def update(
        self, plan: StepPlan, output: StepOutput | None = None, emitters: bool = True
    ) -> tuple[list[Request], list[int], list[Request]]:
        """Apply an executed step from its output alone (vLLM's update_from_output): advance
        rows, take the sampled tokens and accepted drafts, count; returns (requests that
        emitted tokens, how many each, requests that finished). Finished requests are freed.

        Without an output (tools and tests that drive the scheduler alone) the step's outcome
        is the simulator's: synthetic acceptance (`SpecConfig.accepted`), planned tokens.
        `emitters=False`: only the finished requests (the others' lists are left empty: an
        engine with no streamed client reads nothing else, and building them is per-row work).
        """
        adv = self.apply(plan, output, emitters)
        return adv.reqs, adv.counts, adv.finished

    def apply(
        self, plan: StepPlan, output: StepOutput | None = None, emitters: bool = True
    ) -> Advance:
        """`update`, returning the whole `Advance` (where each request's tokens went)."""
        if output is None:
            output = synthetic_outcome(plan, self.cfg.spec, 0.0)
        adv = self._advance(plan, output.accepted, emitters or output.sampled is not None)
        if output.sampled is not None:
            self.fill(adv, output.sampled)
        return adv

    def advance(self, plan: StepPlan) -> Advance:
        """Apply a step that is still running, before its tokens are known (async scheduling).

        Without speculative decoding a step's outcome does not depend on the sampled values:
        every decoding row and every row whose prompt the step completes emits one token, and
        requests end at exactly max_tokens. So the next step can be scheduled at once; the
        tokens this step samples are marked pending (the next step's inputs refer to them by
        row, `StepInputs.prev_rows`) and `fill` writes them when the step returns.

        With drafts (as vLLM schedules ahead of a verify step) every verify row is applied as
        accepting none: one token, the rejected drafts rolled back. The next step plans the
        row from there, and the executor shifts it by the drafts this step did accept (into
        the k lookahead slots every row holds); `fill` corrects the counts when the step
        returns (model_io).
        """
        adv = self._advance(plan, None)
        if self.k:  # counted when collected, from what the step did (model_io.fill)
            v = plan.is_decode & (plan.drafts > 0)
            c = self.counters
            c["generation_tokens"] -= sum(adv.counts)
            c["spec_decode_num_drafts"] -= int(np.count_nonzero(v))
            c["spec_decode_num_draft_tokens"] -= int(plan.drafts[v].sum())
        self._steps_advanced += 1
        adv.step = self._steps_advanced
        for req, row in zip(adv.reqs, adv.rows, strict=True):
            req.pending_row, req.pending_step = row, adv.step
        return adv

    def _advance(
        self, plan: StepPlan, accepted: np.ndarray | None, emitters: bool = True
    ) -> Advance:
        """A step's outcome applied to its rows (one compiled loop), then the finishes."""
        s = plan.slots
        B = len(s)
        if B == 0:
            return Advance([], [], [], [], [])
        c = self.counters
        c["steps_" + plan.path] += 1
        if np.count_nonzero(plan.is_decode) == B:  # (`all` is a Python-level numpy wrapper)
            c["decode_steps_" + plan.path] += 1
        log, st = self.log, self.state
        if log is not None:  # this step's end time was logged last (log_times)
            counts_log, log_row = log.counts, log.n - 1 - log.base
        else:
            counts_log, log_row = _NO_LOG, -1
        acc = _NO_ROWS if accepted is None else np.asarray(accepted, dtype=_I64)
        rows = np.empty(B, dtype=_I64)
        counts = np.empty(B, dtype=_I64)
        starts = np.empty(B, dtype=_I64)
        done = np.empty(B, dtype=_I64)
        n, nfin, emitted, verified, drafts, acc_sum = loops_numba.advance_rows(
            s, plan.num_sched, plan.computed_before, plan.is_decode, plan.drafts, acc,
            st.computed, st.ntokens, st.output, st.maxtok, st.in_decode,
            st.spec_idx, self.accepted_per_pos, counts_log, log_row, rows, counts, starts, done,
        )  # fmt: skip
        self.count_verified(verified, drafts, acc_sum)
        c["generation_tokens"] += emitted
        if not emitters:
            return Advance([], [], self.finish(done[:nfin]) if nfin else [], [], [])
        rows = rows[:n]
        slot_req = self.slot_req
        reqs: list[Request] = [slot_req[x] for x in s[rows].tolist()]  # type: ignore[misc]
        finished = self.finish(done[:nfin]) if nfin else []
        return Advance(reqs, counts[:n].tolist(), finished, starts[:n].tolist(), rows.tolist())

    def count_verified(self, rows: int, drafts: int, accepted: int) -> None:
        """vLLM's spec-decode counters: `rows` verify rows with `drafts` draft tokens in all, of
        which `accepted` were accepted."""
        if rows:
            c = self.counters
            c["spec_decode_num_drafts"] += rows
            c["spec_decode_num_draft_tokens"] += drafts
            c["spec_decode_num_accepted_tokens"] += accepted

    def count_positions(self, accepted: np.ndarray) -> None:
        """vLLM's per-position counter: a verify row that accepted `a` drafts counts one at
        each of positions 0..a-1 (`accepted`: the verify rows' accepted drafts, any shape)."""
        if self.k:
            per_value = np.bincount(accepted.ravel(), minlength=self.k + 1)
            self.accepted_per_pos += np.cumsum(per_value[::-1])[::-1][1 : self.k + 1]

    # -- a model's side (agentab.engine.model_io) ---------------------------------------------
    model_inputs = model_io.model_inputs
    fill = model_io.fill

    def note_hashes(self, req: Request, done: int, keys: np.ndarray) -> None:
        """A running request's blocks from `done` on got their prefix keys (sampled output)."""
        full = done + len(keys)
        if full > self.state.columns:
            self._grow(self.state.capacity, max(full, 2 * self.state.columns))
        self.state.hash_table[req.slot, done:full] = keys
        self.state.nhashed[req.slot] = full

    def output_ids(self, req: Request, n: int) -> np.ndarray:
        """The last `n` output tokens of a request (what its latest event emitted)."""
        out = int(self.state.output[req.slot]) if req.is_running else req.num_output
        known = req.prompt_len + out
        return req.tokens[known - n : known]

    # -- many decode steps at once (agentab.engine.window) -------------------------------------
    plan_window = window.plan_window
    commit_window = window.commit_window

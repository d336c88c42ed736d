"""Continuous batching with vLLM V1 semantics over a struct-of-arrays running set.

Each step (docs/engine.md, "Scheduling semantics"): running requests first, in admission order,
each given min(remaining, budget) tokens of `max_num_batched_tokens` (a decoding request's
remaining work is 1 + k: its last sampled token plus k drafts); if a running request's blocks
cannot be allocated, the most recently admitted running request is preempted (recompute: blocks
freed with their hashes, back to the head of the waiting queue) until it fits or it preempted
itself. Then, only if
nothing was preempted this step, waiting requests FCFS while the budget lasts and fewer than
`max_num_seqs` run: a request is admitted only if its whole prompt (less its prefix hit) fits in
free blocks, and the first one that does not fit stops admission (head-of-line blocking). Prompts
are chunked to the budget.

Speed: the simulator must not do Python work per running request per step. Per-request state of
the running set lives in numpy arrays indexed by slot (computed tokens, output tokens, block
table, block hashes), so one step is a few dozen array operations whatever the batch size, and
`plan_window` prices many pure-decode steps at once (see engine.core). At AgentX scale those
few dozen calls on arrays of ~64 rows, not the arithmetic, were most of a simulation's time; with
numba (the `sim` extra) each phase of a step (the running rows' budget, the plan's rows, applying
the outcome, planning and committing a window) is one compiled loop over the slot arrays
(agentab.engine.compiled). The numpy code stays as the path without numba and gives the same
plans and state (tests/engine/test_compiled_scheduler.py compares them operation by operation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from agentab.engine import compiled
from agentab.engine.hashing import PrefixHashes, chain_hashes, output_ids_from_seed, prompt_seed
from agentab.engine.kv_cache import BlockPool
from agentab.engine.outputs import StepInputs, StepOutput, flat_layout
from agentab.engine.paths import padded_tokens, specialized_ok
from agentab.engine.spec_decode import SpecConfig, request_key
from agentab.engine.types import PromptPrefix
from agentab.errors import AgentabError

_I64 = np.int64


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits (vLLM's defaults on H100/H200 where they have one)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    spec: SpecConfig = field(default_factory=SpecConfig)
    specialized: bool = False  # decode_backend == "latency_specialized"
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


class Req:
    """One request's identity and the state that survives preemption."""

    __slots__ = (
        "cached_tokens",
        "chunk_parts",
        "finish_reason",
        "hashes",
        "id",
        "key",
        "max_tokens",
        "num_output",
        "num_preemptions",
        "pending_row",
        "pending_step",
        "prompt_len",
        "raw_hash",
        "since",
        "sink",
        "slot",
        "spec_index",
        "tokens",
    )

    def __init__(self, request_id: str, tokens: np.ndarray, prompt_len: int, max_tokens: int):
        self.id = request_id
        self.key = request_key(request_id)
        self.tokens = tokens  # prompt, then the output (synthetic ids, or as sampled)
        self.hashes: np.ndarray = np.zeros(0, dtype=np.uint64)  # keys of the full blocks known
        self.raw_hash = 0  # the chained hash value after the last hashed block
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.num_output = 0
        self.cached_tokens = -1
        self.num_preemptions = 0
        self.slot = -1
        self.since = 0  # the first logged step of its current slot (EmissionLog)
        self.chunk_parts: list[tuple[np.ndarray, np.ndarray]] = []  # chunks of earlier slots
        self.spec_index = 0
        self.pending_row = -1  # row of the step in flight whose sampled token is this one's last
        self.pending_step = -1  # that step's number (Advance.step)
        self.finish_reason: str | None = None
        self.sink: object = None  # the engine's event channel


class EmissionLog:
    """Every step's end time and the tokens each slot emitted at it, for collected timelines.

    Why: an in-process client needs a request's chunk times, not one Python object per token.
    The engine logs each step's end time (`Scheduler.log_times`), the scheduler writes each
    step's emitted counts as one row over its slots (a window as one block of rows), and a
    request's chunks are read off its slot's column when it leaves the slot (finish,
    preemption, abort; `Scheduler.span`), as arrays. Rows no running request can still read
    are dropped when the buffer fills, so memory follows the longest-running request.
    """

    __slots__ = ("base", "counts", "n", "times", "until")

    def __init__(self, slots: int, rows: int = 1024) -> None:
        self.base = 0  # step number of row 0
        self.n = 0  # steps logged so far
        # With async scheduling a step is logged when it is applied, before it ends: the end
        # time of the last step handed out (None: every logged step has ended)
        self.until: float | None = None
        self.times = np.zeros(rows, dtype=np.float64)
        self.counts = np.zeros((rows, slots), dtype=np.int32)

    def make_room(self, steps: int, keep_from: int, slots: int) -> None:
        """Room for `steps` more rows and `slots` columns, keeping rows from step `keep_from`."""
        rows, cols = self.counts.shape
        used = self.n - self.base
        if used + steps <= rows and slots <= cols:
            return
        keep = used - (keep_from - self.base)
        size = rows
        while keep + steps > size // 2:
            size *= 2
        times = np.zeros(size, dtype=np.float64)
        counts = np.zeros((size, max(slots, cols)), dtype=np.int32)
        lo = keep_from - self.base
        times[:keep] = self.times[lo:used]
        counts[:keep, :cols] = self.counts[lo:used]
        self.times, self.counts, self.base = times, counts, keep_from


@dataclass
class StepPlan:
    """What one step runs: rows (slots) in schedule order and their token counts."""

    slots: np.ndarray
    num_sched: np.ndarray
    computed_before: np.ndarray
    is_decode: np.ndarray
    drafts: np.ndarray
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
    """`num_steps` pure-decode steps of the same rows, priced at once (see plan_window)."""

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

    reqs: list[Req]
    counts: list[int]
    finished: list[Req]
    starts: list[int]
    rows: list[int]
    step: int = 0  # its number among the steps advanced ahead of their tokens (0: not one)


class Scheduler:
    """Requests, the running set (arrays by slot), the waiting queue and the block pool."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.cfg = config
        self.bs = config.block_size
        self.k = config.spec.num_draft_tokens
        self.pool = BlockPool(config.num_blocks)
        self._prefix_hashes = PrefixHashes(config.block_size)
        self._window_paths: dict[int, tuple[str, int]] = {}  # rows -> a window's (path, padded)
        self.waiting: deque[Req] = deque()
        self.requests: dict[str, Req] = {}
        self.run = np.zeros(0, dtype=_I64)  # running slots in admission order
        self.log: EmissionLog | None = None  # set by an engine that collects timelines
        self._steps_advanced = 0
        self.slot_req: list[Req | None] = []
        self._free_slots: list[int] = []
        self._cap = 0
        self._cols = 0
        self._grow(16, 64)
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "prefix_cache_queries",
                "prefix_cache_hits",
                "prefix_cache_preempted_queries",
                "prefix_cache_preempted_hits",
                "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens",
                "num_preemptions",
                "prompt_tokens",
                "generation_tokens",
                "request_success",
                "request_abort",
                "steps_standard",
                "steps_specialized",
                "decode_steps_standard",
                "decode_steps_specialized",
            ),
            0.0,
        )

    # -- slot arrays -------------------------------------------------------------------------
    def _grow(self, cap: int, cols: int) -> None:
        """Resize the per-slot arrays to `cap` rows and the per-block tables to `cols` columns."""
        old_cap, old_cols = self._cap, self._cols

        def vec(name: str, dtype: type) -> None:
            new = np.zeros(cap, dtype=dtype)
            if old_cap:
                new[:old_cap] = getattr(self, name)
            setattr(self, name, new)

        def mat(name: str, dtype: type) -> None:
            new = np.zeros((cap, cols), dtype=dtype)
            if old_cap:
                new[:old_cap, :old_cols] = getattr(self, name)
            setattr(self, name, new)

        if cap != old_cap:
            for name in (
                "computed",
                "ntokens",
                "output",
                "maxtok",
                "nblocks",
                "ncached",
                "nhashed",
            ):
                vec(name, _I64)
            vec("spec_idx", _I64)
            vec("keys", np.uint64)
            vec("in_decode", np.bool_)
            self.slot_req.extend([None] * (cap - old_cap))
            self._free_slots.extend(range(cap - 1, old_cap - 1, -1))
        mat("block_table", _I64)
        mat("hash_table", np.uint64)
        self._cap, self._cols = cap, cols

    def _take_slot(self, req: Req) -> int:
        # a verify step reaches k past the last token and reserves k lookahead slots beyond
        cols_needed = self._blocks_for(len(req.tokens) + 2 * self.k)
        if not self._free_slots or cols_needed > self._cols:
            cap = self._cap * 2 if not self._free_slots else self._cap
            cols = self._cols
            while cols < cols_needed:
                cols *= 2
            self._grow(cap, cols)
        slot = self._free_slots.pop()
        self.slot_req[slot] = req
        req.slot = slot
        return slot

    def _release_slot(self, slot: int) -> None:
        self.slot_req[slot] = None
        self._free_slots.append(slot)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    # -- collected timelines (EmissionLog) -------------------------------------------------------
    def collect_timelines(self) -> None:
        """Log every step's emissions from now on (see EmissionLog); the engine then passes each
        step's end time to `log_times` before applying the step."""
        if self.log is None:
            self.log = EmissionLog(self._cap)
            for req in self.requests.values():
                req.since = 0

    def log_times(self, times: np.ndarray) -> None:
        """The end times of the next steps to be applied (one for a step, m for a window)."""
        log = self.log
        assert log is not None
        m = len(times)
        if log.n - log.base + m > len(log.times) or self._cap > log.counts.shape[1]:
            slot_req = self.slot_req
            keep = min((slot_req[x].since for x in self.run.tolist()), default=log.n)  # type: ignore[union-attr]
            log.make_room(m, keep, self._cap)
        row = log.n - log.base
        log.times[row : row + m] = times
        log.n += m

    def span(self, req: Req) -> tuple[np.ndarray, np.ndarray]:
        """(end times, tokens) of the steps in which `req` emitted since it took its slot."""
        log = self.log
        assert log is not None and req.slot >= 0
        lo = req.since - log.base
        seg = log.counts[lo : log.n - log.base, req.slot]
        nz = np.flatnonzero(seg)
        return log.times[lo + nz], seg[nz]

    def emitted_parts(self, req: Req) -> list[tuple[np.ndarray, np.ndarray]]:
        """(end times, tokens) pieces of everything `req` emitted: its earlier slots' chunks,
        then what its current slot logged so far (empty without a log)."""
        parts = list(req.chunk_parts)
        if req.slot >= 0 and self.log is not None:
            parts.append(self.span(req))
        return parts

    # -- requests ----------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: np.ndarray,
        max_tokens: int,
        prefix: PromptPrefix | None = None,
    ) -> Req:
        """Queue a request (validated); its block hashes cover prompt and future output.

        `prefix`: the client's statement of the prompt it shares with an earlier one, which
        spares comparing the two (PromptPrefix); the keys are the same with or without it."""
        if request_id in self.requests:
            raise AgentabError(f"request {request_id!r}: id already in flight")
        prompt = np.asarray(prompt)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise AgentabError(f"request {request_id!r}: prompt must be a non-empty 1-d array")
        if prompt.dtype.kind not in "iu":  # np.issubdtype costs ~1 us a call
            raise AgentabError(f"request {request_id!r}: prompt token ids must be integers")
        if not isinstance(max_tokens, int | np.integer) or max_tokens < 1:
            raise AgentabError(f"request {request_id!r}: max_tokens {max_tokens!r} must be >= 1")
        max_tokens = int(max_tokens)
        need = self._blocks_for(len(prompt) + max_tokens + self.k)
        if need > self.cfg.num_blocks:
            raise AgentabError(
                f"request {request_id!r}: {len(prompt)} prompt + {max_tokens} output tokens "
                f"need {need} KV blocks; the cache has {self.cfg.num_blocks}"
            )
        p = len(prompt)
        if self.cfg.synthetic_output:
            tokens = np.empty(p + max_tokens, dtype=_I64)
        else:  # room for the output the executor will sample (and k drafts past it)
            tokens = np.zeros(p + max_tokens + self.k, dtype=_I64)
        tokens[:p] = prompt
        keys, raws = self._prefix_hashes.hashes(prompt, keep=tokens, prefix=prefix)
        raw = int(raws[-1]) if len(raws) else 0
        if self.cfg.synthetic_output:
            keys, raw = self._hash_synthetic_output(tokens, p, keys, raw)
        req = Req(request_id, tokens, len(prompt), max_tokens)
        req.hashes = keys
        req.raw_hash = raw
        self.requests[request_id] = req
        self.waiting.append(req)
        self.counters["prompt_tokens"] += len(prompt)
        return req

    def _hash_synthetic_output(
        self, tokens: np.ndarray, prompt_len: int, keys: np.ndarray, raw: int
    ) -> tuple[np.ndarray, int]:
        """Fill tokens[prompt_len:] with the synthetic output ids and hash the blocks after the
        prompt's full ones; returns every full block's keys and the raw value after them."""
        bs, vocab = self.bs, self.cfg.vocab_size
        n_full = prompt_len // bs
        if compiled.ENABLED:
            compiled.synthetic_output(tokens, prompt_len, n_full * bs, np.uint64(raw), vocab)
            total = len(tokens) // bs
            out = np.empty(total, dtype=np.uint64)
            out[:n_full] = keys
            raws = np.empty(total - n_full, dtype=np.uint64)
            last = compiled.chain_into(
                tokens, n_full, total, bs, np.uint64(raw), out[n_full:], raws
            )
            return out, int(last)
        seed = prompt_seed(tokens[:prompt_len], raw, n_full * bs)
        tokens[prompt_len:] = output_ids_from_seed(seed, len(tokens) - prompt_len, vocab)
        rest, raw = chain_hashes(tokens[n_full * bs :], bs, n_full, raw)
        return (np.concatenate([keys, rest]) if len(keys) else rest), raw

    def has_work(self) -> bool:
        return bool(len(self.run) or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.run)

    def abort(self, request_id: str) -> Req | None:
        """Remove a request wherever it is; returns it (finish_reason "abort") or None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.slot >= 0:
            self._save_and_free(req.slot)
            self.run = self.run[self.run != req.slot]
            self._release_slot(req.slot)
            req.slot = -1
        else:
            self.waiting.remove(req)
        req.finish_reason = "abort"
        self.counters["request_abort"] += 1
        return req

    def _save_and_free(self, slot: int) -> None:
        """Copy a running request's progress back to its Req and free its blocks (tail first)."""
        req = self.slot_req[slot]
        assert req is not None
        if self.log is not None:
            req.chunk_parts.append(self.span(req))
        req.num_output = int(self.output[slot])
        req.spec_index = int(self.spec_idx[slot])
        n = int(self.nblocks[slot])
        self.pool.free(self.block_table[slot, :n][::-1])
        self.nblocks[slot] = 0
        self.ncached[slot] = 0

    def _preempt_last(self) -> Req:
        slot = int(self.run[-1])
        self.run = self.run[:-1]
        req = self.slot_req[slot]
        assert req is not None
        self._save_and_free(slot)
        self._release_slot(slot)
        req.slot = -1
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.counters["num_preemptions"] += 1
        return req

    # -- block bookkeeping (vectorized over rows) ----------------------------------------------
    def _alloc_rows(self, slots: np.ndarray, need: np.ndarray, total: int | None = None) -> None:
        """Append `need[i]` fresh blocks to row slots[i]'s block table (`total`: their sum)."""
        if total is None:
            total = int(need.sum())
        if total == 0:
            return
        ids = self.pool.allocate(total)
        if compiled.ENABLED:
            compiled.fill_rows(self.block_table, self.nblocks, slots, need, ids)
            return
        rows, cols = _ragged(slots, self.nblocks[slots], need)
        self.block_table[rows, cols] = ids
        self.nblocks[slots] += need

    def _register_rows(self, slots: np.ndarray, full: np.ndarray) -> None:
        """Cache the blocks of rows that are now full of computed (or scheduled) tokens.

        With sampled output only blocks whose hash is known: a block whose last token is still
        being sampled by the step in flight is registered by a later step."""
        if not self.cfg.synthetic_output:
            full = np.minimum(full, self.nhashed[slots])
        if compiled.ENABLED:
            ids, keys = compiled.newly_full(
                self.block_table, self.hash_table, self.ncached, slots, full.astype(_I64)
            )
            if len(ids):
                self.pool.register(ids, keys)
            return
        start = self.ncached[slots]
        count = np.maximum(full - start, 0)
        if not count.any():
            return
        rows, cols = _ragged(slots, start, count)
        self.pool.register(self.block_table[rows, cols], self.hash_table[rows, cols])
        self.ncached[slots] = start + count

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        if compiled.ENABLED:
            return self._schedule_compiled()
        budget = self.cfg.max_num_batched_tokens
        k, bs = self.k, self.bs
        preempted: list[str] = []
        run = self.run
        if len(run):
            comp = self.computed[run]
            rem = self.ntokens[run] - comp + np.where(self.in_decode[run], k, 0)
            start = np.cumsum(rem) - rem
            sched = np.clip(budget - start, 0, rem)
            target = -(-(comp + sched + k) // bs)
            need = np.where(sched > 0, np.maximum(target - self.nblocks[run], 0), 0)
            if int(need.sum()) <= self.pool.num_free:
                self._alloc_rows(run, need)
                rows, row_sched = run, sched
            else:
                rows, row_sched = self._schedule_running_under_pressure(budget, preempted)
            budget -= int(row_sched.sum())
            keep = row_sched > 0
            rows, row_sched = rows[keep], row_sched[keep]
            if len(rows):
                comp = self.computed[rows]
                self._register_rows(rows, np.minimum(comp + row_sched, self.ntokens[rows]) // bs)
        else:
            rows = row_sched = np.zeros(0, dtype=_I64)
        rows, row_sched = self._with_admitted(budget, rows, row_sched, preempted)
        comp = self.computed[rows]
        is_decode = self.in_decode[rows].copy()
        drafts = np.where(is_decode, np.maximum(comp + row_sched - self.ntokens[rows], 0), 0)
        total = int(row_sched.sum())
        return self._plan(
            rows, row_sched, comp, is_decode, drafts, self.keys[rows], self.spec_idx[rows],
            total, bool(is_decode.all()), preempted,
        )  # fmt: skip

    def _schedule_compiled(self) -> StepPlan:
        """schedule() with its per-row work in compiled calls (the same plan and state)."""
        budget = self.cfg.max_num_batched_tokens
        k, bs = self.k, self.bs
        preempted: list[str] = []
        run = self.run
        B = len(run)
        if B:
            sched = np.empty(B, dtype=_I64)
            need = np.empty(B, dtype=_I64)
            total_need = compiled.running_budget(
                run, self.computed, self.ntokens, self.in_decode, self.nblocks, k, bs, budget,
                sched, need,
            )  # fmt: skip
            if total_need <= self.pool.num_free:
                if total_need:
                    self._alloc_rows(run, need, total_need)
                rows, row_sched = run, sched
            else:
                rows, row_sched = self._schedule_running_under_pressure(budget, preempted)
            n = len(rows)
            kept, kept_sched, full = (np.empty(n, dtype=_I64) for _ in range(3))
            n, used = compiled.scheduled_rows(
                rows, row_sched, self.computed, self.ntokens, bs, kept, kept_sched, full
            )
            budget -= used
            rows, row_sched = kept[:n], kept_sched[:n]
            if n:
                self._register_rows(rows, full[:n])
        else:
            rows = row_sched = _NO_ROWS
        rows, row_sched = self._with_admitted(budget, rows, row_sched, preempted)
        n = len(rows)
        comp, drafts, spec_index = (np.empty(n, dtype=_I64) for _ in range(3))
        is_decode = np.empty(n, dtype=np.bool_)
        keys = np.empty(n, dtype=np.uint64)
        total, all_decode = compiled.step_rows(
            rows, row_sched, self.computed, self.ntokens, self.in_decode, self.keys,
            self.spec_idx, comp, is_decode, drafts, keys, spec_index,
        )  # fmt: skip
        return self._plan(
            rows, row_sched, comp, is_decode, drafts, keys, spec_index, total, all_decode,
            preempted,
        )  # fmt: skip

    def _with_admitted(
        self, budget: int, rows: np.ndarray, row_sched: np.ndarray, preempted: list[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The running rows followed by the waiting requests admitted into what is left of the
        token budget (none when the step preempted: pressure admits nothing new)."""
        new_rows: list[int] = []
        new_sched: list[int] = []
        if not preempted:
            self._admit(budget, new_rows, new_sched)
        if new_rows:
            rows = np.concatenate([rows, np.array(new_rows, dtype=_I64)])
            row_sched = np.concatenate([row_sched, np.array(new_sched, dtype=_I64)])
        return rows, row_sched

    def _plan(
        self,
        rows: np.ndarray,
        row_sched: np.ndarray,
        comp: np.ndarray,
        is_decode: np.ndarray,
        drafts: np.ndarray,
        keys: np.ndarray,
        spec_index: np.ndarray,
        total: int,
        all_decode: bool,
        preempted: list[str],
    ) -> StepPlan:
        """The step's plan from its per-row arrays: a pure-decode step is padded to its graph
        size and goes to the specialized path where that path takes it."""
        path = "standard"
        padded = total
        if total and all_decode:
            padded = padded_tokens(total, self.cfg.cuda_graph_max_tokens)
            if self.cfg.specialized and specialized_ok(
                row_sched,
                self.k,
                self.cfg.specialized_max_padded,
                self.cfg.specialized_max_requests_by_q,
                self.cfg.cuda_graph_max_tokens,
            ):
                path = "specialized"
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

    def _schedule_running_under_pressure(
        self, budget: int, preempted: list[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """vLLM's running loop one request at a time, preempting from the tail on failure."""
        k, _bs = self.k, self.bs
        order = self.run.tolist()
        done_rows: list[int] = []
        done_sched: list[int] = []
        i = 0
        while i < len(order):
            slot = order[i]
            comp = int(self.computed[slot])
            rem = int(self.ntokens[slot]) - comp + (k if self.in_decode[slot] else 0)
            n = min(rem, budget)
            if n == 0:
                i += 1
                continue
            need = max(self._blocks_for(comp + n + k) - int(self.nblocks[slot]), 0)
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
            self._alloc_rows(np.array([slot], dtype=_I64), np.array([need], dtype=_I64))
            done_rows.append(slot)
            done_sched.append(n)
            budget -= n
            i += 1
        return np.array(done_rows, dtype=_I64), np.array(done_sched, dtype=_I64)

    def _admit(self, budget: int, new_rows: list[int], new_sched: list[int]) -> None:
        """Admit waiting requests FCFS (see the module docstring for the rules)."""
        k, bs, pool = self.k, self.bs, self.pool
        while self.waiting and budget > 0 and len(self.run) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            ntok = req.prompt_len + req.num_output
            hits = pool.lookup(req.hashes[: (ntok - 1) // bs])
            hit_tokens = len(hits) * bs
            n = min(ntok - hit_tokens, budget)
            whole = self._blocks_for(ntok + k) - len(hits)
            if whole + pool.num_free_among(hits) > pool.num_free:
                break  # head-of-line: nothing behind it is admitted this step
            self.waiting.popleft()
            pool.touch(hits)
            if req.num_preemptions == 0:
                req.cached_tokens = hit_tokens
                self.counters["prefix_cache_queries"] += ntok
                self.counters["prefix_cache_hits"] += hit_tokens
            else:
                self.counters["prefix_cache_preempted_queries"] += ntok
                self.counters["prefix_cache_preempted_hits"] += hit_tokens
            slot = self._take_slot(req)
            if self.log is not None:
                req.since = self.log.n
            nh = len(req.hashes)
            self.hash_table[slot, :nh] = req.hashes
            self.block_table[slot, : len(hits)] = hits
            self.nblocks[slot] = len(hits)
            self.ncached[slot] = len(hits)
            self.nhashed[slot] = nh
            self.computed[slot] = hit_tokens
            self.ntokens[slot] = ntok
            self.output[slot] = req.num_output
            self.maxtok[slot] = req.max_tokens
            self.spec_idx[slot] = req.spec_index
            self.keys[slot] = np.uint64(req.key)
            self.in_decode[slot] = False
            one = np.array([slot], dtype=_I64)
            self._alloc_rows(one, np.array([self._blocks_for(hit_tokens + n + k) - len(hits)]))
            self._register_rows(one, np.array([min(hit_tokens + n, ntok) // bs]))
            self.run = np.append(self.run, slot)
            new_rows.append(slot)
            new_sched.append(n)
            budget -= n

    def update(
        self, plan: StepPlan, output: StepOutput | None = None
    ) -> tuple[list[Req], list[int], list[Req]]:
        """Apply an executed step from its output alone: advance rows, take the sampled tokens
        and accepted drafts, count; returns (reqs that emitted tokens, how many each, reqs that
        finished). Finished requests are freed.

        Without an output (tools and tests that drive the scheduler alone) the step's outcome
        is the simulator's: synthetic acceptance (`SpecConfig.accepted`), planned tokens.
        """
        if output is None:
            output = synthetic_outcome(plan, self.cfg.spec, 0.0)
        adv = self._advance(plan, output.accepted)
        if output.sampled is not None:
            self.fill(adv, output.sampled)
        return adv.reqs, adv.counts, adv.finished

    def advance(self, plan: StepPlan) -> Advance:
        """Apply a step that is still running, before its tokens are known (async scheduling).

        Without speculative decoding a step's outcome does not depend on the sampled values:
        every decoding row and every row whose prompt the step completes emits one token, and
        requests end at exactly max_tokens. So the next step can be scheduled at once; the
        tokens this step samples are marked pending (the next step's inputs refer to them by
        row, `StepInputs.prev_rows`) and `fill` writes them when the step returns.
        """
        if self.k:
            raise AgentabError("async scheduling needs num_draft_tokens = 0")
        adv = self._advance(plan, None)
        self._steps_advanced += 1
        adv.step = self._steps_advanced
        for req, row in zip(adv.reqs, adv.rows, strict=True):
            req.pending_row, req.pending_step = row, adv.step
        return adv

    def _advance(self, plan: StepPlan, accepted: np.ndarray | None) -> Advance:
        s = plan.slots
        if len(s) == 0:
            return Advance([], [], [], [], [])
        c = self.counters
        c["steps_" + plan.path] += 1
        dec = plan.is_decode
        if dec.all():
            c["decode_steps_" + plan.path] += 1
        if compiled.ENABLED:
            return self._advance_compiled(plan, accepted)
        comp = plan.computed_before + plan.num_sched
        emitted = np.zeros(len(s), dtype=_I64)
        if dec.any():
            ds = s[dec]
            drafts = plan.drafts[dec]
            if accepted is None:
                acc = np.zeros(len(ds), dtype=_I64)
            else:
                acc = np.minimum(np.asarray(accepted, dtype=_I64)[dec], drafts)
            comp[dec] -= drafts - acc
            emitted[dec] = acc + 1
            verified = drafts > 0
            if verified.any():
                self.spec_idx[ds[verified]] += 1
                self._count_verified(
                    int(np.count_nonzero(verified)), int(drafts.sum()), int(acc[verified].sum())
                )
        pre = ~dec
        if pre.any():
            done = pre & (comp >= self.ntokens[s])
            emitted[done] = 1
            self.in_decode[s[done]] = True
        self.computed[s] = comp
        out = self.output[s]
        emitted = np.minimum(emitted, self.maxtok[s] - out)
        nz = np.flatnonzero(emitted)
        log = self.log
        if log is not None:  # this step's end time was logged last (log_times)
            log.counts[log.n - 1 - log.base, s[nz]] = emitted[nz]
        starts = self.ntokens[s[nz]].tolist()  # where each emitting row's new tokens go
        self.output[s] = out + emitted
        self.ntokens[s] += emitted
        c["generation_tokens"] += int(emitted.sum())
        slot_req = self.slot_req
        reqs = [slot_req[x] for x in s[nz].tolist()]
        counts = emitted[nz].tolist()
        fin_mask = self.output[s] >= self.maxtok[s]
        finished = self._finish(s[fin_mask]) if fin_mask.any() else []
        return Advance(reqs, counts, finished, starts, nz.tolist())  # type: ignore[arg-type]

    def _advance_compiled(self, plan: StepPlan, accepted: np.ndarray | None) -> Advance:
        """_advance's array updates by one compiled call (the same state as the numpy code)."""
        s = plan.slots
        B = len(s)
        log = self.log
        if log is not None:  # this step's end time was logged last (log_times)
            counts_log, log_row = log.counts, log.n - 1 - log.base
        else:
            counts_log, log_row = _NO_LOG, -1
        acc = _NO_ROWS if accepted is None else np.asarray(accepted, dtype=_I64)
        rows = np.empty(B, dtype=_I64)
        counts = np.empty(B, dtype=_I64)
        starts = np.empty(B, dtype=_I64)
        done = np.empty(B, dtype=_I64)
        n, nfin, emitted, verified, drafts, acc_sum = compiled.advance_rows(
            s, plan.num_sched, plan.computed_before, plan.is_decode, plan.drafts, acc,
            self.computed, self.ntokens, self.output, self.maxtok, self.in_decode,
            self.spec_idx, counts_log, log_row, rows, counts, starts, done,
        )  # fmt: skip
        self._count_verified(verified, drafts, acc_sum)
        self.counters["generation_tokens"] += emitted
        slot_req = self.slot_req
        rows = rows[:n]
        reqs = [slot_req[x] for x in s[rows].tolist()]
        finished = self._finish(done[:nfin]) if nfin else []
        return Advance(reqs, counts[:n].tolist(), finished, starts[:n].tolist(), rows.tolist())  # type: ignore[arg-type]

    def fill(self, adv: Advance, sampled: np.ndarray) -> None:
        """Write a step's sampled tokens (rows as in its plan) after each request's known ones,
        hash the blocks they complete and clear their pending marks."""
        if self.cfg.synthetic_output:
            raise AgentabError(
                "the executor sampled tokens, but this scheduler plans synthetic output"
            )
        sampled = np.asarray(sampled)
        if sampled.ndim == 1:
            sampled = sampled[:, None]
        bs = self.bs
        for req, n, at, row in zip(adv.reqs, adv.counts, adv.starts, adv.rows, strict=True):
            req.tokens[at : at + n] = sampled[row, :n]
            if req.pending_step == adv.step:  # (a later step may have marked it since)
                req.pending_row = req.pending_step = -1
            done = len(req.hashes)
            full = (at + n) // bs
            if full <= done:
                continue
            keys, req.raw_hash = chain_hashes(
                req.tokens[done * bs : full * bs], bs, done, req.raw_hash
            )
            req.hashes = np.concatenate([req.hashes, keys])
            slot = req.slot
            if slot >= 0:  # still running (not finished, preempted or aborted)
                if full > self._cols:
                    self._grow(self._cap, max(full, 2 * self._cols))
                self.hash_table[slot, done:full] = keys
                self.nhashed[slot] = full

    def output_ids(self, req: Req, n: int) -> np.ndarray:
        """The last `n` output tokens of a request (what its latest event emitted)."""
        known = req.prompt_len + (int(self.output[req.slot]) if req.slot >= 0 else req.num_output)
        return req.tokens[known - n : known]

    def model_inputs(self, plan: StepPlan) -> StepInputs:
        """The step as a model runs it: flat tokens, positions, block tables, KV slots."""
        s = plan.slots
        n = plan.num_sched
        comp = plan.computed_before
        ctx = comp + n
        width = max(1, int(self._blocks_for(int(ctx.max())))) if len(s) else 1
        tables = self.block_table[s, :width].copy()
        starts, positions, slot_mapping = flat_layout(comp, n, tables, self.bs)
        token_ids = np.empty(len(positions), dtype=_I64)
        prev_rows = np.full(len(positions), -1, dtype=_I64)
        for i, slot in enumerate(s.tolist()):
            req = self.slot_req[slot]
            assert req is not None
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
            block_size=self.bs,
            prev_rows=prev_rows,
        )

    def _finish(self, slots: np.ndarray) -> list[Req]:
        out: list[Req] = []
        for slot in slots.tolist():
            req = self.slot_req[slot]
            assert req is not None
            self._save_and_free(slot)
            self._release_slot(slot)
            req.slot = -1
            req.finish_reason = "length"
            del self.requests[req.id]
            out.append(req)
        gone = np.zeros(self._cap, dtype=np.bool_)
        gone[slots] = True
        self.run = self.run[~gone[self.run]]
        self.counters["request_success"] += len(out)
        return out

    # -- many decode steps at once -------------------------------------------------------------
    def plan_window(self, max_steps: int) -> WindowPlan | None:
        """Price up to `max_steps` consecutive steps if they are pure decode of the same rows.

        Valid only while nothing else happens: every running request is decoding and gets its
        full 1 + k tokens, the waiting queue is empty or cannot be admitted (only a finish frees
        blocks or a sequence slot, and a finish ends the window), and the blocks the rows grow
        into are free, so no preemption. The window ends at the first step where a request
        finishes. Returns None when a normal step must run.
        """
        run = self.run
        B = len(run)
        q = 1 + self.k
        if B == 0 or max_steps < 2 or B * q > self.cfg.max_num_batched_tokens:
            return None
        if compiled.ENABLED:
            # every step emits at least one token per row, so the first finish comes within
            # the smallest remaining count: no need to price steps past it
            horizon = compiled.window_horizon(
                run, self.in_decode, self.ntokens, self.computed, self.maxtok, self.output
            )
            if horizon == 0:
                return None
        elif (
            not self.in_decode[run].all() or not (self.ntokens[run] - self.computed[run] == 1).all()
        ):
            return None
        budget_left = self.cfg.max_num_batched_tokens - B * q
        if self.waiting and budget_left > 0 and self._admissible(self.waiting[0]):
            return None
        if compiled.ENABLED:
            return self._plan_window_compiled(min(max_steps, horizon))
        return self._plan_window_numpy(max_steps)

    def _window_acceptance(self, run: np.ndarray, horizon: int) -> np.ndarray:
        """(steps, rows) drafts accepted in the next `horizon` verify steps of the rows."""
        steps = np.arange(horizon, dtype=_I64)[:, None]
        drafts = np.full((1, len(run)), self.k, dtype=_I64)
        acc = self.cfg.spec.accepted(self.keys[run][None, :], self.spec_idx[run] + steps, drafts)
        return np.broadcast_to(acc, (horizon, len(run)))

    def _window_path(self, rows: int) -> tuple[str, int]:
        """(path, padded tokens) of a pure-decode step of `rows` rows of 1 + k tokens each."""
        got = self._window_paths.get(rows)
        if got is None:
            k = self.k
            q = 1 + k
            path = "standard"
            padded = padded_tokens(rows * q, self.cfg.cuda_graph_max_tokens)
            if self.cfg.specialized and specialized_ok(
                np.full(rows, q, dtype=_I64),
                k,
                self.cfg.specialized_max_padded,
                self.cfg.specialized_max_requests_by_q,
                self.cfg.cuda_graph_max_tokens,
            ):
                path = "specialized"
            got = self._window_paths[rows] = (path, padded)
        return got

    def _plan_window_compiled(self, horizon: int) -> WindowPlan | None:
        """plan_window's steps by one compiled call (the same arrays as the numpy code)."""
        run = self.run
        B = len(run)
        k = self.k
        remaining = self.maxtok[run] - self.output[run]
        acc = (
            np.ascontiguousarray(self._window_acceptance(run, horizon))
            if k
            else np.zeros((0, 0), dtype=_I64)
        )
        cum = np.empty((horizon, B), dtype=_I64)
        emitted = np.empty((horizon, B), dtype=_I64)
        context = np.empty(horizon, dtype=_I64)
        n = compiled.window_steps(
            run, self.computed, remaining, self.nblocks, acc, k, self.bs, self.pool.num_free,
            cum, emitted, context,
        )  # fmt: skip
        if n < 0:
            return None
        path, padded = self._window_path(B)
        return WindowPlan(
            slots=run.copy(),
            q=1 + k,
            path=path,
            padded_tokens=padded,
            emitted=emitted[:n],
            accepted=acc[:n] if k else np.zeros((n, B), dtype=_I64),
            context=context[:n],
            computed0=self.computed[run],
            cum_uncapped=cum[:n],
            num_running=B,
            num_waiting=len(self.waiting),
        )

    def _plan_window_numpy(self, max_steps: int) -> WindowPlan | None:
        run = self.run
        B = len(run)
        k, bs = self.k, self.bs
        q = 1 + k
        comp0 = self.computed[run]
        remaining = self.maxtok[run] - self.output[run]
        # every step emits at least one token per row, so the first finish comes within the
        # smallest remaining count: no need to price steps past it
        horizon = min(max_steps, int(remaining.min()))
        acc = self._window_acceptance(run, horizon) if k else np.zeros((horizon, B), dtype=_I64)
        cum = np.cumsum(acc + 1, axis=0)
        fin = cum >= remaining
        any_fin = fin.any(axis=0)
        n = horizon
        if any_fin.any():
            n = int(fin.argmax(axis=0)[any_fin].min()) + 1
        prev = np.zeros((n, B), dtype=_I64)
        prev[1:] = cum[: n - 1]
        comp_steps = comp0 + prev  # computed tokens before each step
        target = -(-(comp_steps + q + k) // bs)
        grow = np.maximum(target - self.nblocks[run], 0).sum(axis=1)
        fits = grow <= self.pool.num_free
        if not fits.all():
            n = int(np.argmin(fits))
            if n < 2:
                return None
            comp_steps = comp_steps[:n]
        capped = np.minimum(cum[:n], remaining)
        emitted = np.diff(capped, axis=0, prepend=np.zeros((1, B), dtype=_I64))
        path, padded = self._window_path(B)
        return WindowPlan(
            slots=run.copy(),
            q=q,
            path=path,
            padded_tokens=padded,
            emitted=emitted,
            accepted=np.ascontiguousarray(acc[:n]),
            context=(comp_steps + q).sum(axis=1),
            computed0=comp0,
            cum_uncapped=cum[:n],
            num_running=B,
            num_waiting=len(self.waiting),
        )

    def _admissible(self, req: Req) -> bool:
        """Would the waiting head be admitted now (ignoring the token budget)?"""
        if len(self.run) >= self.cfg.max_num_seqs:
            return False
        ntok = req.prompt_len + req.num_output
        whole = self._blocks_for(ntok + self.k)
        if whole <= self.pool.num_free:
            return True  # fits even without a prefix hit (a hit only lowers the need)
        hits = self.pool.lookup(req.hashes[: (ntok - 1) // self.bs])
        return whole - len(hits) + self.pool.num_free_among(hits) <= self.pool.num_free

    def commit_window(self, w: WindowPlan, m: int) -> tuple[list[Req], list[Req]]:
        """Apply the first `m` steps of a window exactly as m single steps would have.

        Returns (the window's rows as Reqs, in row order; the requests that finished)."""
        if compiled.ENABLED:
            return self._commit_window_compiled(w, m)
        s = w.slots
        k, bs = self.k, self.bs
        last_comp = w.computed0 + (w.cum_uncapped[m - 2] if m >= 2 else 0)  # before step m-1
        target = -(-(last_comp + w.q + k) // bs)
        self._alloc_rows(s, np.maximum(target - self.nblocks[s], 0))
        self._register_rows(s, (last_comp + 1) // bs)
        total = w.cum_uncapped[m - 1]
        self.computed[s] = w.computed0 + total
        emitted = w.emitted[:m].sum(axis=0)
        self.output[s] += emitted
        self.ntokens[s] += emitted
        self._count_window(w, m, int(emitted.sum()))
        log = self.log
        if log is not None:  # the window's m end times were logged last (log_times)
            row = log.n - m - log.base
            log.counts[row : row + m, s] = 1 if w.q == 1 else w.emitted[:m]
        reqs = [self.slot_req[x] for x in s.tolist()]
        fin_mask = self.output[s] >= self.maxtok[s]
        finished = self._finish(s[fin_mask]) if fin_mask.any() else []
        return reqs, finished  # type: ignore[return-value]

    def _commit_window_compiled(self, w: WindowPlan, m: int) -> tuple[list[Req], list[Req]]:
        """commit_window's array updates by compiled calls (the same state as the numpy code)."""
        s = w.slots
        B = len(s)
        cum = w.cum_uncapped
        need = np.empty(B, dtype=_I64)
        full = np.empty(B, dtype=_I64)
        total = compiled.window_blocks(
            s, w.computed0, cum, m, w.q, self.k, self.bs, self.nblocks, need, full
        )
        if total:
            self._alloc_rows(s, need, total)
        self._register_rows(s, full)
        log = self.log
        if log is not None:  # the window's m end times were logged last (log_times)
            counts, row = log.counts, log.n - m - log.base
        else:
            counts, row = _NO_LOG, -1
        done = np.empty(B, dtype=_I64)
        emitted, nfin = compiled.window_commit(
            s, w.computed0, cum, w.emitted, m, self.computed, self.output, self.ntokens,
            self.maxtok, counts, row, done,
        )  # fmt: skip
        self._count_window(w, m, emitted)
        slot_req = self.slot_req
        reqs = [slot_req[x] for x in s.tolist()]
        finished = self._finish(done[:nfin]) if nfin else []
        return reqs, finished  # type: ignore[return-value]

    def _count_window(self, w: WindowPlan, m: int, emitted: int) -> None:
        """The counters of the first `m` steps of a window (each a pure-decode verify step of
        every row when drafting) and the rows' verify counters."""
        c = self.counters
        c["steps_" + w.path] += m
        c["decode_steps_" + w.path] += m
        c["generation_tokens"] += emitted
        if self.k:
            self.spec_idx[w.slots] += m
            rows = m * len(w.slots)
            self._count_verified(rows, rows * self.k, int(w.accepted[:m].sum()))

    def _count_verified(self, rows: int, drafts: int, accepted: int) -> None:
        """vLLM's spec-decode counters: `rows` verify rows with `drafts` draft tokens in all, of
        which `accepted` were accepted."""
        if rows:
            c = self.counters
            c["spec_decode_num_drafts"] += rows
            c["spec_decode_num_draft_tokens"] += drafts
            c["spec_decode_num_accepted_tokens"] += accepted


_NO_LOG = np.zeros((1, 1), dtype=np.int32)  # the emission log's place when there is none
_NO_ROWS = np.zeros(0, dtype=_I64)  # no per-row values (e.g. no drafts accepted)


def _ragged(
    rows: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) pairs for counts[i] consecutive columns from starts[i] in rows[i]."""
    total = int(counts.sum())
    rep = np.repeat(np.arange(len(rows)), counts)
    offs = np.arange(total, dtype=_I64) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows[rep], starts[rep] + offs


def synthetic_outcome(plan: StepPlan, spec: SpecConfig, duration_s: float) -> StepOutput:
    """The simulator's outcome of a step: drafts accepted by the synthetic acceptance model
    (drawn per request and verify step, so independent of batching), no sampled tokens (the
    output ids were fixed at admission)."""
    accepted = None
    if spec.enabled and plan.is_decode.any():
        accepted = spec.accepted(plan.keys, plan.spec_index, plan.drafts)
    return StepOutput(duration_s=duration_s, accepted=accepted)

"""The replay plan: pure data saying what to send and under which timing rules.

A plan never looks at a clock. It fixes, from the workload and the options alone:
- which session each lane plays at each pass (closed loop) or which session arrives when (open
  loop), so both arms of an A/B send the same sessions in the same slots whatever their speeds;
- each play's cache-bust salt, from (prompt salt, seed, pass, lane, session);
- each session tree compiled into a dependency graph of nodes (`TreeSchedule`): a node becomes
  due `delay_s` after the last of its `deps` completes, and is sent then. Completion times are
  only known live, so the runner (`agentab.replay.runner`) evaluates the graph on its clock.

Timing rules (docs/replay.md), as AgentX replays:
- parent turn k waits for turn k-1 and then `max(0, t_k - t_{k-1} - api_time_{k-1})`, the
  recorded end-to-start gap (without `api_time` the recorded start-to-start gap is kept instead:
  no earlier than `t_k - t_{k-1}` after turn k-1 was sent, and never before it ended);
- a subagent is spawned after the parent item before it, at its recorded offset from that
  item's recorded end; its requests follow the same rules among themselves; its end is its last
  request's end plus the recorded tail up to `t + duration_s`;
- the first later parent turn with `t >= subagent end` joins it: it waits for the parent's
  previous turn and every subagent it joins, then keeps its recorded residual delay
  `max(0, t_k - max(recorded ends))`; a subagent no turn joins runs in the background (the tree
  still drains only when it is done).
- a lane's first play starts at a sampled parent turn p (start window); with warmup N > 0, turn
  p-1 is sent with its full output, then turns p .. p+N-1 with `max_tokens` 1, back to back,
  all tagged `warmup`; profiling continues from turn p+N with the recorded delays. Subagents
  positioned before the last warmup turn are not replayed (their joins are dropped with them).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from agentab.errors import AgentabError
from agentab.replay.options import ReplayOptions
from agentab.workloads.model import PARENT_AGENT_ID, Request, Session, Subagent, Workload

Phase = Literal["warmup", "profiling"]
NodeKind = Literal["request", "spawn", "end"]


@dataclass(frozen=True, slots=True)
class Node:
    """One step of a session tree: a request to send, or a marker (subagent spawn / end).

    Due time = max(completion of `deps`, or the tree start when there are none) + `delay_s`,
    and, when `start_gap` = (node, s) is set, no earlier than that node's send time + s.
    Markers complete the moment they are due; requests when their response ends.
    """

    index: int
    kind: NodeKind
    agent_id: str
    turn: int  # the request's index among its agent's recorded requests; -1 for markers
    deps: tuple[int, ...]
    delay_s: float
    request: Request | None = None
    start_gap: tuple[int, float] | None = None
    max_tokens: int = 0
    phase: Phase = "profiling"


@dataclass(frozen=True)
class TreeSchedule:
    """A session tree compiled into nodes (deps always point to lower indices)."""

    session_index: int
    session_id: str
    start_turn: int
    nodes: tuple[Node, ...]

    @cached_property
    def dependents(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for d in node.deps:
                out[d].append(node.index)
        return tuple(tuple(x) for x in out)

    @cached_property
    def roots(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if not n.deps)

    def requests(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "request"]

    @cached_property
    def warmup_requests(self) -> int:
        """How many of its requests are warmup: the profiling window opens once all are done."""
        return sum(1 for n in self.nodes if n.phase == "warmup")


@dataclass(frozen=True)
class Play:
    """One session played once: in lane `lane` at pass `pass_`, with its salt and schedule."""

    lane: int
    pass_: int
    session: Session
    salt: int
    schedule: TreeSchedule

    def request_id(self, node: Node) -> str:
        return f"L{self.lane}-P{self.pass_}-N{node.index}"


@dataclass(frozen=True)
class Plan:
    """Everything the runner needs: sessions, per-slot assignment, salts, schedules."""

    workload: Workload
    options: ReplayOptions
    order: tuple[int, ...]  # the session play order (a seeded permutation of the workload)
    start_turns: tuple[int, ...]  # closed loop: lane -> first parent turn of its first play
    _cache: dict[tuple[int, int, int], TreeSchedule] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def lanes(self) -> int:
        return self.options.concurrency

    # -- closed loop ------------------------------------------------------------------------

    def closed_play(self, lane: int, pass_: int) -> Play | None:
        """The play of `lane` at `pass_` (None once the lane has used up `passes`)."""
        passes = self.options.passes
        if passes is not None and pass_ >= passes:
            return None
        idx = self.order[(pass_ * self.lanes + lane) % len(self.order)]
        if pass_ == 0:
            start, warmup = self.start_turns[lane], self.options.warmup_requests
        else:
            start, warmup = 0, 0
        return self._play(lane, pass_, idx, start, warmup)

    # -- open loop --------------------------------------------------------------------------

    def arrivals(self) -> Iterator[tuple[float, Play]]:
        """Open loop: (offset from run start, play) in time order; endless unless `passes`."""
        opts = self.options
        n = len(self.order)
        passes = opts.passes
        if opts.rate is not None:
            rng = random.Random(f"{opts.seed}:arrivals")
            t = 0.0
            i = 0
            while passes is None or i < passes * n:
                pass_, k = divmod(i, n)
                yield t, self._play(i, pass_, self.order[k], 0, 0)
                t += rng.expovariate(opts.rate)
                i += 1
            return
        scale = opts.time_scale if opts.time_scale is not None else 1.0
        sessions = self.workload.sessions
        by_time = sorted(range(n), key=lambda j: (sessions[j].arrival_s, j))
        first = sessions[by_time[0]].arrival_s
        offsets = [(sessions[j].arrival_s - first) * scale for j in by_time]
        span = offsets[-1]
        # The next pass starts one mean inter-arrival gap after this pass's last arrival.
        period = span + (span / (n - 1) if n > 1 and span > 0 else scale)
        pass_ = 0
        while passes is None or pass_ < passes:
            for k, j in enumerate(by_time):
                yield pass_ * period + offsets[k], self._play(pass_ * n + k, pass_, j, 0, 0)
            pass_ += 1

    # -- shared -----------------------------------------------------------------------------

    def salt(self, pass_: int, lane: int, session: Session) -> int:
        """63-bit salt from (prompt salt, seed, pass, lane, session).

        Equal options give equal salts, so both arms of an A/B repeat, which share the replay
        options, send identical prompts; the per-run prompt salt keeps one run's prompts out of
        the prefix cache another run left on the same server. Sessions with a global hash scope
        (Mooncake) share blocks across sessions by design, so their salt leaves out lane and
        session: plays of one pass still share prefixes.
        """
        run = self.options.prompt_salt or ""
        if session.hash_scope is not None:
            key = f"{run}|{self.options.seed}|{pass_}|global:{session.hash_scope}"
        else:
            key = f"{run}|{self.options.seed}|{pass_}|{lane}|{session.id}"
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)

    def _play(self, lane: int, pass_: int, idx: int, start: int, warmup: int) -> Play:
        session = self.workload.sessions[idx]
        key = (idx, start, warmup)
        sched = self._cache.get(key)
        if sched is None:
            sched = compile_tree(session, idx, start_turn=start, warmup=warmup)
            self._cache[key] = sched
        return Play(lane, pass_, session, self.salt(pass_, lane, session), sched)


def build_plan(workload: Workload, options: ReplayOptions) -> Plan:
    """The plan for `workload` under `options` (deterministic in the seed)."""
    if len(workload.sessions) == 0:
        raise AgentabError(f"{workload.source or 'workload'}: no sessions to replay")
    if (
        options.duration_s is None
        and options.max_requests is None
        and options.lane_requests is None
        and options.passes is None
    ):
        raise AgentabError(
            "no stopping rule: give --duration, --max-requests, --lane-requests or --passes "
            "(duration_s, max_requests, lane_requests or passes in an experiment's [replay])"
        )
    arrivals = {s.arrival_s for s in workload.sessions}
    if options.time_scale is not None and len(workload.sessions) > 1 and len(arrivals) == 1:
        raise AgentabError(
            f"{workload.source or 'workload'}: --time-scale replays recorded session arrivals, "
            f"but all {len(workload.sessions)} sessions arrive at the same time (a generated "
            "workload?), so all would start at once; use --rate or --concurrency"
        )
    order = list(range(len(workload.sessions)))
    if not options.open_loop:
        random.Random(f"{options.seed}:order").shuffle(order)
    lo, hi = options.start_window
    starts = []
    for lane in range(options.concurrency if not options.open_loop else 0):
        session = workload.sessions[order[lane % len(order)]]
        n = sum(1 for _ in session.requests())
        frac = random.Random(f"{options.seed}:start:{lane}").uniform(lo, hi)
        starts.append(min(max(n - 1, 0), math.floor(frac * n)))
    return Plan(workload, options, tuple(order), tuple(starts))


# -- compiling one session tree ----------------------------------------------------------------


def _out(r: Request) -> int:
    return max(1, r.out_tokens)


def _end(r: Request) -> float | None:
    return None if r.api_time is None else r.t + r.api_time


@dataclass
class _Pending:
    """A subagent whose end no turn has joined yet."""

    end_t: float
    last: int  # node of its last request, or its spawn marker when it sent nothing
    ref_t: float | None  # recorded end of that request (spawn time for a marker); None: unknown
    tails: list[_Pending]  # nested subagents its end also waits for
    agent_id: str


class _Builder:
    """Appends nodes; applies the timing rules of the module doc while walking the items."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, **kw: object) -> int:
        idx = len(self.nodes)
        self.nodes.append(Node(index=idx, **kw))  # type: ignore[arg-type]
        return idx

    @staticmethod
    def after(
        prev: int | None, prev_req: Request | None, anchor_t: float, t: float
    ) -> tuple[tuple[int, ...], float, tuple[int, float] | None]:
        """deps, delay, start_gap for an item recorded at `t` that follows `prev`.

        `prev_req` None means `prev` is an anchor (the tree start when `prev` is None, else a
        spawn marker) recorded at `anchor_t`.
        """
        deps = () if prev is None else (prev,)
        if prev_req is None:
            return deps, max(0.0, t - anchor_t), None
        end = _end(prev_req)
        if end is None:
            assert prev is not None  # prev_req is the request `prev` names
            return deps, 0.0, (prev, max(0.0, t - prev_req.t))
        return deps, max(0.0, t - end), None

    def end_marker(self, p: _Pending) -> int:
        """Materialize a subagent's end (only once a turn joins it)."""
        deps = [p.last]
        ends = [] if p.ref_t is None else [p.ref_t]
        for nested in p.tails:
            deps.append(self.end_marker(nested))
            ends.append(nested.end_t)
        delay = max(0.0, p.end_t - max(ends)) if ends else 0.0
        return self.add(kind="end", agent_id=p.agent_id, turn=-1, deps=tuple(deps), delay_s=delay)

    def request(
        self,
        r: Request,
        agent_id: str,
        turn: int,
        prev: int | None,
        prev_req: Request | None,
        anchor_t: float,
        pending: list[_Pending],
    ) -> int:
        """Add a request after `prev`, joining every pending subagent that ended by `r.t`."""
        deps, delay, gap = self.after(prev, prev_req, anchor_t, r.t)
        joined = [p for p in pending if p.end_t <= r.t]
        if joined:
            pending[:] = [p for p in pending if p.end_t > r.t]
            ends = [p.end_t for p in joined]
            if prev_req is None:
                ends.append(anchor_t)
            elif _end(prev_req) is not None:
                ends.append(_end(prev_req))  # type: ignore[arg-type]
            deps = deps + tuple(self.end_marker(p) for p in joined)
            delay = max(0.0, r.t - max(ends))
        return self.add(
            kind="request",
            agent_id=agent_id,
            turn=turn,
            deps=deps,
            delay_s=delay,
            request=r,
            start_gap=gap,
            max_tokens=_out(r),
        )

    def subagent(
        self, s: Subagent, prev: int | None, prev_req: Request | None, anchor_t: float
    ) -> list[_Pending]:
        """Add a subagent's spawn and its items; return it as joinable unless background."""
        deps, delay, gap = self.after(prev, prev_req, anchor_t, s.t)
        spawn = self.add(
            kind="spawn", agent_id=s.agent_id, turn=-1, deps=deps, delay_s=delay, start_gap=gap
        )
        nested: list[_Pending] = []
        last, last_req = self.chain(s.items, s.agent_id, spawn, s.t, nested)
        if s.background or s.end is None:
            return []
        ref_t = s.t if last_req is None else _end(last_req)
        tails = [p for p in nested if p.end_t <= s.end]
        return [_Pending(s.end, last, ref_t, tails, s.agent_id)]

    def chain(
        self,
        items: tuple[Request | Subagent, ...],
        agent_id: str,
        anchor: int,
        anchor_t: float,
        pending: list[_Pending],
    ) -> tuple[int, Request | None]:
        """A subagent's items in order after its spawn marker `anchor`."""
        prev, prev_req = anchor, None
        turn = 0
        for item in items:
            if isinstance(item, Request):
                prev = self.request(item, agent_id, turn, prev, prev_req, anchor_t, pending)
                prev_req = item
                turn += 1
            else:
                pending.extend(self.subagent(item, prev, prev_req, anchor_t))
        return prev, prev_req


def compile_tree(
    session: Session, session_index: int = 0, *, start_turn: int = 0, warmup: int = 0
) -> TreeSchedule:
    """Compile `session` into nodes, starting at parent turn `start_turn` (see module doc)."""
    b = _Builder()
    items = session.items
    parent_pos = [i for i, it in enumerate(items) if isinstance(it, Request)]
    warm_full: set[int] = set()
    warm_one: set[int] = set()
    first_item, last_warm_pos = 0, -1
    if parent_pos:
        p = min(start_turn, len(parent_pos) - 1)
        if warmup > 0:
            warm_full = {p - 1} if p > 0 else set()
            warm_one = set(range(p, min(p + warmup, len(parent_pos))))
            first_item = parent_pos[max(0, p - 1)]
            last_warm_pos = parent_pos[max(warm_full | warm_one)]
        elif p > 0:
            first_item = parent_pos[p]
    kept = [
        (pos, it)
        for pos, it in enumerate(items)
        if pos >= first_item and not (isinstance(it, Subagent) and pos < last_warm_pos)
    ]
    anchor_t = kept[0][1].t if kept else 0.0
    turn_of = {pos: k for k, pos in enumerate(parent_pos)}

    prev: int | None = None
    prev_req: Request | None = None
    pending: list[_Pending] = []
    for pos, item in kept:
        if isinstance(item, Subagent):
            pending.extend(b.subagent(item, prev, prev_req, anchor_t))
            continue
        turn = turn_of[pos]
        if turn in warm_full or turn in warm_one:
            prev = b.add(
                kind="request",
                agent_id=PARENT_AGENT_ID,
                turn=turn,
                deps=() if prev is None else (prev,),
                delay_s=0.0,
                request=item,
                max_tokens=_out(item) if turn in warm_full else 1,
                phase="warmup",
            )
        else:
            prev = b.request(item, PARENT_AGENT_ID, turn, prev, prev_req, anchor_t, pending)
        prev_req = item
    return TreeSchedule(session_index, session.id, start_turn, tuple(b.nodes))

"""The runner: evaluates a Plan on the running loop's clock and records every request.

The same code runs in real time (HttpTarget) and on the virtual clock (EngineTarget over the
simulator): it only uses `loop.time()`, `loop.call_at` and tasks. One timer heap holds every
pending dispatch (request nodes, subagent markers, open-loop arrivals); a single `call_at`
handle is armed for the earliest, so dispatch lateness is one loop wakeup, and nothing waits
behind a connection limit or a worker pool.

Idle compression is done here because it depends on what is in flight:
- global: when nothing is in flight anywhere and the next timer is more than `idle_cap_global_s`
  after the moment the run went idle, every pending timer moves earlier by the excess (a shared
  offset, so their order and spacing are kept);
- per tree: when one tree has nothing in flight and its next timer is more than
  `idle_cap_tree_s` after that tree went idle, only that tree's timers move earlier.
The planned time recorded for a request is its due time after compression.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentab.clock import is_virtual
from agentab.errors import AgentabError
from agentab.replay.plan import Plan, Play
from agentab.replay.targets.base import Outcome, RequestSpec, Target
from agentab.rundir import PartWriter

_EPS = 1e-9
EARLY_WAKEUP_S = 0.001
"""Real clock: dispatch timers wake this much early and then yield until due, because epoll
waits are rounded up to whole milliseconds (stock asyncio timers fire up to 1 ms late)."""
MIN_REQUESTS_FOR_ERROR_RATE = 20
"""The error-rate guard acts mid-run only after this many finished requests (and at the end)."""


@dataclass
class RunStats:
    """Live counters (the progress view reads them) and the run's final account."""

    dispatched: int = 0
    finished: int = 0  # responses ended, successfully or not (cancelled ones excluded)
    errors: int = 0
    cancelled: int = 0
    inflight: int = 0
    completion_tokens: int = 0
    warmup: int = 0
    error_classes: Counter[str] = field(default_factory=Counter)
    first_errors: dict[str, str] = field(default_factory=dict)  # class -> its first message
    warning_classes: Counter[str] = field(default_factory=Counter)  # flagged, not failed
    stop_reason: str = "running"
    message: str = ""
    signal: int | None = None  # the signal that interrupted the run
    elapsed_s: float = 0.0  # loop time from run start to the last request's end
    profiling_start_s: float | None = None  # when the window opened (the last warmup ended)

    @property
    def error_rate(self) -> float:
        return self.errors / self.finished if self.finished else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "stop_reason": self.stop_reason,
            "message": self.message,
            "dispatched": self.dispatched,
            "finished": self.finished,
            "errors": self.errors,
            "error_rate": self.error_rate,
            "cancelled": self.cancelled,
            "warmup_requests": self.warmup,
            "completion_tokens": self.completion_tokens,
            "error_classes": dict(sorted(self.error_classes.items())),
            "first_errors": dict(sorted(self.first_errors.items())),
            "warning_classes": dict(sorted(self.warning_classes.items())),
            "elapsed_s": self.elapsed_s,
            "profiling_start_s": self.profiling_start_s,
        }

    def top_errors(self, n: int = 3) -> str:
        """The most frequent error classes with the first message of each, for one line."""
        return "; ".join(
            f"{cls} x{count}: {' '.join(self.first_errors.get(cls, '').split())[:160]}"
            for cls, count in self.error_classes.most_common(n)
        )


class _Tree:
    """Live state of one play: dependency counters, send times, pending timers."""

    __slots__ = ("idle_since", "inflight", "open", "play", "ready", "remaining", "sent", "timers")

    def __init__(self, play: Play, start: float) -> None:
        nodes = play.schedule.nodes
        self.play = play
        self.remaining = [len(n.deps) for n in nodes]
        self.ready = [start] * len(nodes)
        self.sent: list[float | None] = [None] * len(nodes)
        self.open = len(nodes)
        self.inflight = 0
        self.idle_since = start
        self.timers: dict[int, list[Any]] = {}


class Runner:
    """Runs `plan` against `target`, writing one record per dispatched request to `writer`."""

    def __init__(
        self,
        plan: Plan,
        target: Target,
        writer: PartWriter,
        *,
        handle_signals: bool = True,
        shard: tuple[int, int] = (0, 1),
        start_at: float | None = None,
        window: WindowSync | None = None,
    ) -> None:
        """`shard` = (k, n): play only the plays whose lane is k modulo n (one of n client
        processes sharing one plan; `agentab.replay.shards`). `start_at`: the loop time the run
        starts at (the clients' common start; default: now). `window`: the clients' shared
        profiling window (each reports when its warmup is over; all open it at once)."""
        self.plan = plan
        self.opts = plan.options
        self.target = target
        self.writer = writer
        self.handle_signals = handle_signals
        self.stats = RunStats()
        self.t0 = 0.0
        self._heap: list[list[Any]] = []  # [key, seq, tree | None, node | play, alive]
        self._seq = 0
        self._lane_sent: dict[int, int] = {}  # profiling requests sent per lane (lane_requests)
        self._offset = 0.0  # global compression: effective due = key + offset
        self._handle: asyncio.Handle | None = None  # a timer, or a call_soon while early
        self._handle_when = math.nan
        self._early = 0.0  # real clock: wake this early, then yield until due (see _on_timer)
        # in dispatch order (a dict, not a set): a stop cancels the requests in flight in the
        # order they were sent, so their records come out in the same order in every process
        self._tasks: dict[asyncio.Task[None], None] = {}
        self._stopping = False  # no more dispatches
        self._cancel_reason = ""
        self._idle_since = 0.0
        self._arrivals: Any = None
        self._signals: _RunSignals | None = None
        self._warmup_open = 0  # warmup requests not yet finished
        self.end_t = math.inf  # no dispatch due after this (the window's end, once it opened)
        self._drain_handle: asyncio.TimerHandle | None = None  # the drain cap, once set
        self.plays = 0  # session plays started (a short trace is played again and again)
        self.shard, self.shards = shard
        self.start_at = start_at
        self.window = window
        self.chunks = 0  # chunks received (the client's load)
        self.behind: list[float] = []  # real clock: how late each profiling request was sent

    # -- public -----------------------------------------------------------------------------

    @property
    def now_s(self) -> float:
        """Seconds since the run started (for the progress view)."""
        loop = getattr(self, "loop", None)
        return loop.time() - self.t0 if loop is not None else 0.0

    @property
    def profiling_s(self) -> float | None:
        """Seconds since the profiling window opened; None during warmup."""
        start = self.stats.profiling_start_s
        return None if start is None else max(0.0, self.now_s - start)

    async def run(self) -> RunStats:
        loop = asyncio.get_running_loop()
        self.loop = loop
        if self.start_at is not None:
            await asyncio.sleep(max(0.0, self.start_at - loop.time()))
        self.t0 = loop.time() if self.start_at is None else self.start_at
        self._early = 0.0 if is_virtual(loop) else EARLY_WAKEUP_S
        self._idle_since = self.t0
        self.end_t = math.inf
        self._done: asyncio.Future[None] = loop.create_future()
        self._install_signals()
        try:
            if self.opts.open_loop:
                self._arrivals = self.plan.arrivals()
                self._push_next_arrival()
            else:
                for lane in range(self.shard, self.plan.lanes, self.shards):
                    self._start_lane(lane, 0, self.t0)
            if self._warmup_open == 0:
                self._warmup_over(self.t0)
            self._after_change(None)
            await self._done
        finally:
            missed = self._remove_signals()
            if missed is not None:
                # The signal came as the run ended and the loop closed before acting on it;
                # the user still asked to stop, so the run ends interrupted (the command stops).
                self._on_signal(missed)
            if self._handle is not None:
                self._handle.cancel()
            if self._drain_handle is not None:
                self._drain_handle.cancel()
        return self.stats

    def abort(self, reason: str, message: str) -> None:
        """Stop dispatching and cancel what is in flight (recorded as `cancelled`)."""
        if self._stopping and self.stats.stop_reason in (
            "error_rate",
            "interrupted",
            "write_error",
        ):
            return
        self._stopping = True
        self.stats.stop_reason = reason
        self.stats.message = message
        self._cancel_reason = message
        for task in list(self._tasks):
            task.cancel()
        self._after_change(None)

    def _warmup_over(self, t: float) -> None:
        """This runner's last warmup request ended: open the window, or (one client of several)
        say so and open it when the last client's warmup is over (`open_window`)."""
        if self.window is None:
            self._open_window(t)
        else:
            self.window.warmup_over(t)

    def open_window(self, t: float) -> None:
        """Open the profiling window at loop time `t` (the clients' common one)."""
        if self.stats.profiling_start_s is None and not self._done.done():
            self._open_window(t)
            self._after_change(None)

    def _open_window(self, t: float) -> None:
        """The profiling phase begins: `duration_s` counts from here, as AgentX's window does.

        Warmup lanes go on into profiling without waiting for each other; only the window's
        start waits for the last warmup request, so warmup never eats into the measured time.
        """
        self.stats.profiling_start_s = t - self.t0
        if self.opts.duration_s:
            self.end_t = t + self.opts.duration_s
            cap = self.opts.drain_cap_s
            if cap is not None:
                self._drain_handle = self.loop.call_at(self.end_t + cap, self._cut_drain, cap)

    def _cut_drain(self, cap: float) -> None:
        """The drain cap: cancel what is still in flight `cap` s after the window closed. The
        window was measured in full, so the run still ends by its duration; the cut requests
        are recorded as cancelled (in no metric), and the manifest's message says how many."""
        self._drain_handle = None
        if self._done.done() or not self.stats.inflight or self._stopping:
            return
        n = self.stats.inflight
        self._stopping = True
        self.stats.stop_reason = "duration"
        self.stats.message = (
            f"drain cap: {n} request(s) still in flight {cap:g} s after the profiling window "
            "closed were cut (recorded as cancelled, in no metric)"
        )
        self._cancel_reason = f"cut by the drain cap ({cap:g} s after the window closed)"
        for task in list(self._tasks):
            task.cancel()
        self._after_change(None)

    # -- signals ----------------------------------------------------------------------------

    def _install_signals(self) -> None:
        if not self.handle_signals:
            return
        signals = _RunSignals(self.loop, self._on_signal)
        if signals.install():
            self._signals = signals

    def _remove_signals(self) -> signal.Signals | None:
        """Gives the handlers back; returns a signal that came but was not acted on."""
        signals, self._signals = self._signals, None
        if signals is None:
            return None
        signals.uninstall()
        return signals.first if self.stats.signal is None else None

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stats.signal is not None:
            return
        self.stats.signal = int(sig)
        self.abort("interrupted", f"interrupted by {sig.name}")

    # -- timers -----------------------------------------------------------------------------

    def _push(self, tree: _Tree | None, node: Any, due: float) -> list[Any]:
        entry = [due - self._offset, self._seq, tree, node, True]
        self._seq += 1
        heapq.heappush(self._heap, entry)
        if tree is not None:
            tree.timers[node] = entry
        return entry

    def _earliest(self) -> list[Any] | None:
        heap = self._heap
        while heap and not heap[0][4]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _arm(self) -> None:
        entry = self._earliest()
        if entry is None or self._stopping or entry[0] + self._offset > self.end_t:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            return
        when = entry[0] + self._offset
        if self._handle is not None:
            if self._handle_when == when:
                return
            self._handle.cancel()
        self._handle_when = when
        self._handle = self.loop.call_at(when - self._early, self._on_timer)

    def _on_timer(self) -> None:
        self._handle = None
        now = self.loop.time()
        entry = self._earliest()
        if self._early and entry is not None and not self._stopping:
            due = entry[0] + self._offset
            if now + _EPS < due <= self.end_t:
                # Woken up to `_early` before the due time on purpose: the selector rounds waits
                # up to whole milliseconds. Yield to the loop (I/O keeps flowing) until due.
                self._handle = self.loop.call_soon(self._on_timer)
                return
        touched: list[_Tree | None] = []
        while not self._stopping:
            entry = self._earliest()
            if entry is None:
                break
            due = entry[0] + self._offset
            if due > now + _EPS or due > self.end_t:
                break
            heapq.heappop(self._heap)
            entry[4] = False
            tree = entry[2]
            if tree is not None:
                del tree.timers[entry[3]]
            touched.append(tree)
            self._fire(tree, entry[3], due)
        self._after_change(touched)

    def _fire(self, tree: _Tree | None, node_idx: Any, due: float) -> None:
        if tree is None:  # an open-loop arrival
            self._start_tree(node_idx, due)
            self._push_next_arrival()
            return
        node = tree.play.schedule.nodes[node_idx]
        if node.kind != "request":
            self._complete(tree, node_idx, due)
            return
        cap = self.opts.lane_requests
        if cap is not None and node.phase == "profiling":
            lane = tree.play.lane
            if self._lane_sent.get(lane, 0) >= cap:
                return  # the lane is done: its later requests are not sent, its tree never ends
            self._lane_sent[lane] = self._lane_sent.get(lane, 0) + 1
        self.stats.dispatched += 1
        if self._early and node.phase == "profiling":  # real clock: how late this timer fired
            self.behind.append(self.loop.time() - due)
        max_req = self.opts.max_requests
        if max_req is not None and self.stats.dispatched >= max_req:
            self._stopping = True  # this one is the last; the run ends when it is done
            self.stats.stop_reason = "max_requests"
        self.stats.inflight += 1
        tree.inflight += 1
        task = self.loop.create_task(self._execute(tree, node_idx, due))
        self._tasks[task] = None

    # -- compression ------------------------------------------------------------------------

    def _after_change(self, touched: list[_Tree | None] | None) -> None:
        if touched:
            seen: set[int] = set()
            for tree in touched:
                if tree is not None and id(tree) not in seen:
                    seen.add(id(tree))
                    self._compress_tree(tree)
        self._compress_global()
        self._arm()
        self._check_done()

    def _compress_tree(self, tree: _Tree) -> None:
        cap = self.opts.idle_cap_tree_s
        if cap <= 0 or tree.inflight or not tree.timers:
            return
        nxt = min(e[0] for e in tree.timers.values()) + self._offset
        target = max(self.loop.time(), tree.idle_since + cap)
        delta = nxt - target
        if delta <= _EPS:
            return
        for node, entry in list(tree.timers.items()):
            entry[4] = False
            self._push(tree, node, entry[0] + self._offset - delta)

    def _compress_global(self) -> None:
        cap = self.opts.idle_cap_global_s
        if cap <= 0 or self.stats.inflight or self._stopping:
            return
        entry = self._earliest()
        if entry is None:
            return
        nxt = entry[0] + self._offset
        target = max(self.loop.time(), self._idle_since + cap)
        if nxt - target > _EPS:
            self._offset -= nxt - target

    # -- trees ------------------------------------------------------------------------------

    def _push_next_arrival(self) -> None:
        nxt = next(self._arrivals, None)
        while nxt is not None and nxt[1].lane % self.shards != self.shard:
            nxt = next(self._arrivals, None)  # another client's arrival
        if nxt is not None:
            offset, play = nxt
            self._push(None, play, self.t0 + offset)

    def _start_lane(self, lane: int, pass_: int, t: float) -> None:
        """Start the lane's next play with requests (skipping empty sessions)."""
        while not self._stopping and t <= self.end_t:
            play = self.plan.closed_play(lane, pass_)
            if play is None:
                return
            if play.schedule.nodes:
                self.plays += 1
                self._start_tree(play, t)
                return
            pass_ += 1

    def _start_tree(self, play: Play, t: float) -> None:
        tree = _Tree(play, t)
        self._warmup_open += play.schedule.warmup_requests
        nodes = play.schedule.nodes
        for r in play.schedule.roots:
            self._push(tree, r, t + nodes[r].delay_s)
        self._compress_tree(tree)

    def _complete(self, tree: _Tree, idx: int, t: float) -> None:
        sched = tree.play.schedule
        nodes = sched.nodes
        tree.open -= 1
        for d in sched.dependents[idx]:
            tree.remaining[d] -= 1
            if t > tree.ready[d]:
                tree.ready[d] = t
            if tree.remaining[d] == 0:
                node = nodes[d]
                due = tree.ready[d] + node.delay_s
                if node.start_gap is not None:
                    g, gap = node.start_gap
                    sent = tree.sent[g]
                    if sent is not None and sent + gap > due:
                        due = sent + gap
                self._push(tree, d, due)
        if tree.open == 0 and not self.opts.open_loop:
            self._start_lane(tree.play.lane, tree.play.pass_ + 1, t)

    def _check_done(self) -> None:
        if self.stats.inflight or self._done.done():
            return
        entry = self._earliest()
        if entry is not None and not self._stopping:
            if entry[0] + self._offset <= self.end_t:
                return
            self.stats.stop_reason = "duration"
        if self.stats.stop_reason == "running":
            self.stats.stop_reason = "completed"
        self._done.set_result(None)

    # -- requests ---------------------------------------------------------------------------

    async def _execute(self, tree: _Tree, idx: int, planned: float) -> None:
        """Send one request and record it; the task leaves `_tasks` when this returns.

        It removes itself (`_tasks` only serves to cancel what is in flight) rather than through
        a done callback: a done callback is one more handle through the loop per request, about
        a tenth of the loop's iterations. A task cancelled before its first step never runs
        this body and stays in `_tasks`, done, where cancelling it again does nothing."""
        try:
            await self._run_request(tree, idx, planned)
        finally:
            self._tasks.pop(asyncio.current_task(self.loop), None)  # type: ignore[arg-type]

    async def _run_request(self, tree: _Tree, idx: int, planned: float) -> None:
        play = tree.play
        node = play.schedule.nodes[idx]
        assert node.request is not None
        spec = RequestSpec(
            play.request_id(node), play.session, node.request, play.salt, node.max_tokens, play.lane
        )
        out = Outcome()
        cancelled = False
        try:
            await self.target.send(spec, out)
        except asyncio.CancelledError:
            cancelled = True
            out.error_class = None
            out.fail("cancelled", self._cancel_reason or "cancelled")
        except Exception as exc:  # a failing target must not lose the record or the run
            out.fail("client", f"{type(exc).__name__}: {exc}")
        now = self.loop.time()
        if out.end is None:
            out.end = now
        try:
            self._record(tree, node, planned, out)
        except AgentabError as exc:  # the records cannot be written: stop, do not lose more
            self.abort("write_error", str(exc))
        stats = self.stats
        stats.inflight -= 1
        tree.inflight -= 1
        tree.sent[idx] = out.sent if out.sent is not None else planned
        if tree.inflight == 0:
            tree.idle_since = now
        if stats.inflight == 0:
            self._idle_since = now
        stats.elapsed_s = max(stats.elapsed_s, out.end - self.t0)
        if node.phase == "warmup":
            self._warmup_open -= 1
            if self._warmup_open == 0 and stats.profiling_start_s is None:
                self._warmup_over(now)
        if cancelled:
            stats.cancelled += 1
        else:
            stats.finished += 1
            if node.phase == "warmup":
                stats.warmup += 1
            if out.error_class is not None:
                stats.errors += 1
                stats.error_classes[out.error_class] += 1
                stats.first_errors.setdefault(out.error_class, out.error_message or "")
            if out.warning_class is not None:
                stats.warning_classes[out.warning_class] += 1
            stats.completion_tokens += out.completion_tokens or len(out.chunk_times)
            self._complete(tree, idx, now)
            self._check_error_rate()
        self._after_change([tree])

    def _check_error_rate(self) -> None:
        s = self.stats
        if s.finished >= MIN_REQUESTS_FOR_ERROR_RATE and s.error_rate > self.opts.max_error_rate:
            self.abort(
                "error_rate",
                f"error rate {s.error_rate:.1%} ({s.errors} of {s.finished} requests) exceeds "
                f"max_error_rate {self.opts.max_error_rate:.1%}; top errors: {s.top_errors()}",
            )

    def _record(self, tree: _Tree, node: Any, planned: float, out: Outcome) -> None:
        play = tree.play
        t0 = self.t0
        sent = out.sent
        self.chunks += len(out.chunk_times)
        self.writer.add(
            {
                "request_id": play.request_id(node),
                "session_id": play.session.id,
                "lane": play.lane,
                "pass": play.pass_,
                "agent_id": node.agent_id,
                "turn": node.turn,
                "phase": node.phase,
                "planned_s": planned - t0,
                "sent_s": None if sent is None else sent - t0,
                "chunk_times_s": out.chunk_times,
                "chunk_tokens": out.chunk_tokens,
                "reasoning_chunks": out.reasoning_chunks,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens,
                "osl": node.max_tokens,
                "error_class": out.error_class,
                "error_message": out.error_message,
                "warning_class": out.warning_class,
                "warning_message": out.warning_message,
                "target": out.target,
            }
        )


class WindowSync(Protocol):
    """The clients of one sharded run share one profiling window (`agentab.replay.shards`)."""

    def warmup_over(self, t: float) -> None:
        """This client's warmup requests have all ended, at loop time `t`."""
        ...


class _RunSignals:
    """SIGINT / SIGTERM while a run is on.

    The first signal stops the run (on the loop); what remains is writing the run dir
    (records, manifest, closing the HTTP session), which a second signal must not cut short:
    it is noted on stderr, and only a third one ends the process where it stands (the user
    insists). This one Python-level handler serves the whole run and, once signalled, stays
    until the process ends: swapping handlers after the first signal would leave an instant
    in which a signal already pending gets Python's default one (KeyboardInterrupt) and
    abandons the run dir.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_first: Callable[[signal.Signals], None]
    ) -> None:
        self.loop = loop
        self.on_first = on_first
        self.seen = 0
        self.first: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> bool:
        """False off the main thread, where signals are the caller's to handle.

        A signal the process was started with ignored stays ignored (a job started in the
        background by a script, or under `nohup`, is meant to be immune to the terminal's
        Ctrl-C; Python itself installs no KeyboardInterrupt then)."""
        try:
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self)
        except ValueError:
            self._restore()
            return False
        return True

    def uninstall(self) -> None:
        """At the run's end: an unsignalled run gives the handlers back; a signalled one keeps
        this handler so the run dir can still be written."""
        if self.seen == 0:
            self._restore()

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __call__(self, signum: int, frame: object) -> None:
        self.seen += 1
        if self.seen == 1:
            # The handler runs between two bytecodes of the main thread; the loop acts on it at
            # its next iteration (and is woken if it waits in select).
            self.first = signal.Signals(signum)
            self.loop.call_soon_threadsafe(self.on_first, self.first)
        elif self.seen == 2:
            sys.stderr.write("agentab: finishing the run dir; signal once more to abandon it\n")
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

"""The Engine: a step loop over a Scheduler and an executor, on asyncio's clock.

Time is the running loop's time. On the virtual clock (agentab.clock.run_virtual) a step's
`asyncio.sleep` jumps straight to its end; served over HTTP it is real time. Token events carry
the loop time of the step that produced them and reach the client no earlier than that; a
request's last event (and its FinalUsage) is delivered at exactly its time, so whatever the
client does next (the replay's next turn) happens at the right moment.

One loop serves every executor (`Engine._loop`): schedule -> execute -> update from the output
-> hand out. The executor is either priced (the simulator: the loop sleeps for each step's
price) or measured (a real model: the step runs in a worker thread, so the loop keeps serving
HTTP while the device works, and the step takes as long as it takes); see
agentab.engine.executor. Async scheduling is the loop's depth, not another loop: with it, step
k+1 is scheduled and applied while step k runs (as vLLM and the local engine on a GPU do, and
the simulator when its profile says `[engine] async_scheduling`), so a request that arrives
during step k joins step k+2 at the earliest; each step's tokens, finishes and trace record are
handed out when it ends.

Speed on the virtual clock, the one fast path: while nothing changes but decode progress, the
engine prices a whole window of steps at once (agentab.engine.window) and sleeps to the
window's end, or until a new request or an abort arrives. Then it commits only the steps that
had started before the arrival (the step in flight completes, as on a GPU; with async
scheduling one step later) and resumes step by step, so the result is the same as stepping one
at a time (tests/engine/test_window.py, and test_engine_api.py's fast-forward fixtures).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentab.clock import is_virtual
from agentab.engine.executor import Executor
from agentab.engine.metric_keys import series
from agentab.engine.outputs import Advance, StepOutput, StepPlan, WindowPlan
from agentab.engine.request import Request
from agentab.engine.scheduler import Scheduler
from agentab.engine.streams import Channel, Timeline
from agentab.engine.types import EngineRequest, FinalUsage, TokenEvent
from agentab.errors import AgentabError

StepObserver = Callable[[dict[str, Any]], None]
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class EngineFailed(AgentabError):
    """The engine's step loop died (a bug, or a device error): no request can be served."""


@dataclass(slots=True)
class _Step:
    """A step launched and applied to the scheduler, not yet handed out: what goes out when
    the clock reaches `end` (a measured step's end is when it is collected)."""

    start: float
    end: float
    finished: list[Request]
    events: list[tuple[Channel, int, np.ndarray | None]]  # (stream, tokens, their ids)
    # (plan, trace rows), or (None, a window step's record fields); None: no trace
    record: tuple[Any, Any] | None
    launched: asyncio.Future[Any] | None = None  # a measured step's launch (worker thread)
    adv: Advance | None = None  # a measured step applied before its tokens are known
    pending: tuple[StepPlan, StepOutput] | None = None  # a priced step applied at its end

    @property
    def unapplied(self) -> bool:
        """A measured step with drafts, applied to the scheduler only when collected: its rows
        must keep their slots until then (an abort waits for it)."""
        return self.launched is not None and self.adv is None


class Engine:
    """Continuous-batching engine: `Engine(scheduler, executor)`; see docs/interfaces.md."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        describe: dict[str, Any] | None = None,
        fast_forward: bool = True,
        max_window_steps: int = 256,
        async_scheduling: bool = False,
    ) -> None:
        """`async_scheduling`: a priced executor's loop schedules one step ahead (see the
        module docstring); a measured one does whenever its device runs launched work by
        itself (`launches_async`), whatever this says."""
        self.scheduler = scheduler
        self.executor = executor
        self._describe = dict(describe or {})
        self.fast_forward = fast_forward
        self.async_scheduling = async_scheduling
        self.max_window_steps = max_window_steps
        self.step_observer: StepObserver | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._aborts: list[str] = []
        self._step_no = 0
        self._worker: Any = None  # the thread a measured executor's steps run in
        self._collector: Any = None  # and, scheduled ahead, the one its steps are collected in
        self._failure: BaseException | None = None  # why the step loop died, if it did
        self._channels: set[Channel | Timeline] = set()  # open streams (woken on a failure)
        self._streams = 0  # open `generate` streams (steps need per-row work only for these)
        self._wakes = 0  # requests and aborts so far (a wake-up is not lost between two waits)
        self._inflight: deque[_Step] = deque()  # launched, not yet handed out (oldest first)
        self._prev_end: float | None = None  # the real clock's last priced step end (depth 1)
        self._prev_s = 0.0  # and its duration
        self._virtual = False  # the loop runs on the virtual clock

    # -- public API ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop as a task of the running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._guarded(), name="engine-loop")

    async def _guarded(self) -> None:
        """The step loop; if it dies, every open stream and every later request fails with the
        reason, instead of waiting forever for tokens that will not come."""
        try:
            await self._loop()
        except Exception as exc:
            self._failure = exc
            for ch in list(self._channels):
                if isinstance(ch, Timeline):
                    if not ch.finished.done():
                        ch.finished.set_exception(self._failure_error())
                else:
                    ch.wake()
            raise

    def _failure_error(self) -> EngineFailed:
        exc = self._failure
        assert exc is not None
        err = EngineFailed(f"the engine's step loop failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _raise_failure(self) -> None:
        raise self._failure_error()

    async def stop(self) -> None:
        """Stop the loop; requests still in flight end with finish_reason "abort".

        A step already running on the device completes first (its thread cannot be cancelled).
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # a loop that died has told every stream why (EngineFailed); stopping is not the
            # place to raise it again
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for worker in (self._worker, self._collector):
            if worker is not None:
                worker.shutdown(wait=True)
        self._worker = self._collector = None
        self.executor.close()  # e.g. the local engine's other tensor-parallel ranks
        for step in self._inflight:  # finished in a step that never ended: aborted
            for req in step.finished:
                self._finish(req, self._undelivered(req), "abort")
        self._inflight.clear()
        self._aborts.extend(self.scheduler.requests)
        self._apply_aborts()

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent | FinalUsage]:
        """Stream `TokenEvent`s, then one `FinalUsage`. Leaving early aborts the request.

        Raises `EngineFailed` if the engine's step loop has died (now or while streaming)."""
        if self._failure is not None:
            self._raise_failure()
        req = self.scheduler.add(
            request.request_id,
            request.prompt_token_ids,
            request.max_tokens,
            request.prefix,
            request.draw_id,
        )
        ch = Channel()
        req.sink = ch
        self._channels.add(ch)
        self._streams += 1
        self._wake()
        loop = asyncio.get_running_loop()
        try:
            while True:
                while ch.items:
                    item = ch.items.popleft()
                    yield item
                    if type(item) is FinalUsage:
                        return
                if self._failure is not None:
                    self._raise_failure()
                ch.waiter = loop.create_future()
                await ch.waiter
                ch.waiter = None
        finally:
            self._channels.discard(ch)
            self._streams -= 1
            if not ch.done and self._failure is None:
                self.abort(request.request_id)

    def submit(self, request: EngineRequest) -> Timeline:
        """Queue a request whose chunks are collected rather than streamed (see Timeline).

        `await timeline.finished` gives its FinalUsage (finish_reason "abort" if aborted);
        `timeline.chunks()` its chunk times and token counts, also part-way. The caller aborts
        the request itself if it stops waiting. Raises like `generate` (a refused request,
        a dead step loop)."""
        if self._failure is not None:
            self._raise_failure()
        req = self.scheduler.add(
            request.request_id,
            request.prompt_token_ids,
            request.max_tokens,
            request.prefix,
            request.draw_id,
        )
        tl = Timeline(asyncio.get_running_loop().create_future(), req, self.scheduler)
        req.sink = tl
        self._channels.add(tl)
        self._wake()
        return tl

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary (its stream ends with "abort")."""
        self._aborts.append(request_id)
        self._wake()

    def metrics(self) -> dict[str, float]:
        """Counters and gauges under vLLM's Prometheus names (plus a few agentab:* ones)."""
        c = self.scheduler.counters
        pool = self.scheduler.pool
        return {
            "vllm:prefix_cache_queries_total": c["prefix_cache_queries"],
            "vllm:prefix_cache_hits_total": c["prefix_cache_hits"],
            "vllm:spec_decode_num_drafts_total": c["spec_decode_num_drafts"],
            "vllm:spec_decode_num_draft_tokens_total": c["spec_decode_num_draft_tokens"],
            "vllm:spec_decode_num_accepted_tokens_total": c["spec_decode_num_accepted_tokens"],
            "vllm:num_preemptions_total": c["num_preemptions"],
            "vllm:prompt_tokens_total": c["prompt_tokens"],
            "vllm:generation_tokens_total": c["generation_tokens"],
            "vllm:request_success_total": c["request_success"],
            "vllm:num_requests_running": float(self.scheduler.num_running),
            "vllm:num_requests_waiting": float(len(self.scheduler.waiting)),
            "vllm:kv_cache_usage_perc": pool.usage(),
            "agentab:request_abort_total": c["request_abort"],
            "agentab:prefix_cache_preempted_queries_total": c["prefix_cache_preempted_queries"],
            "agentab:prefix_cache_preempted_hits_total": c["prefix_cache_preempted_hits"],
            "agentab:kv_cache_evicted_blocks_total": float(pool.evictions),
            "agentab:steps_standard_total": c["steps_standard"],
            "agentab:steps_specialized_total": c["steps_specialized"],
            "agentab:decode_steps_standard_total": c["decode_steps_standard"],
            "agentab:decode_steps_specialized_total": c["decode_steps_specialized"],
            **{
                series(_PER_POS, position=str(i)): float(n)
                for i, n in enumerate(self.scheduler.accepted_per_pos.tolist())
            },
            **self.executor.metrics(),
        }

    def describe(self) -> dict[str, Any]:
        """What a run manifest records about this engine."""
        ahead = self._schedules_ahead()
        return {**self._describe, **self.executor.describe(), "async_scheduling": ahead}

    # -- the loop -----------------------------------------------------------------------------
    def _wake(self) -> None:
        self._wakes += 1
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self, loop: asyncio.AbstractEventLoop, until: float | None) -> None:
        """Sleep until `until` (None: forever) or until a request or abort arrives."""
        fut = loop.create_future()
        self._wakeup = fut
        handle = None
        if until is not None:
            handle = loop.call_at(until, _resolve, fut)
        try:
            await fut
        finally:
            self._wakeup = None
            if handle is not None:
                handle.cancel()

    async def _loop(self) -> None:
        """The one step loop: schedule -> execute -> update from the output -> hand out.

        Every step is launched (`_launch`: a priced executor prices it, a measured one queues
        it on its device in a worker thread), applied to the scheduler (`Scheduler.update`
        with the priced outcome, or `Scheduler.advance` before a measured step's tokens are
        known, filled in when it is collected; a priced step without async scheduling when it
        ends) and handed out when it ends (`_complete`: its tokens, finishes and trace
        record). Async scheduling is the loop's depth: with it (2)
        the next step is scheduled and launched before the one in flight is handed out;
        without it (1) a step is scheduled once the previous one has ended. The simulator's
        decode windows are the one fast path (`_fast_forward`, agentab.engine.window).
        """
        loop = asyncio.get_running_loop()
        sched, ex = self.scheduler, self.executor
        virtual = self._virtual = is_virtual(loop)
        depth = 2 if self._schedules_ahead() else 1
        if ex.measured:
            self._start_threads(depth)
        else:
            sched.collect_timelines()
            assert sched.log is not None
            sched.log.until = -np.inf  # nothing handed out yet
        windows = virtual and self.fast_forward and not ex.measured
        inflight = self._inflight
        while True:
            # (not while a step with drafts runs: it is applied to its rows when collected)
            if self._aborts and not (inflight and inflight[-1].unapplied):
                self._apply_aborts()
            if sched.has_work() and len(inflight) < depth:
                start = self._next_start(loop, virtual, depth)
                # a window goes behind a step in flight whose end changes nothing but decode
                # progress (a finish would bring the next turn)
                if windows and (depth == 1 or (inflight and not inflight[-1].finished)):
                    w = sched.plan_window(self.max_window_steps)
                    if w is not None:
                        await self._fast_forward(loop, w, start)
                        continue
                plan = sched.schedule()
                if plan.total_tokens:
                    inflight.append(self._launch(loop, plan, start, virtual, depth))
                    continue
                if not inflight:
                    await asyncio.sleep(0)  # everything was preempted: the next step re-admits
                    continue
            if inflight:
                await self._complete(loop, inflight[0], depth)
                inflight.popleft()
                continue
            self._prev_end = None
            await self._wait(loop, None)

    def _schedules_ahead(self) -> bool:
        """Async scheduling: a measured executor whose launch returns before its work is done
        (a device runs it by itself; a CPU computes inside launch, so running ahead would only
        delay tokens), or a priced one whose profile says the engine schedules ahead."""
        if self.executor.measured:
            return self.executor.launches_async
        return self.async_scheduling

    def _start_threads(self, depth: int) -> None:
        """A measured executor's steps are launched in a worker thread; scheduled ahead, they
        are collected in a second one, so step k's tokens go out when it is done, not after the
        host has launched step k+1."""
        from concurrent.futures import ThreadPoolExecutor

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="agentab-step")
        if self._collector is None and depth == 2:
            self._collector = ThreadPoolExecutor(1, thread_name_prefix="agentab-collect")

    def _next_start(self, loop: asyncio.AbstractEventLoop, virtual: bool, depth: int) -> float:
        """When the next step starts: at the end of the step in flight (the device never waits
        for the host) or now. On the real clock without async scheduling a host that is late by
        less than one step starts it when the previous one was priced to end, so the host's
        time between steps (streaming, timer lateness) does not stretch every step; a host
        later than that starts afresh instead of compressing the steps after it."""
        now = loop.time()
        if self._inflight:
            return max(self._inflight[-1].end, now)
        prev = self._prev_end
        if depth == 1 and prev is not None and 0.0 <= now - prev < self._prev_s:
            return prev
        return now

    def _launch(
        self,
        loop: asyncio.AbstractEventLoop,
        plan: StepPlan,
        start: float,
        virtual: bool,
        depth: int,
    ) -> _Step:
        """Execute a step. A measured step and, with async scheduling, a priced one are applied
        to the scheduler now (the next step is scheduled from that state); a priced step
        without it is applied when it ends, so what is read of the engine meanwhile (its
        metrics) is the state before it, as on the engine it models."""
        sched, ex = self.scheduler, self.executor
        if ex.measured:
            rows = self._step_rows(plan) if self.step_observer is not None else []
            inputs = sched.model_inputs(plan)
            launched = loop.run_in_executor(self._worker, ex.launch, plan, inputs)
            if sched.k and depth == 1:  # nothing runs ahead: applied, exactly, when collected
                return _Step(start, start, [], [], (plan, rows), launched)
            adv = sched.advance(plan)
            return _Step(start, start, adv.finished, [], (plan, rows), launched, adv)
        output = ex.execute(plan)
        end = start + output.duration_s
        if depth == 2:
            return self._apply(plan, output, start, end)
        if not virtual:
            self._prev_end, self._prev_s = end, output.duration_s
        return _Step(start, end, [], [], None, pending=(plan, output))

    def _apply(self, plan: StepPlan, output: StepOutput, start: float, end: float) -> _Step:
        """Apply a priced step ending at `end` (update_from_output); its events wait for it."""
        sched = self.scheduler
        record = None
        if self.step_observer is not None:
            record = (plan, self._step_rows(plan))
        sched.log_times(np.array([end]))
        reqs, counts, finished = sched.update(plan, output, self._streams > 0)
        events: list[tuple[Channel, int, np.ndarray | None]] = []
        if self._streams:
            for req, n in zip(reqs, counts, strict=True):
                ch = req.sink
                if type(ch) is Channel:
                    events.append((ch, n, sched.output_ids(req, n)))
        return _Step(start, end, finished, events, record)

    async def _complete(self, loop: asyncio.AbstractEventLoop, step: _Step, depth: int) -> None:
        """Wait for a step's end and hand out what it produced."""
        if step.launched is not None:
            await self._collect(loop, step)
            return
        delay = step.end - loop.time()
        if delay > 0 or depth == 1:  # (without a step ahead the loop yields between steps)
            await asyncio.sleep(delay if delay > 0 else 0)
        if step.pending is not None:  # applied now: on the real clock, at the time it ended
            plan, output = step.pending
            t = max(loop.time(), step.end) if self._virtual else loop.time()
            step = self._apply(plan, output, step.start, t)
        self._hand_out(step)

    async def _collect(self, loop: asyncio.AbstractEventLoop, step: _Step) -> None:
        """A measured step: wait for the device, write the sampled tokens, stream them."""
        assert step.launched is not None and step.record is not None
        ex = self.executor
        output = await loop.run_in_executor(
            self._collector or self._worker, ex.collect, await step.launched
        )
        t = loop.time()
        plan, rows = step.record
        if self.step_observer is not None:
            self._emit_record(step.start, t - step.start, *self._record_fields(plan, rows))
        if output.sampled is None:
            raise AgentabError("a measured executor's step returned no sampled tokens")
        adv = step.adv
        finished_now: list[Request] = []
        if adv is None:  # a step with drafts: applied now, from what it accepted and sampled
            adv = self.scheduler.apply(plan, output)
        else:  # (with drafts, counts corrected by what the step accepted)
            finished_now = self.scheduler.fill(adv, output.sampled, output.accepted, plan.drafts)
        for req, n, at in zip(adv.reqs, adv.counts, adv.starts, strict=True):
            if n == 0:  # it reached max_tokens in an earlier step that accepted more drafts
                continue
            ch = req.sink
            if ch is None or ch.done:  # type: ignore[attr-defined]
                continue
            if type(ch) is Timeline:
                ch.add_step(t, n)
            else:
                assert isinstance(ch, Channel)
                ch.items.append(TokenEvent(t, n, req.tokens[at : at + n]))
                ch.wake()
        for req in (*finished_now, *adv.finished):
            self._finish(req)

    def _hand_out(self, step: _Step) -> None:
        """At a priced step's end: its events, trace record and finishes. Events carry the
        time the step was priced to end, as its collected chunks do."""
        t = step.end
        log = self.scheduler.log
        assert log is not None
        log.until = t
        if step.record is not None:
            plan, rows = step.record
            if plan is None:  # a window's last step (its fields are in rows)
                self._emit_record(step.start, t - step.start, *rows)
            else:
                self._emit_record(step.start, t - step.start, *self._record_fields(plan, rows))
        for ch, n, ids in step.events:
            if not ch.done:  # aborted while the step ran
                ch.items.append(TokenEvent(t, n, ids))
                ch.wake()
        for req in step.finished:
            self._finish(req)

    # -- the fast path: decode windows (agentab.engine.window) --------------------------------
    async def _fast_forward(
        self, loop: asyncio.AbstractEventLoop, w: WindowPlan, t0: float
    ) -> None:
        """Run a window of decode steps instead of stepping: behind the step in flight with
        async scheduling, else from `t0`. Both give the steps and times stepping gives."""
        if self._inflight:
            ahead = self._inflight.popleft()
            self._inflight.append(await self._run_window_ahead(loop, w, ahead))
        else:
            await self._run_window(loop, w, t0)

    async def _run_window_ahead(
        self, loop: asyncio.AbstractEventLoop, w: WindowPlan, ahead: _Step
    ) -> _Step:
        """A window of decode steps behind the step in flight (`ahead`), with async scheduling.

        Window step j+1 is scheduled when step j-1 ends (`ahead` ends as step -1), so a request
        or abort that arrives after that and no later than step j's end is first seen by the
        step after window step j: the window keeps steps 0..j, step j is the new step in flight,
        and the loop resumes at the end of step j-1. With no arrival all n steps are kept and
        the loop resumes when step n-2 ends. Stepping gives the same steps at the same times.
        """
        ends = ahead.end + self.executor.window_seconds(w).cumsum()
        n = len(ends)
        scheduled_at = np.concatenate(([ahead.end], ends[:-1]))  # when step j+1 is scheduled
        wakes = self._wakes
        await self._wait(loop, ahead.end)  # the step in flight is handed out at its end
        handed = self._wakes == wakes  # nothing arrived before it ended
        if handed:
            self._hand_out(ahead)
            if n > 1 and self._wakes == wakes:
                await self._wait(loop, float(scheduled_at[-1]))
        m = min(int(scheduled_at.searchsorted(loop.time(), side="left")) + 1, n)
        if not handed:
            await self._complete(loop, ahead, 2)
        resume = float(scheduled_at[m - 1])
        delay = resume - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sched = self.scheduler
        rows = self._window_rows(w) if self.step_observer is not None else []
        sched.log_times(ends[:m])
        reqs = sched.requests_of(w.slots) if self._streams else []
        finished = sched.commit_window(w, m)
        times = ends[:m].tolist()
        starts = [ahead.end, *times[:-1]]
        if self.step_observer is not None:
            self._observe_window(w, rows, starts[: m - 1], times[: m - 1])
        sched.log.until = times[m - 2] if m > 1 else ahead.end  # type: ignore[union-attr]
        last: list[tuple[Channel, int, np.ndarray | None]] = []
        if self._streams:
            for ch, events in self._window_events(w, m, times, reqs):
                if events and events[-1].t == times[-1]:  # the step in flight: handed out later
                    final = events.pop()
                    last.append((ch, final.num_tokens, final.token_ids))
                if events:
                    ch.items.extend(events)
                    ch.wake()
        record = None
        if self.step_observer is not None:
            fields: tuple[Any, ...] = (w.path, 0, w.q * len(rows), w.num_running, w.num_waiting)
            fields += ([], rows)
            record = (None, fields)
        return _Step(starts[-1], times[-1], finished, last, record)

    async def _run_window(self, loop: asyncio.AbstractEventLoop, w: WindowPlan, t0: float) -> None:
        ends = t0 + self.executor.window_seconds(w).cumsum()
        await self._wait(loop, float(ends[-1]))
        now = loop.time()
        # the step in flight at `now` completes before anything new is scheduled (as on a GPU)
        m = min(int(ends.searchsorted(now, side="left")) + 1, len(ends))
        delay = float(ends[m - 1]) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t_last = max(loop.time(), float(ends[m - 1]))
        step_ends = ends[:m]
        step_ends[-1] = t_last
        if self.step_observer is not None:
            times = step_ends.tolist()
            self._observe_window(w, self._window_rows(w), [t0, *times[:-1]], times)
        sched = self.scheduler
        sched.log_times(step_ends)
        reqs = sched.requests_of(w.slots) if self._streams else []
        finished = sched.commit_window(w, m)
        assert sched.log is not None
        sched.log.until = float(step_ends[-1])
        if self._streams:
            for ch, events in self._window_events(w, m, step_ends.tolist(), reqs):
                ch.items.extend(events)
                ch.wake()
        for req in finished:
            self._finish(req)

    def _window_events(
        self, w: WindowPlan, m: int, times: list[float], reqs: list[Request]
    ) -> list[tuple[Channel, list[TokenEvent]]]:
        """A committed window's token events for the requests streamed through `generate`."""
        output_ids = self.scheduler.output_ids
        # without drafts every row emits one token per step of a window
        cols = [[1] * m] * len(reqs) if w.q == 1 else w.emitted[:m].T.tolist()
        out = []
        for req, col in zip(reqs, cols, strict=True):
            ch = req.sink
            if type(ch) is not Channel:
                continue
            ids = output_ids(req, sum(col))
            at = 0
            events = []
            for t, n in zip(times, col, strict=True):
                if n:
                    events.append(TokenEvent(t, n, ids[at : at + n]))
                    at += n
            out.append((ch, events))
        return out

    def _finish(self, req: Request, undelivered: int = 0, reason: str | None = None) -> None:
        """End a request's stream; `undelivered`: tokens of steps applied ahead that it will
        not get (it was aborted while they ran); `reason`: the finish reason, if not its own."""
        ch = req.sink
        if ch is None:
            return
        usage = FinalUsage(
            prompt_tokens=req.prompt_len,
            completion_tokens=req.num_output - undelivered,
            cached_tokens=max(req.cached_tokens, 0),
            finish_reason=reason or req.finish_reason or "length",
        )
        if type(ch) is Timeline:
            ch.done = True
            self._channels.discard(ch)
            if not ch.finished.done():
                ch.finished.set_result(usage)
            return
        assert isinstance(ch, Channel)
        ch.done = True
        ch.items.append(usage)
        ch.wake()

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        sched = self.scheduler
        for rid in aborts:
            req = sched.requests.get(rid)
            undelivered = self._undelivered(req) if req is not None else 0
            req = sched.abort(rid)
            if req is not None:
                self._finish(req, undelivered)

    def _undelivered(self, req: Request) -> int:
        """Tokens a request emitted in priced steps applied ahead of their end (async
        scheduling): its collected chunks leave them out, and so does its usage if aborted."""
        log = self.scheduler.log
        if log is None or log.until is None:
            return 0
        parts = self.scheduler.emitted_parts(req)
        return sum(int(counts[times > log.until].sum()) for times, counts in parts)

    # -- step records (engine trace) ----------------------------------------------------------
    def _step_rows(self, plan: StepPlan) -> list[dict[str, Any]]:
        """The trace's rows of a step, read while its requests still hold their slots."""
        slot_req = self.scheduler.slot_req
        return [
            {"id": slot_req[s].id, "tokens": n, "cached_tokens": max(slot_req[s].cached_tokens, 0)}  # type: ignore[union-attr]
            for s, n in zip(plan.slots.tolist(), plan.num_sched.tolist(), strict=True)
        ]

    @staticmethod
    def _record_fields(plan: StepPlan, rows: list[Any]) -> tuple[Any, ...]:
        """A step's trace record after its start and duration (`_emit_record`'s order)."""
        return (
            plan.path,
            plan.num_prefill_tokens,
            plan.num_decode_tokens,
            plan.num_running,
            plan.num_waiting,
            plan.preempted,
            rows,
        )

    def _window_rows(self, w: WindowPlan) -> list[dict[str, Any]]:
        """The trace's rows of every step of a window, read before it is committed."""
        slot_req = self.scheduler.slot_req
        reqs = [slot_req[s] for s in w.slots.tolist()]
        return [{"id": r.id, "tokens": w.q, "cached_tokens": max(r.cached_tokens, 0)} for r in reqs]  # type: ignore[union-attr]

    def _observe_window(
        self, w: WindowPlan, rows: list[dict[str, Any]], starts: list[float], ends: list[float]
    ) -> None:
        for start, end in zip(starts, ends, strict=True):
            self._emit_record(
                start,
                end - start,
                w.path,
                0,
                w.q * len(rows),
                w.num_running,
                w.num_waiting,
                [],
                rows,
            )

    def _emit_record(
        self,
        t0: float,
        duration: float,
        path: str,
        prefill: int,
        decode: int,
        running: int,
        waiting: int,
        preempted: list[str],
        rows: list[dict[str, Any]],
    ) -> None:
        assert self.step_observer is not None
        self.step_observer(
            {
                "step": self._step_no,
                "t_start_s": t0,
                "duration_s": duration,
                "path": path,
                "num_prefill_tokens": prefill,
                "num_decode_tokens": decode,
                "num_running": running,
                "num_waiting": waiting,
                "preempted": list(preempted),
                "requests": rows,
            }
        )
        self._step_no += 1


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

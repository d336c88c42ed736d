"""The Engine: a step loop over a Scheduler and an executor, on asyncio's clock.

Time is the running loop's time. On the virtual clock (agentab.clock.run_virtual) a step's
`asyncio.sleep` jumps straight to its end; served over HTTP it is real time. Token events carry
the loop time of the step that produced them and reach the client no earlier than that; a
request's last event (and its FinalUsage) is delivered at exactly its time, so whatever the
client does next (the replay's next turn) happens at the right moment.

The executor is either priced (the simulator: the loop sleeps for each step's price) or
measured (a real model: the step runs in a worker thread, so the loop keeps serving HTTP while
the device works, and the step takes as long as it takes); see agentab.engine.executor.

Speed on the virtual clock: while nothing changes but decode progress, the engine prices a whole
window of steps at once (Scheduler.plan_window) and sleeps to the window's end, or until a new
request or an abort arrives. Then it commits only the steps that had started before the arrival
(the step in flight completes, as on a GPU) and resumes step by step, so the result is the same
as stepping one at a time.

Async scheduling (a profile's `[engine] async_scheduling`, as the engine it models runs on a GPU):
the priced loop then keeps one step ahead like `_loop_measured`: step k+1 is scheduled and
applied while step k runs, so a request that arrives during step k joins step k+2 at the
earliest; each step's tokens, finishes and trace record are handed out when it was priced to
end, and steps run back to back. Fast-forward windows follow the same rule (`_run_window_ahead`).
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
from agentab.engine.outputs import StepPlan, WindowPlan
from agentab.engine.request import Request
from agentab.engine.scheduler import Scheduler
from agentab.engine.types import EngineRequest, FinalUsage, TokenEvent
from agentab.errors import AgentabError

StepObserver = Callable[[dict[str, Any]], None]


class EngineFailed(AgentabError):
    """The engine's step loop died (a bug, or a device error): no request can be served."""


class _Channel:
    """A request's event stream: a deque plus one waiter (cheaper than asyncio.Queue)."""

    __slots__ = ("done", "items", "waiter")

    def __init__(self) -> None:
        self.items: deque[TokenEvent | FinalUsage] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.done = False

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class Timeline:
    """A request's response collected as arrays (`Engine.submit`), for in-process clients.

    Why: a client in the same process that only needs when each chunk was emitted (the replay's
    records) need not receive one Python event per step. On a priced executor the scheduler's
    EmissionLog holds every step's time and each slot's token count, and the request's chunks
    are read off it as arrays when it leaves its slot; a measured executor's loop appends each
    step here (`add_step`). `finished` resolves with the FinalUsage at the request's end, so
    the client runs once per request instead of once per step. The times are the same as
    `generate`'s events'.
    """

    __slots__ = ("_open", "_parts", "_req", "_sched", "done", "finished")

    def __init__(
        self,
        finished: asyncio.Future[FinalUsage],
        req: Request | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.finished = finished
        self.done = False
        self._req = req
        self._sched = scheduler
        self._parts: list[tuple[Any, ...]] = []
        self._open: tuple[list[float], list[int]] | None = None  # the piece single steps extend

    def add_step(self, t: float, n: int) -> None:
        piece = self._open
        if piece is None:
            piece = self._open = ([], [])
            self._parts.append(piece)
        piece[0].append(t)
        piece[1].append(n)

    def chunk_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(loop times as float64, tokens as int32) of every chunk emitted so far, in order."""
        parts = [(np.asarray(t, np.float64), np.asarray(n, np.int32)) for t, n in self._parts]
        req, sched = self._req, self._sched
        if req is not None and sched is not None:
            parts.extend(sched.emitted_parts(req))
        if len(parts) == 1:
            times, counts = parts[0]
        elif not parts:
            return np.zeros(0, np.float64), np.zeros(0, np.int32)
        else:
            times = np.concatenate([p[0] for p in parts])
            counts = np.concatenate([p[1] for p in parts])
        until = sched.log.until if sched is not None and sched.log is not None else None
        if until is not None:  # async scheduling: the step applied ahead has not ended yet
            keep = times <= until
            if not keep.all():
                times, counts = times[keep], counts[keep]
        if counts.dtype != np.int32:
            counts = counts.astype(np.int32)
        return times, counts

    def chunks(self) -> tuple[list[float], list[int]]:
        """(loop times, tokens) of every chunk emitted so far, in order, as lists."""
        times, counts = self.chunk_arrays()
        return times.tolist(), counts.tolist()


@dataclass(slots=True)
class _Applied:
    """A priced step applied to the scheduler before it ends (async scheduling): what is handed
    out when the clock reaches `end`."""

    start: float
    end: float
    finished: list[Request]
    events: list[tuple[_Channel, int, np.ndarray]]  # (stream, tokens, their ids)
    record: tuple[Any, ...] | None  # the trace record's fields after its duration


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
        self._channels: set[_Channel | Timeline] = set()  # open streams (woken on a failure)
        self._streams = 0  # open `generate` streams (steps need per-row work only for these)
        self._wakes = 0  # requests and aborts so far (a wake-up is not lost between two waits)

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
                if type(ch) is Timeline:
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
        close = getattr(self.executor, "close", None)
        if close is not None:  # e.g. the local engine's other tensor-parallel ranks
            close()
        for rid in list(self.scheduler.requests):
            req = self.scheduler.abort(rid)
            if req is not None:
                self._finish(req)

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent | FinalUsage]:
        """Stream `TokenEvent`s, then one `FinalUsage`. Leaving early aborts the request.

        Raises `EngineFailed` if the engine's step loop has died (now or while streaming)."""
        if self._failure is not None:
            self._raise_failure()
        req = self.scheduler.add(
            request.request_id, request.prompt_token_ids, request.max_tokens, request.prefix
        )
        ch = _Channel()
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
            request.request_id, request.prompt_token_ids, request.max_tokens, request.prefix
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
            **self.executor.metrics(),
        }

    def describe(self) -> dict[str, Any]:
        """What a run manifest records about this engine."""
        ahead = (
            bool(getattr(self.executor, "launches_async", False))
            if self.executor.measured
            else self.async_scheduling
        )
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
        loop = asyncio.get_running_loop()
        if self.executor.measured:
            await self._loop_measured(loop)
            return
        virtual = is_virtual(loop)
        sched = self.scheduler
        sched.collect_timelines()
        if self.async_scheduling:
            await self._loop_ahead(loop, virtual)
            return
        # Real clock: while busy, a step starts when the previous one was priced to end, so the
        # host's time between steps (streaming, timer lateness) does not stretch every step;
        # a host later than one step starts afresh instead of compressing the steps after it.
        prev_end, prev_s = None, 0.0
        while True:
            if self._aborts:
                self._apply_aborts()
            if not sched.has_work():
                prev_end = None
                await self._wait(loop, None)
                continue
            t0 = loop.time()
            if prev_end is not None and 0.0 <= t0 - prev_end < prev_s:
                t0 = prev_end
            if virtual and self.fast_forward:
                window = sched.plan_window(self.max_window_steps)
                if window is not None:
                    await self._run_window(loop, window, t0)
                    continue
            plan = sched.schedule()
            if plan.total_tokens == 0:
                await asyncio.sleep(0)  # everything was preempted: the next step re-admits
                continue
            output = self.executor.execute(plan)
            end = t0 + output.duration_s
            if not virtual:
                prev_end, prev_s = end, output.duration_s
            delay = end - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            t = loop.time() if not virtual else max(loop.time(), end)
            if self.step_observer is not None:
                self._observe_step(plan, t0, t, self._step_rows(plan))
            sched.log_times(np.array([t]))
            reqs, counts, finished = sched.update(plan, output)
            if self._streams:
                for req, n in zip(reqs, counts, strict=True):
                    ch = req.sink
                    if type(ch) is _Channel:
                        ch.items.append(TokenEvent(t, n, sched.output_ids(req, n)))
                        ch.wake()
            for req in finished:
                self._finish(req)

    async def _loop_measured(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop for a real model, with async scheduling (as vLLM's): while the device runs
        step k, step k+1 is already scheduled and launched behind it, so the device does not
        wait for the host between steps. Step k is applied (`Scheduler.advance`) before its
        tokens are known, which is exact without speculative decoding (its token counts do not
        depend on the values); its tokens are filled in and streamed when it is collected.
        Launches run in one worker thread; scheduled ahead, collects run in another, so step k's
        tokens go out when it is done, not after the host has launched step k+1."""
        from concurrent.futures import ThreadPoolExecutor

        sched, ex = self.scheduler, self.executor
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="agentab-step")
        worker = self._worker
        if self._collector is None and ex.launches_async:  # collect k while k+1 is launched
            self._collector = ThreadPoolExecutor(1, thread_name_prefix="agentab-collect")
        collector = self._collector or worker
        inflight: deque[tuple[StepPlan, Any, Any, float, list[Any]]] = deque()
        # a device that runs launched work by itself gets the next step queued behind the
        # current one; a CPU computes inside launch, so running ahead would only delay tokens
        depth = 2 if ex.launches_async else 1
        while True:
            if self._aborts:
                self._apply_aborts()
            if sched.has_work() and len(inflight) < depth:
                t0 = loop.time()
                plan = sched.schedule()
                if plan.total_tokens:
                    inputs = sched.model_inputs(plan)
                    launched = loop.run_in_executor(worker, ex.launch, plan, inputs)
                    rows = self._step_rows(plan) if self.step_observer is not None else []
                    inflight.append((plan, launched, sched.advance(plan), t0, rows))
                    continue
                if not inflight:
                    await asyncio.sleep(0)  # everything was preempted: the next step re-admits
                    continue
            if inflight:
                plan, launched, adv, t0, rows = inflight.popleft()
                output = await loop.run_in_executor(collector, ex.collect, await launched)
                t = loop.time()
                if self.step_observer is not None:
                    self._observe_step(plan, t0, t, rows)
                sched.fill(adv, output.sampled)
                for req, n, at in zip(adv.reqs, adv.counts, adv.starts, strict=True):
                    ch = req.sink
                    if ch is None or ch.done:  # type: ignore[attr-defined]
                        continue
                    if type(ch) is Timeline:
                        ch.add_step(t, n)
                    else:
                        assert isinstance(ch, _Channel)
                        ch.items.append(TokenEvent(t, n, req.tokens[at : at + n]))
                        ch.wake()
                for req in adv.finished:
                    self._finish(req)
                continue
            await self._wait(loop, None)

    async def _loop_ahead(self, loop: asyncio.AbstractEventLoop, virtual: bool) -> None:
        """The priced loop with async scheduling, in `_loop_measured`'s order: while step k
        (`ahead`) runs, step k+1 is scheduled and applied (`Scheduler.update` with the priced
        outcome, which is known at once: the simulator's output ids are fixed at admission);
        then step k is handed out at its end, aborts are applied, and step k+2 is scheduled.
        Step k+1 starts when step k was priced to end (the device never waits for the host)."""
        sched = self.scheduler
        assert sched.log is not None
        sched.log.until = -np.inf  # nothing handed out yet
        ahead: _Applied | None = None
        while True:
            if self._aborts:
                self._apply_aborts()
            if sched.has_work():
                now = loop.time()
                start = now if ahead is None else max(ahead.end, now)
                # a window goes behind a step in flight whose end changes nothing but decode
                # progress (a finish would bring the next turn)
                if virtual and self.fast_forward and ahead is not None and not ahead.finished:
                    window = sched.plan_window(self.max_window_steps)
                    if window is not None:
                        ahead = await self._run_window_ahead(loop, window, ahead)
                        continue
                plan = sched.schedule()
                if plan.total_tokens:
                    step = self._apply_ahead(plan, start)
                    if ahead is not None:
                        await self._hand_out(loop, ahead)
                    ahead = step
                    continue
                if ahead is None:
                    await asyncio.sleep(0)  # everything was preempted: the next step re-admits
                    continue
            if ahead is not None:
                await self._hand_out(loop, ahead)
                ahead = None
                continue
            await self._wait(loop, None)

    def _apply_ahead(self, plan: StepPlan, start: float) -> _Applied:
        """Price a step starting at `start` and apply it now; its tokens wait for its end."""
        sched = self.scheduler
        output = self.executor.execute(plan)
        end = start + output.duration_s
        record = None
        if self.step_observer is not None:
            record = self._record_fields(plan, self._step_rows(plan))
        sched.log_times(np.array([end]))
        reqs, counts, finished = sched.update(plan, output)
        events = []
        if self._streams:
            for req, n in zip(reqs, counts, strict=True):
                ch = req.sink
                if type(ch) is _Channel:
                    events.append((ch, n, sched.output_ids(req, n)))
        return _Applied(start, end, finished, events, record)

    async def _hand_out(self, loop: asyncio.AbstractEventLoop, step: _Applied) -> None:
        """At the step's end (now, if that has passed): its events, trace record, finishes.
        Events carry the time the step was priced to end, as its collected chunks do."""
        delay = step.end - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t = step.end
        log = self.scheduler.log
        assert log is not None
        log.until = t
        if step.record is not None:
            self._emit_record(step.start, t - step.start, *step.record)
        for ch, n, ids in step.events:
            if not ch.done:  # aborted while the step ran
                ch.items.append(TokenEvent(t, n, ids))
                ch.wake()
        for req in step.finished:
            self._finish(req)

    async def _run_window_ahead(
        self, loop: asyncio.AbstractEventLoop, w: WindowPlan, ahead: _Applied
    ) -> _Applied:
        """A window of decode steps behind the step in flight (`ahead`), with async scheduling.

        Window step j+1 is scheduled when step j-1 ends (`ahead` ends as step -1), so a request
        or abort that arrives after that and no later than step j's end is first seen by the
        step after window step j: the window keeps steps 0..j, step j is the new step in flight,
        and the loop resumes at the end of step j-1. With no arrival all n steps are kept and
        the loop resumes when step n-2 ends. Stepping gives the same steps at the same times.
        """
        ends = ahead.end + np.cumsum(self.executor.window_seconds(w))
        n = len(ends)
        scheduled_at = np.concatenate(([ahead.end], ends[:-1]))  # when step j+1 is scheduled
        wakes = self._wakes
        await self._wait(loop, ahead.end)  # the step in flight is handed out at its end
        handed = self._wakes == wakes  # nothing arrived before it ended
        if handed:
            await self._hand_out(loop, ahead)
            if n > 1 and self._wakes == wakes:
                await self._wait(loop, float(scheduled_at[-1]))
        m = min(int(np.searchsorted(scheduled_at, loop.time(), side="left")) + 1, n)
        if not handed:
            await self._hand_out(loop, ahead)
        resume = float(scheduled_at[m - 1])
        delay = resume - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sched = self.scheduler
        rows = self._window_rows(w) if self.step_observer is not None else []
        sched.log_times(ends[:m])
        reqs, finished = sched.commit_window(w, m)
        times = ends[:m].tolist()
        starts = [ahead.end, *times[:-1]]
        if self.step_observer is not None:
            self._observe_window(w, rows, starts[: m - 1], times[: m - 1])
        sched.log.until = times[m - 2] if m > 1 else ahead.end  # type: ignore[union-attr]
        last: list[tuple[_Channel, int, np.ndarray]] = []
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
            record = (w.path, 0, w.q * len(rows), w.num_running, w.num_waiting, [], rows)
        return _Applied(starts[-1], times[-1], finished, last, record)

    async def _run_window(self, loop: asyncio.AbstractEventLoop, w: WindowPlan, t0: float) -> None:
        ends = t0 + np.cumsum(self.executor.window_seconds(w))
        await self._wait(loop, float(ends[-1]))
        now = loop.time()
        # the step in flight at `now` completes before anything new is scheduled (as on a GPU)
        m = min(int(np.searchsorted(ends, now, side="left")) + 1, len(ends))
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
        reqs, finished = sched.commit_window(w, m)
        if self._streams:
            for ch, events in self._window_events(w, m, step_ends.tolist(), reqs):
                ch.items.extend(events)
                ch.wake()
        for req in finished:
            self._finish(req)

    def _window_events(
        self, w: WindowPlan, m: int, times: list[float], reqs: list[Request]
    ) -> list[tuple[_Channel, list[TokenEvent]]]:
        """A committed window's token events for the requests streamed through `generate`."""
        output_ids = self.scheduler.output_ids
        # without drafts every row emits one token per step of a window
        cols = [[1] * m] * len(reqs) if w.q == 1 else w.emitted[:m].T.tolist()
        out = []
        for req, col in zip(reqs, cols, strict=True):
            ch = req.sink
            if type(ch) is not _Channel:
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

    def _finish(self, req: Request, undelivered: int = 0) -> None:
        """End a request's stream; `undelivered`: tokens of steps applied ahead that it will
        not get (it was aborted while they ran)."""
        ch = req.sink
        if ch is None:
            return
        usage = FinalUsage(
            prompt_tokens=req.prompt_len,
            completion_tokens=req.num_output - undelivered,
            cached_tokens=max(req.cached_tokens, 0),
            finish_reason=req.finish_reason or "length",
        )
        if type(ch) is Timeline:
            ch.done = True
            self._channels.discard(ch)
            if not ch.finished.done():
                ch.finished.set_result(usage)
            return
        assert isinstance(ch, _Channel)
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

    def _observe_step(self, plan: StepPlan, t0: float, t: float, rows: list[Any]) -> None:
        self._emit_record(t0, t - t0, *self._record_fields(plan, rows))

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

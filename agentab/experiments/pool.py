"""Independent simulated runs spread over local processes.

Running a sweep's runs in a pool of processes (one simulation per core; the simulator is
single-threaded Python) gives the same run dirs, only sooner. Real engines are not spread:
their arms share the GPUs and must run one at a time, interleaved.

Each worker loads the experiment and its workload once, then runs the tasks it is given, one at
a time, over a pipe of its own. A run that raises comes back as a `RunFailed` (the worker lives
on). A worker that dies (killed, out of memory, a crash in native code) fails the one run it
was executing, and only that one: its place is taken by a fresh worker and the runs queued
behind it go on, so `agentab.experiments.fanout` retries the run that was lost without
charging an attempt to any other. (`concurrent.futures.ProcessPoolExecutor` cannot do this: a
dying worker breaks the whole pool and fails every run submitted to it.)
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any

from agentab.errors import error_line
from agentab.experiments.experiment import Experiment
from agentab.experiments.tasks import (
    RunDone,
    RunFailed,
    RunTask,
    execute,
    placement,
)


def default_workers(experiment: Experiment) -> int:
    """The cores this process may use, for the simulator; 1 for engines that share GPUs."""
    if experiment.engine_kind != "simulator":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_EXPERIMENT: Experiment | None = None
_WORKLOAD: Any = None


def _init(experiment_path: Path) -> None:
    """Worker start: the experiment and its workload, once per process."""
    global _EXPERIMENT, _WORKLOAD
    from agentab.experiments.ab import load_workload
    from agentab.experiments.experiment import load_experiment

    _EXPERIMENT = load_experiment(experiment_path)
    _WORKLOAD = load_workload(_EXPERIMENT)


def _execute_in_worker(task: RunTask) -> RunDone | RunFailed:
    assert _EXPERIMENT is not None
    try:
        return execute(_EXPERIMENT, _WORKLOAD, task, where=placement("pool"))
    except Exception as exc:  # reported to the parent, which retries it once
        return RunFailed(task, error_line(exc))


Run = Callable[[Any], Any]


def _worker_main(experiment_path: Path | None, conn: Connection, run: Run) -> None:
    """A worker: load the experiment once (if any), then run each task the parent sends, until
    None. A task that raises comes back as a `RunFailed`."""
    broken = None
    if experiment_path is not None:
        try:
            _init(experiment_path)
        except Exception as exc:  # every run it is given fails with this, named by the parent
            broken = error_line(exc)
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while (task := conn.recv()) is not None:
            if broken is not None:
                conn.send(RunFailed(task, broken))
                continue
            try:
                result = run(task)
            except Exception as exc:
                result = RunFailed(task, error_line(exc))
            conn.send(result)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    handle: int | None = None  # the run it executes, if any
    done: int = 0  # tasks it has answered


class ProcessBackend:
    """`workers` spawned processes, a run at a time each (`agentab.experiments.fanout.Backend`).

    `run` is what a worker does with a task (by default: execute a sweep's run, once the worker
    has loaded `experiment`); any function a spawned process can import will do, with
    `experiment` None for tasks that need none. `max_tasks`: a worker that has answered so
    many is replaced by a fresh one (what its runs leave behind in memory goes with it)."""

    def __init__(
        self,
        experiment: Experiment | None,
        workers: int,
        run: Run = _execute_in_worker,
        *,
        max_tasks: int | None = None,
    ) -> None:
        self.experiment = experiment
        self.max_tasks = max_tasks
        self.slots = workers
        self._run = run
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._workers: list[_Worker] = []
        self._queue: deque[int] = deque()  # handles submitted, not yet given to a worker
        self._tasks: dict[int, Any] = {}
        self._ids = itertools.count()

    def _spawn(self) -> _Worker:
        mine, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(None if self.experiment is None else self.experiment.path, theirs, self._run),
            name="agentab-pool-worker",
        )
        process.start()
        theirs.close()
        worker = _Worker(process, mine)
        self._workers.append(worker)
        return worker

    def _dispatch(self) -> None:
        """Give queued runs to idle workers, starting workers up to `slots`."""
        while self._queue:
            idle = next((w for w in self._workers if w.handle is None), None)
            if idle is None:
                if len(self._workers) >= self.slots:
                    return
                idle = self._spawn()
            handle = self._queue.popleft()
            idle.handle = handle
            idle.conn.send(self._tasks[handle])

    def submit(self, task: Any) -> Hashable:
        handle = next(self._ids)
        self._tasks[handle] = task
        self._queue.append(handle)
        self._dispatch()
        return handle

    def wait(self, handles: Sequence[Hashable], timeout_s: float) -> list[tuple[Hashable, Any]]:
        busy = [w for w in self._workers if w.handle is not None]
        ready = set(wait_ready([w.conn for w in busy] + [w.process.sentinel for w in busy],
                               timeout_s))  # fmt: skip
        out: list[tuple[Hashable, Any]] = []
        for worker in busy:
            if worker.conn not in ready and worker.process.sentinel not in ready:
                continue
            handle = worker.handle
            assert handle is not None
            task = self._tasks.pop(handle)
            worker.handle = None
            try:
                out.append((handle, worker.conn.recv()))
            except (EOFError, OSError):  # it died executing this run, and only this one
                worker.process.join()
                code = worker.process.exitcode
                out.append((handle, RunFailed(task, f"worker process lost ({_exit(code)})")))
                self._retire(worker, ended=True)
                continue
            worker.done += 1
            if self.max_tasks is not None and worker.done >= self.max_tasks:
                self._retire(worker, ended=False)
        self._dispatch()
        return out

    def _retire(self, worker: _Worker, *, ended: bool) -> None:
        if not ended:
            with contextlib.suppress(OSError):
                worker.conn.send(None)
            worker.process.join()
        worker.conn.close()
        self._workers.remove(worker)

    def close(self, *, abort: bool) -> None:
        workers, self._workers = self._workers, []
        self._queue.clear()
        self._tasks.clear()
        for worker in workers:
            if abort:
                # stop the workers' runs here, so a Ctrl-C does not wait for every simulation
                # in flight to finish
                worker.process.terminate()
            else:
                with contextlib.suppress(OSError):
                    worker.conn.send(None)
        for worker in workers:
            worker.process.join()
            worker.conn.close()


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

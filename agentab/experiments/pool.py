"""Independent simulated runs spread over local processes.

Running a sweep's runs in a pool of processes (one simulation per core; the simulator is
single-threaded Python) gives the same run dirs, only sooner. Real engines are not spread:
their arms share the GPUs and must run one at a time, interleaved.

Each worker loads the experiment and its workload once (`_init`), then runs the tasks it is
given. A run that raises comes back as a `RunFailed` (the worker lives on); a worker that dies
(killed, out of memory) breaks the pool, and every run it held comes back failed and the next
submission starts a fresh pool, so `agentab.experiments.fanout` can retry them.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
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


class ProcessBackend:
    """A pool of `workers` spawned processes (`agentab.experiments.fanout.Backend`)."""

    def __init__(self, experiment: Experiment, workers: int) -> None:
        self.experiment = experiment
        self.slots = workers
        self._executor: ProcessPoolExecutor | None = None
        self._tasks: dict[Future[RunDone | RunFailed], RunTask] = {}

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None or getattr(self._executor, "_broken", False):
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = ProcessPoolExecutor(
                self.slots,
                mp_context=multiprocessing.get_context("spawn"),  # no fork of a threaded process
                initializer=_init,
                initargs=(self.experiment.path,),
            )
        return self._executor

    def submit(self, task: RunTask) -> Hashable:
        future = self._pool().submit(_execute_in_worker, task)
        self._tasks[future] = task
        return future

    def wait(
        self, handles: Sequence[Hashable], timeout_s: float
    ) -> list[tuple[Hashable, RunDone | RunFailed]]:
        futures = [h for h in handles if isinstance(h, Future)]
        done, _ = wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
        out: list[tuple[Hashable, RunDone | RunFailed]] = []
        for future in done:
            task = self._tasks.pop(future)
            exc = future.exception()
            if exc is not None:  # the worker died (BrokenProcessPool) or could not start
                out.append((future, RunFailed(task, f"worker process lost: {error_line(exc)}")))
            else:
                out.append((future, future.result()))
        return out

    def close(self, *, abort: bool) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        if abort:
            # ProcessPoolExecutor has no terminate (before Python 3.14): stop the workers'
            # runs here, so a Ctrl-C does not wait for every simulation in flight to finish.
            for process in list(getattr(executor, "_processes", {}).values()):
                process.terminate()
        executor.shutdown(wait=True, cancel_futures=True)

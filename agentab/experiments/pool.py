"""Independent simulated runs spread over local processes.

A sweep on the simulator is dozens of runs that share nothing but the workload: each is a
deterministic function of the experiment, its point, arm and repeat, and writes its own run dir.
Running them in a pool of processes (one simulation per core; the simulator is single-threaded
Python) gives the same run dirs, only sooner. Real engines are not spread: their arms share the
GPUs and must run one at a time, interleaved.

Each worker loads the experiment and its workload once (`_init`), then runs the tasks it is
given; the parent logs each run as it ends. A worker that raises (a run that failed) is
reported, and the runs already done stay done: the same command resumes the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentab.experiments.experiment import Experiment


@dataclass(frozen=True)
class RunTask:
    """One run to do: where it goes and which (point, repeat, arm) it is."""

    path: Path
    arm: str
    repeat: int
    point: int | float | None
    prompt_salt: str


@dataclass(frozen=True)
class RunDone:
    """What the parent logs when a run ends."""

    task: RunTask
    p90_interactivity: float | None
    seconds: float


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


def execute(
    experiment: Experiment, workload: Any, task: RunTask, *, progress: bool = False
) -> RunDone:
    """Run one task, write its summary; the same in a worker and in the parent."""
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run, write_summary
    from agentab.experiments.ab import run_arm
    from agentab.experiments.experiment_dir import clear_unfinished

    arm = next(a for a in experiment.arms if a.name == task.arm)
    clear_unfinished(task.path)
    t0 = time.monotonic()
    run_arm(
        experiment,
        arm,
        task.repeat,
        workload,
        task.path,
        progress=progress,
        point=task.point,
        prompt_salt=task.prompt_salt,
    )
    summary = summarize_run(load_run(task.path))
    write_summary(summary)
    return RunDone(task, summary.values["p90_interactivity_tok_s"], time.monotonic() - t0)


def _execute_in_worker(task: RunTask) -> RunDone:
    assert _EXPERIMENT is not None
    return execute(_EXPERIMENT, _WORKLOAD, task)


def run_in_pool(
    experiment: Experiment,
    tasks: Sequence[RunTask],
    workers: int,
    on_done: Callable[[RunDone], None],
) -> None:
    """Run `tasks` on `workers` processes, calling `on_done` in this process as each ends.

    The first failure, or Ctrl-C, stops the pool at once (its workers are terminated, their
    runs left unfinished for a resume to redo) and is raised here; completed runs are kept.
    """
    context = multiprocessing.get_context("spawn")  # no fork of a process holding threads
    pool = context.Pool(min(workers, len(tasks)), initializer=_init, initargs=(experiment.path,))
    try:
        for done in pool.imap_unordered(_execute_in_worker, tasks):
            on_done(done)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()

"""One simulated run as a task: what it is, how it ends, and the code that does it.

A sweep on the simulator is dozens of runs that share nothing but the workload: each is a
deterministic function of the experiment, its point, arm and repeat, and writes its own run dir.
That makes each one a task any process can do (this one, a pool worker, a Ray worker on another
host) with the same result; only where it ran differs, and the manifest says where
(`placement`).
"""

from __future__ import annotations

import socket
import time
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


@dataclass(frozen=True)
class RunFailed:
    """A run that raised (or whose worker died): which, and the error in one line."""

    task: RunTask
    error: str


def placement(runner: str, node: str | None = None) -> dict[str, Any]:
    """The manifest's `placement`: which kind of worker ran the run (`process`: the command's
    own; `pool`: a local worker process; `ray`: a Ray worker), on which host, on which Ray node
    (None off Ray). Every run of `agentab ab` records the same three keys."""
    return {"runner": runner, "host": socket.gethostname(), "node": node}


def execute(
    experiment: Experiment,
    workload: Any,
    task: RunTask,
    *,
    progress: bool = False,
    where: dict[str, Any] | None = None,
    summary: bool = True,
) -> RunDone:
    """Run one task into `task.path`; with `summary`, write its summary.json too (a Ray worker
    leaves that to the process that receives the run dir, where its path is the final one)."""
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
        placement=where if where is not None else placement("process"),
    )
    p90 = None
    if summary:
        written = summarize_run(load_run(task.path))
        write_summary(written)
        p90 = written.values["p90_interactivity_tok_s"]
    return RunDone(task, p90, time.monotonic() - t0)


def summarize_received(task: RunTask, seconds: float) -> RunDone:
    """The summary of a run dir written here from a remote worker's files."""
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run, write_summary

    written = summarize_run(load_run(task.path))
    write_summary(written)
    return RunDone(task, written.values["p90_interactivity_tok_s"], seconds)

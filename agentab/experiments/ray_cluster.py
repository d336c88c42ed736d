"""Simulated runs as Ray tasks: the runs of `--workers`, on a Ray cluster (`--ray ADDRESS`).

Why Ray and not a protocol of our own: scheduling, worker lifecycles, node failures and object
transfer across hosts are what Ray already does; a sweep only needs "run this function there".

Why each run comes back as files: the nodes of a cluster share no disk with this one. A Ray
worker runs its task into a temporary dir on its own node and returns that dir's files; this
process writes them into the experiment dir and summarizes the run there, so the experiment
dir holds exactly what a local run writes (the summary's `run_dir` is the final path), plus
the node each run executed on (`placement` in the manifest). The experiment and its workload
travel once, through Ray's object store, not once per run.

`ADDRESS`: `local` starts a cluster inside this process (`ray.init(num_cpus=...)`, for a
laptop or CI), `auto` joins the cluster this host belongs to (`ray start --head` ran here),
`HOST:PORT` a head node's GCS, `ray://HOST:10001` a cluster through Ray Client.
"""

from __future__ import annotations

import tempfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
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
    summarize_received,
)
from agentab.ray_connect import write_files


@dataclass(frozen=True)
class Shipped:
    """A run done on a Ray worker: its run dir's files (relative path -> bytes), its time."""

    task: RunTask
    files: dict[str, bytes]
    seconds: float


def _run_remote(experiment: Experiment, workload: Any, task: RunTask) -> Shipped | RunFailed:
    """The Ray task: run into a temporary dir on this node, return its files."""
    import ray

    where = placement("ray", ray.get_runtime_context().get_node_id())
    with tempfile.TemporaryDirectory(prefix="agentab-run-") as tmp:
        local = Path(tmp) / task.path.name  # the arm's run dir keeps its name
        try:
            done = execute(
                experiment, workload, replace(task, path=local), where=where, summary=False
            )
        except Exception as exc:  # reported to the driver, which retries it once
            return RunFailed(task, f"on {where['host']}: {error_line(exc)}")
        paths = sorted(p for p in local.rglob("*") if p.is_file())
        files = {str(p.relative_to(local)): p.read_bytes() for p in paths}
    return Shipped(task, files, done.seconds)


class RayBackend:
    """Runs as Ray tasks of one CPU each (`agentab.experiments.fanout.Backend`)."""

    def __init__(self, experiment: Experiment, workload: Any, slots: int) -> None:
        import ray

        self.slots = slots
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_run_remote)
        self._experiment = ray.put(experiment)
        self._workload = ray.put(workload)
        self._tasks: dict[Hashable, RunTask] = {}

    def submit(self, task: RunTask) -> Hashable:
        ref = self._remote.remote(self._experiment, self._workload, task)
        self._tasks[ref] = task
        return ref

    def wait(
        self, handles: Sequence[Hashable], timeout_s: float
    ) -> list[tuple[Hashable, RunDone | RunFailed]]:
        import ray

        ready, _ = ray.wait(list(handles), num_returns=1, timeout=timeout_s)
        out: list[tuple[Hashable, RunDone | RunFailed]] = []
        for ref in ready:
            task = self._tasks.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as exc:  # the worker or its node died (ray.exceptions.RayError)
                out.append((ref, RunFailed(task, f"Ray task lost: {error_line(exc)}")))
                continue
            if isinstance(result, RunFailed):
                out.append((ref, result))
                continue
            try:
                write_files(task.path, result.files)
                out.append((ref, summarize_received(task, result.seconds)))
            except Exception as exc:  # this side's disk: a failure of the run like any other
                out.append((ref, RunFailed(task, f"writing {task.path}: {error_line(exc)}")))
        return out

    def close(self, *, abort: bool) -> None:
        _close(self._tasks, abort)


class RayCalls:
    """Any task as a Ray task of one CPU, `run(task)` on some node of the cluster, its result
    returned as `run` returned it (`agentab.experiments.fanout.Backend`). `run` and the tasks
    travel by pickle (cloudpickle: a script's own functions too); a task that raises, or whose
    worker or node dies, comes back as a `RunFailed`."""

    def __init__(self, run: Any, slots: int) -> None:
        import ray

        self.slots = slots
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run)
        self._tasks: dict[Hashable, Any] = {}

    def submit(self, task: Any) -> Hashable:
        ref = self._remote.remote(task)
        self._tasks[ref] = task
        return ref

    def wait(self, handles: Sequence[Hashable], timeout_s: float) -> list[tuple[Hashable, Any]]:
        import ray

        ready, _ = ray.wait(list(handles), num_returns=1, timeout=timeout_s)
        out: list[tuple[Hashable, Any]] = []
        for ref in ready:
            task = self._tasks.pop(ref)
            try:
                out.append((ref, ray.get(ref)))
            except Exception as exc:  # raised in the task (RayTaskError), or its worker died
                out.append((ref, RunFailed(task, f"Ray task failed: {error_line(exc)}")))
        return out

    def close(self, *, abort: bool) -> None:
        _close(self._tasks, abort)


def _close(tasks: dict[Hashable, Any], abort: bool) -> None:
    """End a backend's use of the cluster: cancel its tasks still running when aborting, then
    disconnect (`ray.shutdown`)."""
    import ray

    if abort:
        for ref in list(tasks):
            ray.cancel(ref, force=True)
    tasks.clear()
    ray.shutdown()

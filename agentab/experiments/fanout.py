"""Independent runs fanned out to a backend (local processes or a Ray cluster), watched.

Why one loop for every backend: what the user sees and what happens to a failure must not
depend on where the runs execute. The loop submits every run, prints a progress line (runs
done / running / failed, elapsed, ETA) as each ends and every `interval_s` while none does,
retries a failed run once (a transient failure such as a killed worker or a full disk on one
node costs one retry, not the sweep), and reports a run that fails twice by name and error at
the end, after every other run has finished; nothing is dropped silently. Runs already done
stay done, so the same command runs the failed ones again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentab.errors import AgentabError
from agentab.experiments.tasks import RunDone, RunFailed, RunTask

ATTEMPTS = 2
"""A run is tried at most this often: once, and once more after a failure."""

Outcome = RunDone | RunFailed | Any
"""What a task gave: a `RunFailed` when it failed, else its result (a `RunDone` for a run)."""


class Backend(Protocol):
    """Where runs execute: submit one, wait for some to end, close."""

    slots: int
    """How many runs execute at a time (the progress line's `running`)."""

    def submit(self, task: Any) -> Hashable:
        """Start `task` (or queue it); return a handle that `wait` reports it under."""
        ...

    def wait(self, handles: Sequence[Hashable], timeout_s: float) -> list[tuple[Hashable, Outcome]]:
        """The runs among `handles` that ended within `timeout_s` (possibly none)."""
        ...

    def close(self, *, abort: bool) -> None:
        """Release the workers; `abort`: stop the runs still executing."""
        ...


def task_label(task: RunTask, variable: str | None) -> str:
    """`concurrency 8 fast repeat 2`: a run as the logs name it."""
    where = f"{variable} {task.point:g} " if variable is not None and task.point is not None else ""
    return f"{where}{task.arm} repeat {task.repeat + 1}"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class Progress:
    """Counts of a fan-out, and the line that states them."""

    total: int
    slots: int
    started: float
    done: int = 0
    failed: int = 0

    def line(self, now: float) -> str:
        left = self.total - self.done - self.failed
        elapsed = now - self.started
        eta = "–" if not self.done else _duration(elapsed / self.done * left)
        return (
            f"{self.done}/{self.total} done, {min(self.slots, left)} running, "
            f"{self.failed} failed, {_duration(elapsed)} elapsed, ETA {eta}"
        )


def fan_out(
    backend: Backend,
    tasks: Sequence[Any],
    on_done: Callable[[Any, str], None],
    *,
    log: Callable[[str], None],
    variable: str | None,
    interval_s: float,
    label: Callable[[Any], str] | None = None,
    command: str = "agentab ab",
    again: str = "the same command runs the failed ones again",
) -> None:
    """Run `tasks` on `backend`; `on_done(result, progress_line)` in this process as each ends.

    A failed run is submitted again once; a run that fails twice is reported when the others
    are over, as an AgentabError naming every such run. Ctrl-C (or any error here) aborts the
    backend's runs and is raised.

    The tasks are a sweep's `RunTask`s, named by `task_label`, unless `label` names them (any
    other picklable task: `benchmarks/bench_verdicts.py` fans out its pairs); `command` starts
    the progress lines, `again` ends the failure's line (how to run the failed tasks again).
    """

    def name_of(task: Any) -> str:
        return label(task) if label is not None else task_label(task, variable)

    progress = Progress(len(tasks), backend.slots, time.monotonic())
    pending: dict[Hashable, tuple[Any, int]] = {}
    failures: list[RunFailed] = []
    try:
        for task in tasks:
            pending[backend.submit(task)] = (task, 1)
        last = time.monotonic()
        while pending:
            ended = backend.wait(list(pending), interval_s)
            for handle, outcome in ended:
                task, attempt = pending.pop(handle)
                name = name_of(task)
                if not isinstance(outcome, RunFailed):
                    progress.done += 1
                    on_done(outcome, progress.line(time.monotonic()))
                elif attempt < ATTEMPTS:
                    log(f"  {name}: failed ({outcome.error}); retrying it once")
                    pending[backend.submit(task)] = (task, attempt + 1)
                else:
                    progress.failed += 1
                    failures.append(outcome)
                    log(
                        f"  {name}: failed again ({outcome.error}); "
                        f"{progress.line(time.monotonic())}"
                    )
            now = time.monotonic()
            if ended:
                last = now
            elif now - last >= interval_s:
                log(f"{command}: {progress.line(now)}")
                last = now
    except BaseException:
        backend.close(abort=True)
        raise
    backend.close(abort=False)
    if failures:
        first = failures[0]
        raise AgentabError(
            f"{len(failures)} of {len(tasks)} runs failed twice (each was retried once), first "
            f"{name_of(first.task)}: {first.error}; the {progress.done} runs that completed are "
            f"kept, and {again}"
        )

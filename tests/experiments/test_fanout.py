"""Fanned-out runs: a failed run is retried once, then reported by name with the others done;
the progress line's counts and ETA. Real runs on the simulator, on a real process pool and a
real local Ray cluster; the failures are real too (a file stands where a run dir must go)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from agentab.errors import AgentabError
from agentab.experiments.ab import load_workload
from agentab.experiments.experiment import Experiment, load_experiment
from agentab.experiments.experiment_dir import is_complete
from agentab.experiments.fanout import Backend, Progress, fan_out
from agentab.experiments.pool import ProcessBackend, _execute_in_worker
from agentab.experiments.tasks import RunDone, RunFailed, RunTask
from tests.experiments.test_sweep import SWEEP


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    path = tmp_path_factory.mktemp("fanout") / "sweep.toml"
    path.write_text(SWEEP.replace("concurrency = [8, 2]", "concurrency = [2]"))
    return load_experiment(path)


def three_tasks(out: Path) -> tuple[list[RunTask], Path, Path]:
    """A run that works, one whose dir is blocked until its retry, one blocked for good."""
    out.mkdir()
    flaky, broken = out / "flaky", out / "broken"
    flaky.write_text("a file where a folder must go\n")
    broken.write_text("a file where a folder must go\n")
    tasks = [
        RunTask(out / "fine" / "run-1", "auto", 0, 2, "salt"),
        RunTask(flaky / "run-1", "fast", 0, 2, "salt"),
        RunTask(broken / "run-2", "fast", 1, 2, "salt"),
    ]
    return tasks, flaky, broken


def run_three(backend: Backend, out: Path) -> tuple[list[str], list[RunDone], str]:
    tasks, flaky, _ = three_tasks(out)
    lines: list[str] = []
    done: list[RunDone] = []

    def log(line: str) -> None:
        lines.append(line)
        if "concurrency 2 fast repeat 1: failed (" in line:
            flaky.unlink()  # the retry finds the way clear

    with pytest.raises(AgentabError) as exc:
        fan_out(
            backend,
            tasks,
            lambda d, status: done.append(d),
            log=log,
            variable="concurrency",
            interval_s=60.0,
        )
    return lines, done, str(exc.value)


def check_three(lines: list[str], done: list[RunDone], error: str, out: Path) -> None:
    assert sorted(str(d.task.path.relative_to(out)) for d in done) == ["fine/run-1", "flaky/run-1"]
    assert is_complete(out / "fine" / "run-1") and is_complete(out / "flaky" / "run-1")
    retried = [line for line in lines if line.endswith("; retrying it once")]
    assert sorted(line.split(": failed (")[0] for line in retried) == [
        "  concurrency 2 fast repeat 1",
        "  concurrency 2 fast repeat 2",
    ]
    again = [line for line in lines if ": failed again (" in line]
    assert len(again) == 1 and again[0].startswith("  concurrency 2 fast repeat 2: failed again (")
    assert re.search(
        r"\); [12]/3 done, [01] running, 1 failed, \d+ s elapsed, ETA \d+ s$", again[0]
    )
    assert error.startswith(
        "1 of 3 runs failed twice (each was retried once), first concurrency 2 fast repeat 2: "
    )
    assert error.endswith(
        "; the 2 runs that completed are kept, and the same command runs the failed ones again"
    )
    assert "\n" not in error


@pytest.mark.slow
def test_the_pool_retries_a_failed_run_once_and_reports_one_that_fails_again(
    experiment: Experiment, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    lines, done, error = run_three(ProcessBackend(experiment, 2), out)
    check_three(lines, done, error, out)
    assert "/broken/run-2: cannot create (Not a directory) at dir_lock.py:" in error


def exit_on_repeat_3(task: RunTask) -> RunDone | RunFailed:
    """What a pool worker does with a task in the next test: the third repeat ends the worker
    process on the spot (as a crash in native code or the OOM killer would), the others run."""
    if task.repeat == 2:
        os._exit(3)
    return _execute_in_worker(task)


@pytest.mark.slow
def test_a_dead_pool_worker_costs_an_attempt_to_its_own_run_only(
    experiment: Experiment, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    crash = RunTask(out / "fast" / "run-3", "fast", 2, 2, "salt")
    fine = [RunTask(out / arm / f"run-{k + 1}", arm, k, 2, "salt")
            for arm in ("auto", "fast") for k in (0, 1)]  # fmt: skip
    lines: list[str] = []
    done: list[RunDone] = []
    with pytest.raises(AgentabError) as exc:
        fan_out(
            ProcessBackend(experiment, 2, run=exit_on_repeat_3),
            [crash, *fine],  # first: it dies while the others wait in the queue
            lambda d, status: done.append(d),
            log=lines.append,
            variable="concurrency",
            interval_s=60.0,
        )
    assert sorted(str(d.task.path) for d in done) == sorted(str(t.path) for t in fine)
    assert all(is_complete(t.path) for t in fine)  # each on its first attempt: no other line
    lost = "worker process lost (exit code 3)"
    failed = [line for line in lines if ": failed" in line]
    assert len(failed) == 2
    assert failed[0] == f"  concurrency 2 fast repeat 3: failed ({lost}); retrying it once"
    assert failed[1].startswith(f"  concurrency 2 fast repeat 3: failed again ({lost}); ")
    assert re.search(r"; [34]/5 done, [01] running, 1 failed, ", failed[1])
    assert str(exc.value) == (
        f"1 of 5 runs failed twice (each was retried once), first concurrency 2 fast repeat 3: "
        f"{lost}; the 4 runs that completed are kept, and the same command runs the failed "
        "ones again"
    )


@pytest.mark.ray
@pytest.mark.slow
def test_ray_retries_a_failed_run_once_and_reports_one_that_fails_again(
    experiment: Experiment, tmp_path: Path
) -> None:
    from agentab.experiments.ray_cluster import RayBackend
    from agentab.ray_connect import connect

    cpus = connect("local", 2)  # a cluster inside this process
    assert cpus == 2
    out = tmp_path / "out"
    lines, done, error = run_three(RayBackend(experiment, load_workload(experiment), cpus), out)
    check_three(lines, done, error, out)
    # the runs execute on the Ray worker; the file in the way is met writing them here
    assert f"writing {out / 'broken' / 'run-2'}: " in error


def test_the_progress_line_counts_and_estimates_from_the_runs_done() -> None:
    progress = Progress(total=5, slots=2, started=100.0, done=2, failed=1)
    assert progress.line(130.0) == "2/5 done, 2 running, 1 failed, 30 s elapsed, ETA 30 s"
    progress = Progress(total=40, slots=8, started=0.0, done=0)
    assert progress.line(12.0) == "0/40 done, 8 running, 0 failed, 12 s elapsed, ETA –"
    progress = Progress(total=40, slots=8, started=0.0, done=36)
    assert progress.line(3600.0) == "36/40 done, 4 running, 0 failed, 60.0 min elapsed, ETA 6.7 min"

"""`agentab ab` with a [sweep]: both arms at every load point, resumable, guarded as a whole.

Order: for each point (in the file's order), repeat 1 of A, repeat 1 of B, repeat 2 of A, ...;
repeat k of both arms uses replay seed `seed + k` at every point, so the arms of one point see
the same sessions, lane start points and salts. Every (point, arm, repeat) is its own run dir:

    experiment.toml                       a copy of the file that was run
    prompt_salt                           the sweep's prompt salt (a resume reuses it)
    concurrency-8/<arm>/run-1/ ...        one run dir per (point, arm, repeat)
    concurrency-8/comparison.json         that point's `compare --json` object
    concurrency-8/report.md               that point's A/B report
    sweep.json                            every point's B/A, the frontier, the recommendation
    report.md / report.html               the sweep report (recommendation first, then plots)

Resume: running the same command on the same experiment dir runs only what is missing
(`agentab.experiments.experiment_dir` says when a run counts as done).

The guard sees the whole sweep before any point is analysed: the manifests of every arm-A run
against every arm-B run, with only the swept option masked, so one confounded point (a server
that restarted with other settings, say) refuses the sweep instead of one line of it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agentab.analysis.compare import Comparison, compare_runs
from agentab.analysis.guard import check, manifest_differences
from agentab.analysis.load import Run, load_run
from agentab.analysis.markdown import comparison_markdown
from agentab.analysis.summary import SUMMARY_FILE, write_summary
from agentab.errors import AgentabError
from agentab.experiments.ab import Log, check_before_running, load_workload, stderr_line
from agentab.experiments.experiment import Experiment, Sweep
from agentab.experiments.experiment_dir import (
    check_same_engine_code,
    experiment_salt,
    is_complete,
    is_fresh,
    prepare_dir,
)
from agentab.experiments.tasks import RunDone, RunTask, execute


@dataclass(frozen=True)
class SweepPoint:
    """One load point: its value and the comparison of its two arms."""

    point: int | float
    comparison: Comparison


def run_dir(out_dir: Path, sweep: Sweep, point: int | float, arm: str, repeat: int) -> Path:
    """Where (point, arm, repeat) lives in the experiment dir (repeat counts from 0)."""
    return out_dir / sweep.label(point) / arm / f"run-{repeat + 1}"


def run_sweep(
    experiment: Experiment,
    out_dir: Path,
    *,
    progress: bool = False,
    log: Log = stderr_line,
    workers: int = 1,
    ray_address: str | None = None,
) -> list[SweepPoint]:
    """Run every missing (point, repeat, arm), then guard and compare every point.

    `workers` > 1 (the simulator only): the runs go to that many processes
    (agentab.experiments.pool); `ray_address`: to a Ray cluster as tasks
    (agentab.experiments.ray_cluster; `local` starts one of `workers` CPUs here). Either way
    the run dirs are the ones one process writes, progress is logged, and a failed run is
    retried once (agentab.experiments.fanout)."""
    sweep = experiment.sweep
    if sweep is None:
        raise AgentabError(f"{experiment.path}: no [sweep] table")
    check_before_running(experiment)
    # as in run_experiment: a fresh start refuses a bad workload before the dir exists
    workload = load_workload(experiment) if is_fresh(out_dir) else None
    resumed = prepare_dir(experiment, out_dir)
    started = time.monotonic()
    plan = [
        (point, repeat, arm)
        for point in sweep.points
        for repeat in range(experiment.repeats)
        for arm in experiment.arms
    ]
    todo = [
        item
        for item in plan
        if not is_complete(run_dir(out_dir, sweep, item[0], item[2].name, item[1]))
    ]
    if todo:
        dirs = (run_dir(out_dir, sweep, point, arm.name, k) for point, k, arm in plan)
        check_same_engine_code(experiment, [d for d in dirs if is_complete(d)])
    if todo and workload is None:
        workload = load_workload(experiment)
    what = f"{len(sweep.points)} {sweep.variable} points x {experiment.repeats} repeats x 2 arms"
    if resumed:
        log(
            f"agentab ab: {experiment.name}: resuming {out_dir}: {len(plan) - len(todo)} of "
            f"{len(plan)} runs complete, {len(todo)} to run ({what})"
        )
    else:
        log(f"agentab ab: {experiment.name}: {what} -> {out_dir}")
    salt = experiment_salt(out_dir)
    tasks = [
        RunTask(run_dir(out_dir, sweep, point, arm.name, repeat), arm.name, repeat, point, salt)
        for point, repeat, arm in todo
    ]
    count = iter(range(1, len(tasks) + 1))

    def logged(done: RunDone, status: str = "") -> None:
        t = done.task
        p90 = done.p90_interactivity
        log(
            f"  [{next(count)}/{len(tasks)}] {sweep.variable} {t.point:g} {t.arm} repeat "
            f"{t.repeat + 1}: P90 interactivity {'–' if p90 is None else f'{p90:.1f}'} "
            f"tok/s/user ({done.seconds:.1f} s){'; ' + status if status else ''}"
        )

    spread = ray_address is not None or (workers > 1 and len(tasks) > 1)
    if spread and experiment.engine_kind != "simulator":
        flag = "--ray" if ray_address is not None else f"--workers {workers}"
        raise AgentabError(
            f"{flag}: only simulated runs are spread over processes (the arms of a "
            f"{experiment.engine_kind} engine share its GPUs and run one at a time)"
        )
    if spread and tasks:
        _fan_out(experiment, workload, tasks, workers, ray_address, logged, log)
    else:
        for task in tasks:
            logged(execute(experiment, workload, task, progress=progress))
    points = analyse_sweep(experiment, out_dir)
    log(f"agentab ab: sweep done in {time.monotonic() - started:.1f} s; reports in {out_dir}")
    return points


def _fan_out(
    experiment: Experiment,
    workload: Any,
    tasks: list[RunTask],
    workers: int,
    ray_address: str | None,
    logged: Callable[[RunDone, str], None],
    log: Log,
) -> None:
    """The runs on a local pool of `workers` processes, or as tasks on a Ray cluster."""
    from agentab.experiments.fanout import Backend, fan_out
    from agentab.replay.progress import line_interval_s

    interval = line_interval_s()
    backend: Backend
    if ray_address is not None:
        from agentab.experiments.ray_cluster import RayBackend
        from agentab.ray_connect import connect

        cpus = connect(ray_address, workers)
        backend = RayBackend(experiment, workload, cpus)
        log(f"agentab ab: {len(tasks)} runs as Ray tasks on {ray_address} ({cpus} CPUs)")
    else:
        from agentab.experiments.pool import ProcessBackend

        backend = ProcessBackend(experiment, min(workers, len(tasks)))
        log(f"agentab ab: {len(tasks)} runs on {backend.slots} processes")
    variable = experiment.sweep.variable if experiment.sweep is not None else None
    fan_out(backend, tasks, logged, log=log, variable=variable, interval_s=interval)


def _runs(experiment: Experiment, out_dir: Path) -> dict[int | float, tuple[list[Run], list[Run]]]:
    sweep = experiment.sweep
    assert sweep is not None
    a, b = experiment.arms
    out: dict[int | float, tuple[list[Run], list[Run]]] = {}
    for point in sweep.points:
        sides = []
        for arm in (a, b):
            paths = [run_dir(out_dir, sweep, point, arm.name, k) for k in range(experiment.repeats)]
            for path in paths:
                if not is_complete(path):
                    raise AgentabError(f"{path}: run did not complete; run the sweep again")
            sides.append([load_run(p) for p in paths])
        out[point] = (sides[0], sides[1])
    return out


def _masked(manifest: dict[str, Any], variable: str) -> dict[str, Any]:
    """The manifest without what differs between points by design: the swept option."""
    m = copy.deepcopy(manifest)
    m.pop("sweep_point", None)
    if isinstance(m.get("replay"), dict):
        m["replay"].pop(variable, None)
    return m


def guard_sweep(variable: str, runs: dict[Any, tuple[list[Run], list[Run]]]) -> None:
    """Refuse the whole sweep when any run of A differs from any run of B (or the runs of one
    arm differ among themselves) in anything but the decode backend and the swept option."""
    manifests_a = [_masked(r.manifest, variable) for a, _ in runs.values() for r in a]
    manifests_b = [_masked(r.manifest, variable) for _, b in runs.values() for r in b]
    try:
        check(manifest_differences(manifests_a, manifests_b))
    except AgentabError as exc:
        raise AgentabError(f"refusing the sweep as a whole: {exc}") from None


def analyse_sweep(experiment: Experiment, out_dir: Path) -> list[SweepPoint]:
    """Guard the sweep, compare each point's arms, write each point's comparison and report."""
    sweep = experiment.sweep
    assert sweep is not None
    runs = _runs(experiment, out_dir)
    guard_sweep(sweep.variable, runs)
    a, b = experiment.arms
    points = []
    for point, (runs_a, runs_b) in runs.items():
        comparison = compare_runs(
            runs_a,
            runs_b,
            resamples=experiment.resamples,
            seed=experiment.seed,
            confidence=experiment.confidence,
            equivalence_margin=experiment.equivalence_margin,
        )
        for summary in comparison.runs_a + comparison.runs_b:
            if not (summary.run.path / SUMMARY_FILE).is_file():
                write_summary(summary)
        comparison.extra["sweep_point"] = {sweep.variable: point}
        folder = out_dir / sweep.label(point)
        (folder / "comparison.json").write_bytes(
            orjson.dumps(comparison.to_json(), option=orjson.OPT_INDENT_2)
        )
        title = f"{experiment.name} at {sweep.variable} {point:g}: {a.name} (A) vs {b.name} (B)"
        (folder / "report.md").write_text(
            comparison_markdown(comparison, title=title), encoding="utf-8"
        )
        points.append(SweepPoint(point, comparison))
    return sorted(points, key=lambda p: p.point)

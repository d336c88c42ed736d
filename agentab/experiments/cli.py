"""`agentab ab`: run an experiment file (an A/B, or a sweep of A/Bs) and print its report."""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.command()
@click.argument("experiment_file", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Experiment dir (default: runs/NAME-YYYYmmdd-HHMMSS; a sweep: runs/NAME, so that the "
    "same command resumes it). A dir of the same experiment is resumed: only its missing runs "
    "are run.",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Each run's progress on stderr: a live bar in a terminal, else a line every "
    "AGENTAB_PROGRESS_INTERVAL_S seconds (default 10) and one at its end.",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Run at most N of the missing runs, then stop without a report; the same command on "
    "the same -o dir continues (for A/Bs longer than one sitting on a shared machine).",
)
@click.option(
    "--fail-if-worse",
    is_flag=True,
    help="Exit 1 when B's P90 interactivity is significantly worse (at any sweep point).",
)
def ab(
    experiment_file: Path,
    out: Path | None,
    progress: bool,
    max_runs: int | None,
    fail_if_worse: bool,
) -> None:
    """Run an A/B experiment (two arms, interleaved repeats) and print its report.

    Writes every run dir, comparison.json, report.md and report.html into the experiment dir.
    Running the same command on the same -o dir completes only the runs that are missing. With
    a [sweep] table, both arms run at every load point, and the report leads with a
    recommendation.
    """
    from agentab.experiments.experiment import load_experiment

    experiment = load_experiment(experiment_file)
    if experiment.sweep is not None:
        if max_runs is not None:
            raise click.UsageError("--max-runs applies to an A/B without a [sweep] table")
        _ab_sweep(experiment, out, progress, fail_if_worse)
        return
    from agentab.analysis.compare import WORSE
    from agentab.experiments.ab import run_experiment

    if out is None:
        out = Path("runs") / f"{experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_experiment(experiment, out, progress=progress, max_runs=max_runs)
    if result is None:
        return
    comparison, markdown = result
    click.echo(markdown, nl=False)
    if fail_if_worse and comparison.metrics["p90_interactivity_tok_s"].verdict == WORSE:
        click.echo(
            f"agentab: {comparison.arm_b} is significantly worse in P90 interactivity "
            "(--fail-if-worse)",
            err=True,
        )
        raise SystemExit(1)


def _ab_sweep(experiment, out: Path | None, progress: bool, fail_if_worse: bool) -> None:
    from agentab.experiments.sweep import run_sweep
    from agentab.experiments.sweep_report import write_sweep_reports

    out = out if out is not None else Path("runs") / experiment.name
    points = run_sweep(experiment, out, progress=progress)
    data, markdown = write_sweep_reports(experiment, points, out)
    click.echo(markdown, nl=False)
    worse = data["recommendation"]["worse_points"]
    if fail_if_worse and worse:
        click.echo(
            f"agentab: {experiment.arms[1].name} is significantly worse in P90 interactivity at "
            f"{experiment.sweep.variable} {', '.join(f'{p:g}' for p in worse)} (--fail-if-worse)",
            err=True,
        )
        raise SystemExit(1)

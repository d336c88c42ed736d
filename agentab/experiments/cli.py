"""`agentab ab`: run an experiment file (an A/B, or a sweep of A/Bs) and print its report."""

from __future__ import annotations

import time
from pathlib import Path

import click

from agentab.outputs import OutputPath, output_help


@click.command()
@click.argument("experiment_file", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    type=OutputPath("dir"),
    default=None,
    help=output_help(
        "Experiment dir (default: runs/NAME-YYYYmmdd-HHMMSS; a sweep: runs/NAME, so that the "
        "same command resumes it). A dir of the same experiment is resumed: only its missing "
        "runs are run; a dir another `agentab ab` is running in is refused."
    ),
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
@click.option(
    "--until-decided",
    is_flag=True,
    help="Run repeat blocks (one run per arm each, ABBA order) until the headline is decided "
    "(better, worse or equivalent) by an always-valid interval, a confidence sequence that "
    "keeps its error rate however early it stops; the report says after how many blocks.",
)
@click.option(
    "--max-repeats",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="With --until-decided: stop after N blocks undecided (default 3 x the file's repeats).",
)
@click.option(
    "--block-seconds",
    type=float,
    default=None,
    metavar="S",
    help="With --until-decided: the profiling window of each block's run, per arm, in seconds "
    "(a block is one run of each arm, replaying one plan). The sequence does not know the "
    "blocks' variance and gives no verdict before three blocks, so it pays in blocks: shorter "
    "blocks decide on less traffic (blocks of a twelfth of a fixed-design window decided a 10% "
    "change in a median of 3-4 blocks in bench_verdicts.py). At most the file's [replay] "
    "duration_s, which is the default.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="A [sweep] on the simulator: run N simulations at a time, one per process (default: "
    "the cores this process may use). The run dirs are those one process writes. Real engines "
    "always run one run at a time (their arms share the GPUs).",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="A [sweep] on the simulator: run its runs as tasks on a Ray cluster (the ray extra): "
    "`local` starts one in this process with --workers CPUs, `auto` joins the cluster of this "
    "host, HOST:PORT a head node, ray://HOST:10001 a cluster through Ray Client. Each run's "
    "files come back to the experiment dir, which holds what a local run writes plus the node "
    "each run executed on (manifest `placement`).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the file and print the runs it calls for, without running them; with -o naming "
    "a dir that holds at least two completed repeats (a pilot, or earlier runs), also the "
    "repeats and windows needed to detect --effect (as `agentab plan` prints them).",
)
@click.option(
    "--effect",
    type=click.FloatRange(min=0.001, max=10.0),
    default=0.05,
    show_default=True,
    help="With --dry-run: the change of P90 interactivity to plan for (0.05 = 5%).",
)
def ab(
    experiment_file: Path,
    out: Path | None,
    progress: bool,
    max_runs: int | None,
    fail_if_worse: bool,
    until_decided: bool,
    max_repeats: int | None,
    block_seconds: float | None,
    workers: int | None,
    ray_address: str | None,
    dry_run: bool,
    effect: float,
) -> None:
    """Run an A/B experiment (two arms, interleaved repeats) and print its report.

    Writes every run dir, comparison.json, report.md and report.html into the experiment dir.
    Running the same command on the same -o dir completes only the runs that are missing. With
    a [sweep] table, both arms run at every load point, and the report leads with a
    recommendation.
    """
    from agentab.experiments.experiment import load_experiment

    experiment = load_experiment(experiment_file)
    if dry_run:
        _dry_run(experiment, out, effect)
        return
    if max_repeats is not None and not until_decided:
        raise click.UsageError("--max-repeats applies with --until-decided")
    if block_seconds is not None and not until_decided:
        raise click.UsageError("--block-seconds applies with --until-decided")
    if experiment.sweep is not None:
        if max_runs is not None:
            raise click.UsageError("--max-runs applies to an A/B without a [sweep] table")
        if until_decided:
            raise click.UsageError("--until-decided applies to an A/B without a [sweep] table")
        _ab_sweep(experiment, out, progress, fail_if_worse, workers, ray_address)
        return
    if workers is not None:
        raise click.UsageError("--workers applies to a [sweep] on the simulator")
    if ray_address is not None:
        raise click.UsageError("--ray applies to a [sweep] on the simulator")
    from agentab.analysis.compare import WORSE
    from agentab.experiments.ab import run_experiment

    if out is None:
        out = Path("runs") / f"{experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_experiment(
        experiment,
        out,
        progress=progress,
        max_runs=max_runs,
        until_decided=until_decided,
        max_repeats=max_repeats,
        block_seconds=block_seconds,
    )
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


def _ab_sweep(
    experiment,
    out: Path | None,
    progress: bool,
    fail_if_worse: bool,
    workers: int | None,
    ray_address: str | None,
) -> None:
    from agentab.experiments.pool import default_workers
    from agentab.experiments.sweep import run_sweep
    from agentab.experiments.sweep_report import write_sweep_reports

    out = out if out is not None else Path("runs") / experiment.name
    if ray_address is not None:
        _check_ray(experiment, workers, ray_address)
    if workers is None:
        workers = default_workers(experiment)
    elif workers > 1 and experiment.engine_kind != "simulator":
        raise click.UsageError(
            f"--workers {workers}: only simulated runs are spread over processes (the arms of "
            f"a {experiment.engine_kind} engine share its GPUs and run one at a time)"
        )
    points = run_sweep(
        experiment,
        out,
        progress=progress and workers == 1 and ray_address is None,
        workers=workers,
        ray_address=ray_address,
    )
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


def _check_ray(experiment, workers: int | None, ray_address: str) -> None:
    """Refuse --ray before the experiment dir is touched: ray missing, the wrong engine, or
    --workers for a cluster that decides its own size."""
    from agentab.extras import require
    from agentab.ray_connect import LOCAL

    if experiment.engine_kind != "simulator":
        raise click.UsageError(
            f"--ray: only simulated runs are spread over a cluster (the arms of a "
            f"{experiment.engine_kind} engine share its GPUs and run one at a time)"
        )
    if workers is not None and ray_address != LOCAL:
        raise click.UsageError(
            f"--workers applies with --ray local (the CPUs of the cluster it starts); the "
            f"cluster at {ray_address} runs as many runs at a time as it has CPUs"
        )
    require("ray", "--ray", extra="ray")


def _dry_run(experiment, out: Path | None, effect: float) -> None:
    """What `ab` would run, and a plan when -o holds a pilot."""
    from agentab.experiments.ab import check_before_running

    check_before_running(experiment)
    points = experiment.sweep.points if experiment.sweep else (None,)
    runs = len(points) * experiment.repeats * 2
    window = experiment.replay.get("duration_s", 3600.0)
    where = (
        f" at {experiment.sweep.variable} {', '.join(f'{p:g}' for p in points)}"
        if experiment.sweep
        else ""
    )
    click.echo(
        f"{experiment.name}: {runs} runs ({experiment.repeats} repeats x 2 arms"
        f"{' x ' + str(len(points)) + ' points' if experiment.sweep else ''}{where}), "
        f"{window:g} s profiling window each, engine {experiment.engine_kind}; arms "
        f"{experiment.arms[0].name} (A) and {experiment.arms[1].name} (B); nothing was run"
    )
    if out is None or not out.is_dir():
        simulated = (
            f"; `agentab plan {experiment.path}` simulates one"
            if experiment.engine_kind == "simulator"
            else ""
        )
        click.echo(
            "no plan: name a dir with a pilot's runs with -o (`agentab ab FILE -o DIR "
            f"--max-runs 4` runs one){simulated}"
        )
        return
    _print_plan(out, effect, 0.8, None, False, experiment.resamples, experiment.seed)


def _print_plan(
    source: Path,
    effect: float,
    power: float,
    windows: list[float] | None,
    as_json: bool,
    resamples: int,
    seed: int,
    *,
    step_noise: float | None = None,
    run_noise: float | None = None,
) -> None:
    import orjson

    from agentab.analysis.sample import HEADLINE
    from agentab.experiments.plan import (
        pilots_from_dir,
        plan_points,
        plan_text,
        simulated_pilots,
    )

    if source.is_dir():
        pilots = pilots_from_dir(source, HEADLINE.name, resamples, seed)
    else:
        from agentab.experiments.experiment import load_experiment

        experiment = load_experiment(source)
        pilots = simulated_pilots(
            experiment,
            HEADLINE.name,
            step_noise=DEFAULT_STEP_NOISE if step_noise is None else step_noise,
            run_noise=DEFAULT_RUN_NOISE if run_noise is None else run_noise,
        )
    plans = plan_points(pilots, effect, windows=windows, power=power, confidence=0.95)
    if as_json:
        doc = {"effect": effect, "power": power, "points": [p.to_json() for p in plans]}
        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(plan_text(plans, effect, power, "P90 interactivity"))


DEFAULT_STEP_NOISE = 0.02
DEFAULT_RUN_NOISE = 0.005


@click.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--effect",
    type=click.FloatRange(min=0.001, max=10.0),
    default=0.05,
    show_default=True,
    help="The change of P90 interactivity to detect, as a fraction (0.05 = 5%).",
)
@click.option(
    "--power",
    type=click.FloatRange(min=0.5, max=0.99),
    default=0.8,
    show_default=True,
    help="The probability of detecting that change.",
)
@click.option(
    "--window",
    "windows",
    type=click.FloatRange(min=1.0),
    multiple=True,
    metavar="SECONDS",
    help="A profiling window per run to plan for (repeatable; default: the pilot's window x "
    "0.5, 1, 2 and 4).",
)
@click.option(
    "--step-noise",
    type=click.FloatRange(min=0.0, max=1.0),
    default=None,
    help=f"Simulated pilot: per-step log sigma of the engine's step time (default "
    f"{DEFAULT_STEP_NOISE}; measure yours with an A/A and benchmarks/engine_noise.py).",
)
@click.option(
    "--run-noise",
    type=click.FloatRange(min=0.0, max=1.0),
    default=None,
    help=f"Simulated pilot: per-run log sigma (default {DEFAULT_RUN_NOISE}).",
)
@click.option("--resamples", type=click.IntRange(min=200), default=2000, show_default=True)
@click.option(
    "--seed", type=click.IntRange(min=0), default=42, show_default=True, help="Bootstrap seed."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(
    source: Path,
    effect: float,
    power: float,
    windows: tuple[float, ...],
    step_noise: float | None,
    run_noise: float | None,
    resamples: int,
    seed: int,
    as_json: bool,
) -> None:
    """How many repeats, of which window, an A/B needs to detect a change of --effect.

    SOURCE is an experiment dir of `agentab ab` holding at least two repeats of both arms (a
    pilot stopped with --max-runs, or earlier runs; a sweep dir gives a plan per point), or a
    simulator experiment file, whose pilot (3 repeats, with the engine timing noise given) the
    simulator runs here. The variances of the pilot's paired comparison scale to other windows
    and repeat counts: docs/analysis.md, "How long to run".
    """
    _print_plan(
        source,
        effect,
        power,
        list(windows) or None,
        as_json,
        resamples,
        seed,
        step_noise=step_noise,
        run_noise=run_noise,
    )

"""`agentab report`, `agentab compare`, `agentab export`."""

from __future__ import annotations

from pathlib import Path

import click
import orjson

from agentab.analysis.compare import DEFAULT_RESAMPLES

ALLOW_INCOMPLETE = click.option(
    "--allow-incomplete",
    is_flag=True,
    help="Use runs that did not complete (running, interrupted, failed); the report says so "
    "in its first line.",
)
ALLOW_DIFF = click.option(
    "--allow-diff",
    "allow_diff",
    multiple=True,
    metavar="FIELD",
    help="Accept a manifest difference (repeatable); the report then says it is confounded.",
)


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o", "--out", type=click.Path(path_type=Path), required=True, help="The Parquet file."
)
@ALLOW_INCOMPLETE
def export(run_dirs: tuple[Path, ...], out: Path, allow_incomplete: bool) -> None:
    """Write every request of the runs (run dirs or folders of them) to one Parquet file.

    One row per request: TTFT, ITL (AIPerf) = TPOT (vLLM), chunk ITL mean, E2E, tokens, error
    class; the columns are listed in docs/analysis.md.
    """
    from agentab.analysis.export import write_parquet
    from agentab.analysis.load import load_runs
    from agentab.analysis.status import require_completed

    runs = [run for path in run_dirs for run in load_runs(path)]
    require_completed([(r.path, r.manifest) for r in runs], allow_incomplete)
    write_parquet(runs, out)
    click.echo(f"{out}: {len(runs)} run(s)")


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print summary.json instead of the table.")
@ALLOW_INCOMPLETE
def report(run_dir: Path, as_json: bool, allow_incomplete: bool) -> None:
    """Summarize one run dir: print the table and write RUN_DIR/summary.json.

    Refuses (exit 2) a run that did not complete, unless --allow-incomplete.
    """
    from agentab.analysis.load import load_run
    from agentab.analysis.markdown import run_markdown
    from agentab.analysis.status import require_completed
    from agentab.analysis.summary import summarize_run, write_summary

    run = load_run(run_dir)
    require_completed([(run.path, run.manifest)], allow_incomplete)
    summary = summarize_run(run)
    path = write_summary(summary)
    if as_json:
        click.echo(path.read_text())
    else:
        click.echo(run_markdown(summary), nl=False)


@click.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@ALLOW_DIFF
@ALLOW_INCOMPLETE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of Markdown.")
@click.option("--html", type=click.Path(path_type=Path), default=None, help="Also write this.")
@click.option(
    "--resamples", type=click.IntRange(min=100), default=DEFAULT_RESAMPLES, show_default=True
)
@click.option(
    "--seed", type=int, default=42, show_default=True, help="Bootstrap seed (as `ab`'s default)."
)
@click.option(
    "--equivalence-margin",
    type=click.FloatRange(min=0.0, max=0.99),
    default=0.03,
    show_default=True,
    help="'equivalent' when the interval of B/A lies within +-this fraction (0 turns it off).",
)
@click.option(
    "--slo",
    "slo_terms",
    multiple=True,
    metavar="NAME:VALUE",
    help="A per-request service-level objective, repeatable: ttft, itl (tpot) or e2e with a "
    "unit, e.g. --slo ttft:2s --slo itl:50ms. Adds goodput (successful requests meeting all of "
    "them, per second) and SLO attainment (their share) to the comparison, with intervals.",
)
def compare(
    a: Path,
    b: Path,
    allow_diff: tuple[str, ...],
    allow_incomplete: bool,
    as_json: bool,
    html: Path | None,
    resamples: int,
    seed: int,
    equivalence_margin: float,
    slo_terms: tuple[str, ...],
) -> None:
    """Compare B against A. Each is a run dir or a folder of run dirs (pooled repeats).

    Refuses (exit 2) when the runs differ in anything but decode_backend, unless each
    difference is accepted with --allow-diff, and runs that did not complete, unless
    --allow-incomplete.
    """
    from agentab.analysis.compare import compare_runs
    from agentab.analysis.html import write_html
    from agentab.analysis.load import load_runs
    from agentab.analysis.markdown import comparison_markdown
    from agentab.analysis.slo import parse_slo

    slo = parse_slo(slo_terms)
    comparison = compare_runs(
        load_runs(a),
        load_runs(b),
        allow_diff=allow_diff,
        resamples=resamples,
        seed=seed,
        equivalence_margin=equivalence_margin,
        allow_incomplete=allow_incomplete,
        slo=slo,
    )
    if html is not None:
        write_html(comparison, html)
    if as_json:
        click.echo(orjson.dumps(comparison.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(comparison_markdown(comparison), nl=False)

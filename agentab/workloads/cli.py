"""`agentab workload generate|inspect|convert`."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import orjson

from agentab.outputs import OutputPath, output_help
from agentab.workloads.checks import WorkloadWarning
from agentab.workloads.source import FORMATS

FORMAT_OPTION = click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default=None,
    help="Input format (detected from the content when omitted).",
)
BLOCK_SIZE_OPTION = click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per hash block of Mooncake traces (default 512).",
)


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """Workload warnings (ignored unknown fields, lossy exports) as one stderr line each."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
        click.echo(f"agentab: warning: {message}", err=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", WorkloadWarning)
        warnings.showwarning = show
        yield


@click.group()
def workload() -> None:
    """Generate, inspect and convert workloads (AgentX/Weka JSON, Mooncake, native JSONL)."""


@workload.command()
@click.option("--preset", default="agentx-coding", show_default=True, help="Generator preset.")
@click.option("--sessions", type=int, required=True, help="Number of sessions.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
@click.option(
    "-o", "--output", type=OutputPath(), required=True, help=output_help("Workload file.")
)
@click.option(
    "--config",
    type=click.Path(path_type=Path),
    default=None,
    help="TOML file overriding preset parameters (see docs/workloads.md).",
)
@click.option(
    "--to",
    "to",
    type=click.Choice(["native", "agentx"]),
    default="native",
    show_default=True,
    help="Output format.",
)
def generate(
    preset: str, sessions: int, seed: int, output: Path, config: Path | None, to: str
) -> None:
    """Generate an AgentX-style coding-agent workload (deterministic per seed)."""
    from agentab.workloads.generator import generate as run_generator
    from agentab.workloads.generator import load_config
    from agentab.workloads.io import save

    with one_line_warnings():
        wl = run_generator(load_config(preset, config), sessions, seed)
        save(wl, output, to)
    click.echo(
        f"wrote {len(wl)} sessions, {wl.num_requests()} requests to {output} "
        f"({to}; content hash {wl.content_hash[:16]})",
        err=True,
    )


@workload.command()
@click.argument("path", type=click.Path(path_type=Path))
@FORMAT_OPTION
@BLOCK_SIZE_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(path: Path, fmt: str | None, block_size: int | None, as_json: bool) -> None:
    """Summarize a workload: sizes, turns, pauses, theoretical prefix-cache hit ratio."""
    from agentab.workloads.io import load
    from agentab.workloads.stats import summarize

    with one_line_warnings():
        wl = load(path, fmt, block_size=block_size)
    summary = summarize(wl)
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
        return
    _print_table(path, summary)


@workload.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=OutputPath("any"),
    required=True,
    help=output_help("Workload file (AgentX: a .json/.jsonl file or a folder)."),
)
@click.option("--to", "to", type=click.Choice(["native", "agentx"]), required=True)
@FORMAT_OPTION
@BLOCK_SIZE_OPTION
def convert(src: Path, output: Path, to: str, fmt: str | None, block_size: int | None) -> None:
    """Convert a workload: AgentX JSON (.jsonl, one-session .json, or a directory) or native."""
    from agentab.workloads.io import load, save

    with one_line_warnings():
        wl = load(src, fmt, block_size=block_size)
        save(wl, output, to)
    click.echo(f"wrote {len(wl)} sessions to {output} ({to})", err=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}"


def _print_table(path: Path, s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False)
    head = Table(title=f"workload {path}", show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column(justify="right")
    for key in (
        "sessions",
        "requests",
        "parent_requests",
        "subagent_requests",
        "subagents",
        "background_subagents",
    ):
        head.add_row(key, _fmt(s[key]))
    ratio = s["theoretical_cache_hit_ratio"]
    head.add_row("theoretical_cache_hit_ratio", "-" if ratio is None else f"{ratio:.4f}")
    growth = s["suffix_growth_ratio"]
    head.add_row("suffix_growth_ratio", "-" if growth is None else f"{growth:.4f}")
    console.print(head)
    dist = Table(show_header=True)
    dist.add_column("distribution")
    for key in ("mean", "p50", "p90", "p99", "max"):
        dist.add_column(key, justify="right")
    for name in ("input_tokens", "output_tokens", "turns_per_session", "pause_s"):
        dist.add_row(name, *(_fmt(s[name][k]) for k in ("mean", "p50", "p90", "p99", "max")))
    console.print(dist)
    console.print(f"content_hash {s['content_hash']}", highlight=False)

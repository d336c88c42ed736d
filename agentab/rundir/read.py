"""Reading a run dir's tables: every finished row, also of a run that was killed mid-way."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from agentab.errors import AgentabError
from agentab.rundir.parts import part_files
from agentab.rundir.schema import (
    MANIFEST,
    METRICS_DIR,
    METRICS_SCHEMA,
    RECORD_SCHEMA,
    RECORDS_DIR,
)


def _scan(run_dir: str | Path, sub: str, schema: pl.Schema) -> pl.LazyFrame:
    run_dir = Path(run_dir)
    if not (run_dir / MANIFEST).is_file() and not (run_dir / sub).is_dir():
        raise AgentabError(f"{run_dir}: not a run dir (no {MANIFEST} and no {sub}/)")
    files = part_files(run_dir / sub)
    if not files:
        return pl.LazyFrame(schema=schema)
    for file in files:
        _check_part(file, schema)
    return pl.scan_ipc(files)


def _check_part(path: Path, schema: pl.Schema) -> None:
    """A part that is torn (no Arrow footer) or holds other columns is named in one line, before
    a query over all parts fails somewhere inside polars."""
    try:
        found = pl.read_ipc_schema(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        reason = " ".join(str(exc).split())[:120]
        raise AgentabError(f"{path}: not a readable Arrow file ({reason})") from None
    if dict(found) != dict(schema):
        missing = [name for name in schema if name not in found]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        detail = f"missing {', '.join(missing[:3])}{more}" if missing else "other column types"
        raise AgentabError(f"{path}: not a part of this run's table ({detail})")


def scan_records(run_dir: str | Path) -> pl.LazyFrame:
    """Every request record of a run dir (also of a run that was killed), as a LazyFrame."""
    return _scan(run_dir, RECORDS_DIR, RECORD_SCHEMA)


def scan_metrics(run_dir: str | Path) -> pl.LazyFrame:
    """The scraped server metrics of a run dir (`t_s`, `name`, `labels`, `value`)."""
    return _scan(run_dir, METRICS_DIR, METRICS_SCHEMA)

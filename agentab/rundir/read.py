"""Reading a run dir's tables: every finished row, also of a run that was killed mid-way."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from agentab.errors import AgentabError
from agentab.rundir.parts import part_files
from agentab.rundir.schema import (
    ADDED_RECORD_COLUMNS,
    MANIFEST,
    METRICS_DIR,
    METRICS_SCHEMA,
    RECORD_SCHEMA,
    RECORDS_DIR,
)


def _scan(
    run_dir: str | Path, sub: str, schema: pl.Schema, added: tuple[str, ...] = ()
) -> pl.LazyFrame:
    run_dir = Path(run_dir)
    if not (run_dir / MANIFEST).is_file() and not (run_dir / sub).is_dir():
        raise AgentabError(f"{run_dir}: not a run dir (no {MANIFEST} and no {sub}/)")
    files = part_files(run_dir / sub)
    if not files:
        return pl.LazyFrame(schema=schema)
    lacking = {file: _check_part(file, schema, added) for file in files}
    if not any(lacking.values()):
        return pl.scan_ipc(files)
    # Parts written before the `added` columns existed get them as nulls, one scan per file
    # (a single scan needs one schema); the common case above stays one scan.
    frames = [
        _with_added(pl.scan_ipc(file), schema, lacking[file])
        if lacking[file]
        else pl.scan_ipc(file)
        for file in files
    ]
    return pl.concat(frames, how="vertical")


def _with_added(frame: pl.LazyFrame, schema: pl.Schema, added: tuple[str, ...]) -> pl.LazyFrame:
    nulls = [pl.lit(None, dtype=schema[name]).alias(name) for name in added]
    return frame.with_columns(nulls).select(list(schema))


def _check_part(path: Path, schema: pl.Schema, added: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A part that is torn (no Arrow footer) or holds other columns is named in one line, before
    a query over all parts fails somewhere inside polars. Returns the `added` columns the part
    lacks (a tail of them, the part being of an older run dir), () when it has every column."""
    try:
        found = pl.read_ipc_schema(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        reason = " ".join(str(exc).split())[:120]
        raise AgentabError(f"{path}: not a readable Arrow file ({reason})") from None
    for k in range(1, len(added) + 1):
        tail = added[-k:]
        if dict(found) == {n: t for n, t in schema.items() if n not in tail}:
            return tail
    if dict(found) != dict(schema):
        missing = [name for name in schema if name not in found]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        detail = f"missing {', '.join(missing[:3])}{more}" if missing else "other column types"
        raise AgentabError(f"{path}: not a part of this run's table ({detail})")
    return ()


def scan_records(run_dir: str | Path) -> pl.LazyFrame:
    """Every request record of a run dir (also of a run that was killed), as a LazyFrame."""
    return _scan(run_dir, RECORDS_DIR, RECORD_SCHEMA, ADDED_RECORD_COLUMNS)


def scan_metrics(run_dir: str | Path) -> pl.LazyFrame:
    """The scraped server metrics of a run dir (`t_s`, `name`, `labels`, `value`)."""
    return _scan(run_dir, METRICS_DIR, METRICS_SCHEMA)

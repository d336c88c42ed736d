"""Open a run dir: its manifest, its request records and its scraped server metrics.

Everything analysis knows about a run comes from the run dir that replay wrote (see
docs/interfaces.md, "run dir"), so a run can be re-analysed years later without the engine. A
directory that is not a run dir, a manifest that is not JSON, or records without the columns the
metrics need end in one `AgentabError` line naming the path, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from agentab.errors import AgentabError
from agentab.rundir import MANIFEST, is_run_dir, read_manifest, scan_metrics, scan_records
from agentab.rundir.clients import CLIENTS_DIR, recover_clients

# The columns the metrics read (a subset of agentab.rundir.RECORD_SCHEMA).
REQUIRED_COLUMNS: tuple[str, ...] = (
    "request_id",
    "session_id",
    "lane",
    "pass",
    "agent_id",
    "phase",
    "planned_s",
    "sent_s",
    "chunk_times_s",
    "chunk_tokens",
    "reasoning_chunks",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "error_class",
    "error_message",
    "warning_class",
)

METRICS_COLUMNS: list[str] = ["t_s", "name", "labels", "value"]


@dataclass(frozen=True)
class Run:
    """One run dir, opened: the manifest as a dict and lazy frames over the Arrow parts."""

    path: Path
    manifest: dict[str, Any]
    records: pl.LazyFrame
    server_metrics: pl.LazyFrame

    @property
    def arm(self) -> str:
        """The arm name the run was recorded under (the decode backend when unnamed)."""
        m = self.manifest
        return str(m.get("arm") or m.get("decode_backend") or self.path.name)

    @property
    def gpu_count(self) -> int | None:
        value = self.manifest.get("gpu_count")
        return int(value) if isinstance(value, int | float) and value > 0 else None


def scan_run_records(path: Path) -> pl.LazyFrame:
    """The run's request records as one lazy frame, with the columns the metrics read."""
    return _require_columns(scan_records(path), REQUIRED_COLUMNS, f"{path}/records")


def scan_server_metrics(path: Path) -> pl.LazyFrame:
    """Scraped Prometheus samples (long form); an empty frame when the run scraped none."""
    frame = _require_columns(scan_metrics(path), METRICS_COLUMNS, f"{path}/metrics")
    return frame.select(METRICS_COLUMNS)


def _require_columns(frame: pl.LazyFrame, columns: Sequence[str], where: str) -> pl.LazyFrame:
    """Fail with one line naming the missing columns, before any metric reads them."""
    names = frame.collect_schema().names()
    missing = [c for c in columns if c not in names]
    if missing:
        raise AgentabError(f"{where}: missing column(s) {', '.join(missing)}")
    return frame


def load_run(path: str | Path) -> Run:
    """Open one run dir (lazily: nothing is read beyond the manifest until a frame is collected)."""
    path = Path(path)
    manifest = read_manifest(path)
    recovered = recover_clients(path)
    if recovered is not None:
        print(
            f"agentab: {path}: merged {recovered} records its clients left under "
            f"{CLIENTS_DIR}/ into records/ (the replay ended before merging them)",
            file=sys.stderr,
        )
    return Run(
        path=path,
        manifest=manifest,
        records=scan_run_records(path),
        server_metrics=scan_server_metrics(path),
    )


def load_runs(path: str | Path) -> list[Run]:
    """A run dir, or a directory whose run dirs (at any depth) form one side of a comparison."""
    path = Path(path)
    if is_run_dir(path):
        return [load_run(path)]
    if not path.is_dir():
        raise AgentabError(f"{path}: no such run dir")
    found = sorted(p.parent for p in path.rglob(MANIFEST))
    if not found:
        raise AgentabError(f"{path}: no run dirs (no {MANIFEST}) below it")
    return [load_run(p) for p in found]

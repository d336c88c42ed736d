"""Run records: the append-only, crash-safe request and metrics tables of a run dir.

Why part files: a replay can be killed at any moment (SIGKILL, OOM, a lost machine) and the
analysis must still read everything that finished. Rows are buffered in memory and a background
thread writes them every `flush_interval_s` (0.5 s) as a new Arrow IPC file, written under a
temporary name and renamed, so a reader never sees a torn file. Parts are named
`part-FIRST-LAST.arrow` (sequence numbers); every `compact_every` parts are merged into one file
covering their range and then deleted. A crash between the merge and the deletes leaves both,
and `scan_records` reads only files not covered by a wider one, so no row is read twice.

The writer thread uses real (monotonic) time on purpose: durability is about wall-clock crash
windows, also when the replay itself runs on the virtual clock.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from agentab.errors import AgentabError

RECORD_SCHEMA = pl.Schema(
    {
        "request_id": pl.String,
        "session_id": pl.String,
        "lane": pl.Int32,
        "pass": pl.Int32,
        "agent_id": pl.String,
        "turn": pl.Int32,
        "phase": pl.String,
        "planned_s": pl.Float64,
        "sent_s": pl.Float64,
        "chunk_times_s": pl.List(pl.Float64),
        "chunk_tokens": pl.List(pl.Int32),
        "reasoning_chunks": pl.Int32,
        "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64,
        "cached_tokens": pl.Int64,
        "osl": pl.Int64,
        "error_class": pl.String,
        "error_message": pl.String,
    }
)
"""Columns of `records/*.arrow` (docs/interfaces.md, "run dir"); analysis reads exactly these."""

METRICS_SCHEMA = pl.Schema(
    {"t_s": pl.Float64, "name": pl.String, "labels": pl.String, "value": pl.Float64}
)
"""Columns of `metrics/*.arrow`: scraped server metrics in long form (labels as JSON)."""

RECORDS_DIR = "records"
METRICS_DIR = "metrics"
_PART_RE = re.compile(r"^part-(\d+)-(\d+)\.arrow$")


class PartWriter:
    """Append rows; a background thread writes them as atomic Arrow IPC part files.

    `add` is cheap and thread-safe (the replay loop calls it once per finished request).
    `close` writes what is left and stops the thread; call it on every exit path.
    """

    def __init__(
        self,
        directory: str | Path,
        schema: pl.Schema,
        *,
        flush_interval_s: float = 0.5,
        compact_every: int = 64,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self._names = list(schema.names())
        self.flush_interval_s = flush_interval_s
        self.compact_every = compact_every
        self._rows: list[tuple[Any, ...]] = []
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._seq = _next_seq(self.directory)
        self._level0: list[Path] = []  # small parts not yet merged
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="agentab-part-writer", daemon=True)
        self._thread.start()

    def add(self, row: Mapping[str, Any]) -> None:
        """Queue one row (a mapping with every schema column)."""
        if self._error is not None:
            raise AgentabError(f"{self.directory}: writing records failed: {self._error}")
        values = tuple(row[name] for name in self._names)
        with self._lock:
            if not self._rows:
                self._oldest = time.monotonic()
            self._rows.append(values)

    def add_many(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            self.add(row)

    def flush(self) -> None:
        """Write every queued row now (blocking)."""
        with self._lock:
            rows, self._rows, self._oldest = self._rows, [], None
        if rows:
            with self._io_lock:
                self._write_part(rows)

    def close(self) -> None:
        """Flush, merge the remaining small parts, stop the thread. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.flush()
        with self._io_lock:
            if len(self._level0) > 1:
                self._compact()
        if self._error is not None:
            raise AgentabError(f"{self.directory}: writing records failed: {self._error}")

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background thread ------------------------------------------------------------------

    def _run(self) -> None:
        tick = min(0.1, self.flush_interval_s / 4)
        while not self._stop.wait(tick):
            oldest = self._oldest
            if oldest is None or time.monotonic() - oldest < self.flush_interval_s:
                continue
            try:
                self.flush()
            except BaseException as exc:  # surfaced to the replay on the next add/close
                self._error = exc
                return

    def _write_part(self, rows: list[tuple[Any, ...]]) -> None:
        frame = pl.DataFrame(rows, schema=self.schema, orient="row")
        seq = self._seq
        self._seq += 1
        path = self.directory / f"part-{seq:08d}-{seq:08d}.arrow"
        _atomic_write_ipc(frame, path)
        self.rows_written += len(rows)
        self._level0.append(path)
        if len(self._level0) >= self.compact_every:
            self._compact()

    def _compact(self) -> None:
        """Merge the small parts into one file covering their sequence range."""
        parts = self._level0
        first, last = _span(parts[0])[0], _span(parts[-1])[1]
        frame = pl.concat([pl.read_ipc(p) for p in parts], how="vertical")
        _atomic_write_ipc(frame, self.directory / f"part-{first:08d}-{last:08d}.arrow")
        for p in parts:
            p.unlink(missing_ok=True)
        self._level0 = []


def _atomic_write_ipc(frame: pl.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    frame.write_ipc(tmp)
    os.replace(tmp, path)


def _span(path: Path) -> tuple[int, int]:
    m = _PART_RE.match(path.name)
    assert m is not None
    return int(m.group(1)), int(m.group(2))


def _next_seq(directory: Path) -> int:
    spans = [_span(p) for p in directory.iterdir() if _PART_RE.match(p.name)]
    return max((last for _, last in spans), default=-1) + 1


def part_files(directory: str | Path) -> list[Path]:
    """The part files to read: each kept file is not covered by a wider one (see module doc)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    spans = sorted(
        ((_span(p), p) for p in directory.iterdir() if _PART_RE.match(p.name)),
        key=lambda item: (item[0][0], -item[0][1]),
    )
    kept: list[Path] = []
    covered_to = -1
    for (_first, last), path in spans:
        if last <= covered_to:
            continue  # inside a merged file already kept
        kept.append(path)
        covered_to = last
    return kept


def _scan(run_dir: str | Path, sub: str, schema: pl.Schema) -> pl.LazyFrame:
    run_dir = Path(run_dir)
    if not (run_dir / "manifest.json").is_file() and not (run_dir / sub).is_dir():
        raise AgentabError(f"{run_dir}: not a run dir (no manifest.json and no {sub}/)")
    files = part_files(run_dir / sub)
    if not files:
        return pl.LazyFrame(schema=schema)
    return pl.scan_ipc(files)


def scan_records(run_dir: str | Path) -> pl.LazyFrame:
    """Every request record of a run dir (also of a run that was killed), as a LazyFrame."""
    return _scan(run_dir, RECORDS_DIR, RECORD_SCHEMA)


def scan_metrics(run_dir: str | Path) -> pl.LazyFrame:
    """The scraped server metrics of a run dir (`t_s`, `name`, `labels`, `value`)."""
    return _scan(run_dir, METRICS_DIR, METRICS_SCHEMA)

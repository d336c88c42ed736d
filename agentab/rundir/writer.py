"""The part-file writer: rows appended during a run reach disk within a second, without stalling it.

Rows are buffered in memory and a background thread writes them every `flush_interval_s`
(0.5 s) as a new part file (see `agentab.rundir.parts`); every `compact_every` parts are merged
into one. The writer thread uses real (monotonic) time on purpose: durability is about
wall-clock crash windows, also when the replay itself runs on the virtual clock.

Why rows are buffered column by column, with numeric list columns (`chunk_times_s`: about 110
floats per request) as one flat `array` of values plus per-row lengths: the writer thread needs
the GIL for every Python object polars converts, and converting ~100 rows of 110-float lists
held it 2-10 ms per flush, stalling the replay loop (dispatch lateness). From flat buffers polars
builds the list columns with the GIL released, so the loop is held up well under a millisecond.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from agentab.errors import AgentabError
from agentab.rundir.parts import atomic_write_ipc, next_seq, part_path, span

_FLAT_CODES: dict[Any, str] = {pl.Float64: "d", pl.Int32: "i", pl.Int64: "q"}
_INT_LIMITS: dict[Any, int] = {pl.Int32: 2**31, pl.Int64: 2**63}
"""List columns with these inner types are buffered flat (array typecode per inner dtype)."""

_ARRAY_DTYPES: dict[str, np.dtype[Any]] = {
    "d": np.dtype(np.float64),
    "i": np.dtype(np.int32),
    "q": np.dtype(np.int64),
}
"""numpy dtypes whose items an `array` of the typecode holds exactly (taken as raw bytes)."""


class _Batch:
    """Rows queued since the last flush, column by column (see the module doc for why).

    Scalar columns are Python lists; a flat list column is `values` (each row's items as one
    bytes-like piece, joined into one buffer when the batch becomes a frame), `lengths` (items
    per row) and `valid` (False where the row's value is None). Pieces, not one growing
    `array`: extending an array of millions of items reallocates it every ~6% of growth, and
    each reallocation may copy it (most of `add`'s time at AgentX scale). The join, in the
    writer thread, holds the GIL for one copy of the batch's items (~1 ms for 2M floats).
    """

    __slots__ = ("flat", "ints", "n", "scalar")

    def __init__(self, schema: pl.Schema) -> None:
        self.n = 0
        self.scalar: dict[str, list[Any]] = {}
        self.flat: dict[str, tuple[str, list[bytes | array[Any]], array[int], list[bool]]] = {}
        self.ints: dict[str, int] = {}  # integer scalar column -> largest magnitude it holds
        for name, dtype in schema.items():
            code = _FLAT_CODES.get(dtype.inner) if isinstance(dtype, pl.List) else None
            if code is None:
                self.scalar[name] = []
                if dtype in _INT_LIMITS:
                    self.ints[name] = _INT_LIMITS[dtype]
            else:
                self.flat[name] = (code, [], array("q"), [])

    def add(self, row: Mapping[str, Any]) -> None:
        # Check before appending: one value a column cannot hold would otherwise fail the whole
        # batch when it is converted, and with it every row queued beside it.
        for name, limit in self.ints.items():
            v = row[name]
            if v is not None and not -limit <= v < limit:
                raise AgentabError(f"record column {name}: {v} does not fit its type")
        flat_items: list[tuple[bytes | array[Any], int] | None] = []
        for name, (code, _values, _lengths, _valid) in self.flat.items():
            items = row[name]
            if items is None:
                flat_items.append(None)
                continue
            if type(items) is np.ndarray and items.dtype == _ARRAY_DTYPES[code]:
                flat_items.append((items.tobytes(), len(items)))  # exact, no boxing
                continue
            try:  # convert first: a bad item must not leave a half-appended row behind
                converted = array(code, items)
            except (TypeError, OverflowError) as exc:
                raise AgentabError(f"record column {name}: {exc} in {items!r:.80}") from None
            flat_items.append((converted, len(converted)))
        for name, column in self.scalar.items():
            column.append(row[name])
        for (_code, values, lengths, valid), got in zip(
            self.flat.values(), flat_items, strict=True
        ):
            if got is None:
                lengths.append(0)
                valid.append(False)
            else:
                values.append(got[0])
                lengths.append(got[1])
                valid.append(True)
        self.n += 1

    def frame(self, schema: pl.Schema) -> pl.DataFrame:
        columns: list[pl.Series] = []
        for name, dtype in schema.items():
            if name in self.scalar:
                columns.append(pl.Series(name, self.scalar[name], dtype=dtype))
            else:
                assert isinstance(dtype, pl.List)  # the flat columns are the list columns
                columns.append(_list_column(name, dtype, *self.flat[name]))
        return pl.DataFrame(columns)


def _list_column(
    name: str,
    dtype: pl.List,
    code: str,
    values: list[bytes | array[Any]],
    lengths: array[int],
    valid: list[bool],
) -> pl.Series:
    """A list column from each row's items (raw pieces) and per-row lengths, built by polars
    without Python objects per item (the GIL is released while the lazy query runs)."""
    n = len(lengths)
    counts = np.frombuffer(lengths, dtype=np.int64) if n else np.zeros(0, np.int64)
    flat = b"".join(values)
    items = pl.Series(
        "v", np.frombuffer(flat, dtype=_ARRAY_DTYPES[code]) if flat else [], dtype.inner
    )
    # the row numbers ascend: marked sorted, the group-by takes contiguous runs (with the
    # shortcut below, a 1,400-row flush 26 -> 11 ms: benchmarks/bench_part_writer.py)
    row = pl.Series("row", np.repeat(np.arange(n, dtype=np.int64), counts)).set_sorted()
    rows = pl.LazyFrame({"row": row, "v": items})
    lists = rows.group_by("row", maintain_order=True).agg(pl.col("v"))
    if n and counts.min() > 0:  # every row has items (so none is None): one list per group
        return lists.select(pl.col("v").alias(name)).collect().to_series()
    every = pl.LazyFrame({"row": np.arange(n, dtype=np.int64), "ok": np.asarray(valid, bool)})
    joined = every.join(lists, on="row", how="left", maintain_order="left")
    # Rows with no items are missing from the group-by: an empty list, or null where None.
    value = pl.when(pl.col("ok")).then(pl.col("v").fill_null(pl.lit([], dtype=dtype)))
    return joined.select(value.otherwise(None).cast(dtype).alias(name)).collect().to_series()


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
        self.flush_interval_s = flush_interval_s
        self.compact_every = compact_every
        self._batch = _Batch(schema)
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._seq = next_seq(self.directory)
        self._level0: list[Path] = []  # small parts not yet merged
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="agentab-part-writer", daemon=True)
        self._thread.start()

    def add(self, row: Mapping[str, Any]) -> None:
        """Queue one row (a mapping with every schema column)."""
        if self._error is not None:
            raise AgentabError(f"{self.directory}: writing records failed: {self._error}")
        with self._lock:
            if not self._batch.n:
                self._oldest = time.monotonic()
            self._batch.add(row)

    def add_many(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            self.add(row)

    def flush(self) -> None:
        """Write every queued row now (blocking)."""
        with self._lock:
            batch, self._oldest = self._batch, None
            if batch.n:
                self._batch = _Batch(self.schema)
        if batch.n:
            with self._io_lock:
                self._write_part(batch)

    def close(self) -> None:
        """Flush and stop the thread. Idempotent.

        The small parts written since the last merge stay as they are (fewer than
        `compact_every`; a reader takes any number): merging them here would write every row
        of them a second time as the run ends, which for a simulated run (records of
        hundreds of thousands of chunk times, written in seconds) took up to a tenth of it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.flush()
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

    def _write_part(self, batch: _Batch) -> None:
        frame = batch.frame(self.schema)
        seq = self._seq
        self._seq += 1
        path = part_path(self.directory, seq, seq)
        atomic_write_ipc(frame, path)
        self.rows_written += batch.n
        self._level0.append(path)
        if len(self._level0) >= self.compact_every:
            self._compact()

    def _compact(self) -> None:
        """Merge the small parts into one file covering their sequence range."""
        parts = self._level0
        first, last = span(parts[0])[0], span(parts[-1])[1]
        frame = pl.concat([pl.read_ipc(p) for p in parts], how="vertical")
        atomic_write_ipc(frame, part_path(self.directory, first, last))
        for p in parts:
            p.unlink(missing_ok=True)
        self._level0 = []

"""Reading trace files: gzip, directories, JSONL lines, and format detection.

Importers receive bytes and line numbers from here, so every format accepts `.gz` and reports
the same file/line in its errors.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import orjson

from agentab.errors import AgentabError

FORMATS = ("agentx", "mooncake", "native")
NATIVE_HEADER_KEY = "agentab_workload"
TRACE_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_NON_SPACE = re.compile(rb"\S")
MAX_BYTES_ENV = "AGENTAB_MAX_WORKLOAD_BYTES"
DEFAULT_MAX_BYTES = 2**30
"""Largest trace file (after gzip decompression) read into memory: 1 GiB by default, several
times the AgentX/Weka corpus, so a gzip bomb or a wrong file stops at once instead of after
minutes and gigabytes. Set AGENTAB_MAX_WORKLOAD_BYTES to read larger traces."""


def max_bytes() -> int:
    value = os.environ.get(MAX_BYTES_ENV)
    if value is None:
        return DEFAULT_MAX_BYTES
    try:
        return int(value)
    except ValueError:
        raise AgentabError(f"{MAX_BYTES_ENV}={value!r}: expected a number of bytes") from None


def first_non_space(data: bytes, start: int = 0) -> int:
    """Index of the first non-whitespace byte at or after `start`, or -1 (no copy of `data`:
    trace files run to hundreds of MB)."""
    m = _NON_SPACE.search(data, start)
    return -1 if m is None else m.start()


def read_bytes(path: Path) -> bytes:
    """The file's content, decompressed when it is gzip (by magic bytes or a `.gz` name)."""
    limit = max_bytes()
    try:
        size = path.stat().st_size
        if size > limit:
            raise AgentabError(
                f"{path}: {size:,} bytes is more than the {limit:,} a trace may hold "
                f"(set {MAX_BYTES_ENV} to raise it)"
            )
        data = path.read_bytes()
    except FileNotFoundError:
        raise AgentabError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise AgentabError(f"{path}: is a directory") from None
    except OSError as exc:
        raise AgentabError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if data[:2] == b"\x1f\x8b" or path.name.endswith(".gz"):
        try:
            # Read at most one byte past the limit: decompression stops there.
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
                data = stream.read(limit + 1)
        except (OSError, EOFError, zlib.error) as exc:
            raise AgentabError(f"{path}: not a valid gzip file ({exc})") from None
        if len(data) > limit:
            raise AgentabError(
                f"{path}: decompresses to more than {limit:,} bytes, the most a trace may hold "
                f"(set {MAX_BYTES_ENV} to raise it)"
            )
    return data


def jsonl_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) for each non-blank line."""
    for lineno, line in enumerate(data.split(b"\n"), 1):
        # the first byte usually settles it: scanning a whole 1 MB session line is not free
        if line and (not line[:1].isspace() or not line.isspace()):
            yield lineno, line


def session_lines(data: bytes) -> Iterator[tuple[int, memoryview]]:
    """`jsonl_lines` for formats with one session per line (AgentX JSONL, native): views into
    `data` rather than copies, since such lines are few and large (a 217 MB file of 400 lines
    would be copied once more by `split`, ~0.13 s). orjson and msgspec read views as bytes."""
    view = memoryview(data)
    size = len(data)
    start, lineno = 0, 1
    while start <= size:
        end = data.find(b"\n", start)
        if end == -1:
            end = size
        if end > start and _NON_SPACE.search(data, start, end) is not None:
            yield lineno, view[start:end]
        start, lineno = end + 1, lineno + 1


def parse_json(data: bytes | memoryview, file: str, line: int | None = None) -> object:
    """orjson.loads with a one-line error naming the file and line."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        where = f"{file}:{exc.lineno}" if line is None else f"{file}:{line}"
        raise AgentabError(f"{where}: invalid JSON ({exc.msg}, column {exc.colno})") from None


def trace_files(directory: Path) -> list[Path]:
    """The trace files of a directory (AgentX: one session per file), sorted by name."""
    files = sorted(
        p for p in directory.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES)
    )
    if not files:
        raise AgentabError(f"{directory}: no .json/.jsonl(.gz) trace files in this directory")
    return files


def detect(path: Path, data: bytes | None) -> str:
    """Which importer reads this: from the first JSON object's keys (or a directory: agentx)."""
    if data is None:
        return "agentx"
    start = first_non_space(data)
    if start == -1:
        raise AgentabError(f"{path}: file is empty")
    if data[start : start + 1] != b"{":
        line = data.count(b"\n", 0, start) + 1
        raise AgentabError(
            f"{path}:{line}: not a JSON object (is it a trace file?); formats: {', '.join(FORMATS)}"
        )
    end = data.find(b"\n", start)
    first = data[start:] if end == -1 else data[start:end]
    try:
        obj = orjson.loads(first)
    except orjson.JSONDecodeError:
        # A multi-line (pretty-printed) document: one AgentX session per file.
        return "agentx"
    if not isinstance(obj, dict):
        raise AgentabError(f"{path}:1: not a JSON object")
    if NATIVE_HEADER_KEY in obj:
        return "native"
    if "requests" in obj:
        return "agentx"
    if "input_length" in obj or "timestamp" in obj:
        return "mooncake"
    keys = ", ".join(sorted(obj)[:6])
    raise AgentabError(
        f"{path}:1: cannot tell the trace format from the keys ({keys}); pass --format "
        f"{'|'.join(FORMATS)}"
    )

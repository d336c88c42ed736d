"""Part files: how a table of a run dir is split into atomic Arrow IPC files and read back whole.

Why part files: a replay can be killed at any moment (SIGKILL, OOM, a lost machine) and the
analysis must still read everything that finished. Each flush is written as a new file under a
temporary name and renamed, so a reader never sees a torn file. Parts are named
`part-FIRST-LAST.arrow` (sequence numbers); merging consecutive parts writes one file covering
their range and then deletes them. A crash between the merge and the deletes leaves both, and
`part_files` keeps only files not covered by a wider one, so no row is read twice.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl

_PART_RE = re.compile(r"^part-(\d+)-(\d+)\.arrow$")


def part_path(directory: Path, first: int, last: int) -> Path:
    """The file holding sequence numbers `first` to `last` (one flush when they are equal)."""
    return directory / f"part-{first:08d}-{last:08d}.arrow"


def atomic_write_ipc(frame: pl.DataFrame, path: Path) -> None:
    """Write under a hidden temporary name, then rename: a reader sees the whole file or none."""
    tmp = path.with_name(f".tmp-{path.name}")
    frame.write_ipc(tmp)
    os.replace(tmp, path)


def atomic_write_bytes(data_path: Path, data: bytes) -> None:
    """`atomic_write_ipc` for a file's bytes received from elsewhere (a remote client's part)."""
    tmp = data_path.with_name(f".tmp-{data_path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, data_path)


def span(path: Path) -> tuple[int, int]:
    """The first and last sequence number a part file covers, from its name."""
    m = _PART_RE.match(path.name)
    assert m is not None
    return int(m.group(1)), int(m.group(2))


def next_seq(directory: Path) -> int:
    """The sequence number after every part already there, so a resumed writer overwrites none."""
    spans = [span(p) for p in directory.iterdir() if _PART_RE.match(p.name)]
    return max((last for _, last in spans), default=-1) + 1


def part_files(directory: str | Path) -> list[Path]:
    """The part files to read: each kept file is not covered by a wider one (see module doc)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    spans = sorted(
        ((span(p), p) for p in directory.iterdir() if _PART_RE.match(p.name)),
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

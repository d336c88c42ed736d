"""The parts of a sharded run (`agentab replay --clients N`) and their merge into one run dir.

Each client of a sharded replay writes its records under `clients/<k>/` of the run dir (a Ray
client's come back there at its end); when the run ends they are merged into `records/` (in
plan order) and `clients/` is removed, so the run dir is the one a one-process run leaves. A
coordinator that is killed (SIGKILL, a lost host) never merges them; analysis does it when it
opens the run dir (`recover_clients`), so no record a client wrote is lost.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import polars as pl

from agentab.dir_lock import LOCK_NAME, lock_dir, release_dir
from agentab.errors import AgentabError
from agentab.rundir.manifest import write_manifest
from agentab.rundir.parts import atomic_write_ipc, part_files, part_path
from agentab.rundir.schema import METRICS_DIR, RECORDS_DIR

CLIENTS_DIR = "clients"


def merge_tables(run_dir: Path, folders: list[Path]) -> int:
    """Every client's records into `records/` (in plan order), client 0's scrapes into
    `metrics/`: the tables a one-process run leaves. Returns the number of records.

    Idempotent: `records/` of a sharded run holds only the merged file, which is rewritten
    whole, so merging again after a crash between the merge and the removal of `clients/`
    writes the same rows once."""
    frames = [pl.read_ipc(p) for f in folders for p in part_files(f / RECORDS_DIR)]
    records = run_dir / RECORDS_DIR
    records.mkdir(exist_ok=True)
    rows = 0
    if frames:
        merged = pl.concat(frames).sort("planned_s", "request_id")
        rows = merged.height
        atomic_write_ipc(merged, part_path(records, 0, 0))
    scrapes = part_files(folders[0] / METRICS_DIR) if folders else []
    if scrapes:
        metrics = run_dir / METRICS_DIR
        metrics.mkdir(exist_ok=True)
        merged = pl.concat([pl.read_ipc(p) for p in scrapes])
        atomic_write_ipc(merged, part_path(metrics, 0, 0))
    return rows


def client_folders(run_dir: Path) -> list[Path]:
    """`clients/0`, `clients/1`, ... as they are on disk, in client order."""
    base = run_dir / CLIENTS_DIR
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(found, key=lambda p: int(p.name))


def merge_clients(run_dir: Path, manifest: dict[str, Any] | None = None) -> int:
    """Merge `clients/` into the run dir's tables, write `manifest` (when given), remove
    `clients/`. The removal is a rename first, so a crash part-way leaves either every
    client's parts under `clients/` (merged again on the next open) or none."""
    rows = merge_tables(run_dir, client_folders(run_dir))
    if manifest is not None:
        write_manifest(run_dir, manifest)
    gone = run_dir / f".{CLIENTS_DIR}-merged"
    if gone.exists():
        shutil.rmtree(gone)
    if (run_dir / CLIENTS_DIR).exists():  # absent when no client wrote a record
        os.replace(run_dir / CLIENTS_DIR, gone)
        shutil.rmtree(gone)
    return rows


def recover_clients(run_dir: str | Path) -> int | None:
    """A sharded run dir whose coordinator ended before merging (killed, lost host): merge the
    records its clients wrote under `clients/` into `records/`, as the coordinator would have.
    None when there is nothing to merge; else the number of records now in `records/`.

    Refused, in one line, while the replay (or one of its clients) still writes the dir. The
    manifest is left as the coordinator wrote it: `running`, never finalised, like a killed
    one-process run's."""
    run_dir = Path(run_dir)
    if not (run_dir / CLIENTS_DIR).is_dir():
        return None
    held: list[Path] = []
    try:
        for d in (run_dir, *client_folders(run_dir)):
            try:
                lock_dir(d, "agentab replay", "--out")
            except AgentabError:
                holder = (d / LOCK_NAME).read_text().strip() or "unknown"
                raise AgentabError(
                    f"{run_dir}: its replay is still running (pid {holder}); its clients' "
                    f"records are merged into {RECORDS_DIR}/ when it ends"
                ) from None
            held.append(d)
        if not (run_dir / CLIENTS_DIR).is_dir():  # merged meanwhile by another reader
            return None
        return merge_clients(run_dir)
    finally:
        for d in held:
            release_dir(d)

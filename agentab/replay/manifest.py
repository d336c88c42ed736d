"""The run manifest: everything that defines an arm, written before the first request.

Why before: a run killed mid-way must still say what it was (the analysis refuses to compare
runs whose manifests differ in anything but the decode backend). It is rewritten atomically at
the end with the outcome (`status`, `finished_at`, `stats`).
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from pathlib import Path
from typing import Any

from agentab import __version__
from agentab.errors import AgentabError
from agentab.replay.options import ReplayOptions
from agentab.rundir import MANIFEST
from agentab.workloads.model import Workload

REQUIRED_KEYS: tuple[str, ...] = (
    "gpu_count",
    "gpu_ids",
    "gpu_name",
    "tp",
    "decode_backend",
    "workload_hash",
    "engine",
    "profile",
    "seed",
    "model",
    "spec",
    "replay",
    "agentab_version",
    "started_at",
    "arm",
)


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def writer_facts() -> dict[str, Any]:
    """Which process writes the run dir: a reader can then tell a run still in progress on this
    host from one whose writer was killed before it could finalise the manifest."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def build_manifest(
    workload: Workload,
    replay: ReplayOptions,
    run_dir: Path,
    *,
    target_facts: dict[str, Any],
    manifest_extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """Defaults (null where unknown) <- facts the target knows <- what the caller passes."""
    manifest: dict[str, Any] = {
        "arm": run_dir.name,
        "engine": None,
        "profile": None,
        "model": None,
        "gpu_count": None,
        "gpu_ids": [],
        "gpu_name": None,
        "tp": None,
        "decode_backend": None,
        "spec": None,
    }
    facts = dict(target_facts)
    server = facts.pop("server", None)
    if isinstance(server, dict):  # `agentab serve` describes its engine
        facts = {**server, **facts}
    if "seed" in facts:  # an engine's own seed (spec-decode acceptance); `seed` is the run's
        facts["engine_seed"] = facts.pop("seed")
    manifest.update(facts)
    manifest.update(
        {
            "workload_hash": workload.content_hash,
            "workload": {
                "source": workload.source,
                "sessions": len(workload.sessions),
                "requests": workload.num_requests(),
            },
            "seed": replay.seed,
            "replay": replay.to_dict(),
            "agentab_version": __version__,
            "started_at": now_iso(),
            "status": "running",
            "writer": writer_facts(),
        }
    )
    if manifest_extra:
        manifest.update(manifest_extra)
    for key in ("url", "server_url"):  # credentials in a URL never reach the run dir
        if isinstance(manifest.get(key), str):
            # imported here: the HTTP target pulls in aiohttp, which an in-process run never needs
            from agentab.replay.targets.http import redact_url

            manifest[key] = redact_url(manifest[key])
    return manifest


def prepare_run_dir(out_dir: str | Path) -> Path:
    """Create the run dir; refuse one that already holds a run."""
    run_dir = Path(out_dir)
    if (run_dir / MANIFEST).exists():
        raise AgentabError(f"{run_dir}: already holds a run (manifest.json); choose another --out")
    if run_dir.exists() and not run_dir.is_dir():
        raise AgentabError(f"{run_dir}: exists and is not a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir

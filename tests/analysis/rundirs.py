"""Build run dirs by hand for analysis tests, through replay's own record writer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson

from agentab.rundir import METRICS_SCHEMA, RECORD_SCHEMA, PartWriter

BASE_MANIFEST: dict[str, Any] = {
    "gpu_count": 16,
    "gpu_ids": [],
    "gpu_name": "GB300",
    "tp": 16,
    "decode_backend": "auto",
    "workload_hash": "w" * 64,
    "engine": "simulator",
    "profile": {"name": "gb300-tp16-kimi-k3", "hash": "p" * 16},
    "seed": 42,
    "model": "kimi-k3",
    "spec": {"method": "dspark", "num_draft_tokens": 7},
    "replay": {"concurrency": 2, "duration_s": 600.0, "seed": 42},
    "agentab_version": "0.1.0",
    "started_at": "2025-01-01T00:00:00Z",
    "arm": "auto",
    "status": "completed",
}


def manifest(**changes: Any) -> dict[str, Any]:
    """BASE_MANIFEST with changes; `a__b=x` sets the nested field a.b."""
    m = copy.deepcopy(BASE_MANIFEST)
    for key, value in changes.items():
        target = m
        *path, leaf = key.split("__")
        for part in path:
            target = target[part]
        target[leaf] = value
    return m


def rec(
    request_id: str,
    *,
    session_id: str = "s1",
    agent_id: str = "main",
    phase: str = "profiling",
    planned_s: float = 0.0,
    sent_s: float = 0.0,
    chunk_times_s: list[float] | None = None,
    chunk_tokens: list[int] | None = None,
    reasoning_chunks: int | None = None,
    prompt_tokens: int = 100,
    completion_tokens: int | None = None,
    cached_tokens: int | None = None,
    error_class: str | None = None,
    lane: int = 0,
    turn: int = 0,
) -> dict[str, Any]:
    """One record with every RECORD_SCHEMA column."""
    times = chunk_times_s or []
    tokens = chunk_tokens or []
    return {
        "request_id": request_id,
        "session_id": session_id,
        "lane": lane,
        "pass": 0,
        "agent_id": agent_id,
        "turn": turn,
        "phase": phase,
        "planned_s": planned_s,
        "sent_s": sent_s,
        "chunk_times_s": times,
        "chunk_tokens": tokens,
        "reasoning_chunks": reasoning_chunks,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "osl": completion_tokens if completion_tokens is not None else sum(tokens),
        "error_class": error_class,
        "error_message": None if error_class is None else f"{error_class} happened",
        "warning_class": None,
        "warning_message": None,
        "target": None,
    }


def write_run(
    path: Path,
    records: list[dict[str, Any]],
    manifest: dict[str, Any] | None = None,
    metrics: list[dict[str, Any]] | None = None,
) -> Path:
    """Write manifest.json, records/ and (optionally) metrics/ the way replay does."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_bytes(orjson.dumps(manifest or BASE_MANIFEST))
    with PartWriter(path / "records", RECORD_SCHEMA) as writer:
        writer.add_many(records)
    if metrics:
        with PartWriter(path / "metrics", METRICS_SCHEMA) as writer:
            writer.add_many(metrics)
    return path


def synthetic_records(
    seed: int,
    *,
    sessions: int = 20,
    per_session: int = 8,
    itl_scale: float = 1.0,
    ttft_scale: float = 1.0,
    osl: int = 6,
) -> list[dict[str, Any]]:
    """Sessions of successful requests with lognormal ITLs and TTFTs (per-token chunks).

    Drawn per session from `seed` so two calls with the same seed and different scales give
    the same requests, only faster or slower.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    records = []
    t = 0.0
    for s in range(sessions):
        session_itl = rng.lognormal(-4.0, 0.3)
        for k in range(per_session):
            itl = session_itl * rng.lognormal(0.0, 0.2) * itl_scale
            ttft = rng.lognormal(-1.0, 0.5) * ttft_scale
            times = [ttft + i * itl for i in range(osl)]
            records.append(
                rec(
                    f"s{s}-r{k}",
                    session_id=f"s{s:03d}",
                    lane=s % 4,
                    turn=k,
                    sent_s=t,
                    planned_s=t,
                    chunk_times_s=times,
                    chunk_tokens=[1] * osl,
                    completion_tokens=osl,
                    prompt_tokens=1000 + 100 * k,
                    cached_tokens=64 * k,
                )
            )
            t += 0.25
    return records

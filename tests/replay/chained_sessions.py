"""Small workloads for replays against real `agentab serve` processes: sessions of short turns
whose hash ids chain, so every turn after the first hits the prefix cache of the engine that
served the session before (quick to serve on the real clock)."""

from __future__ import annotations

from pathlib import Path

from agentab.workloads.io import save
from agentab.workloads.model import Request, Session, Workload


def chained_session(i: int, *, turns: int, gap_s: float, out_step: int) -> Session:
    """Session `s{i}`: `turns` turns `gap_s` apart, each 4 hash blocks (64 tokens a block)
    longer than the one before, with 8 + `out_step` * k tokens out at turn k."""
    items = []
    ids: tuple[int, ...] = ()
    for k in range(turns):
        ids = (*ids, *range(1000 * i + 10 * k, 1000 * i + 10 * k + 4))
        items.append(
            Request(t=gap_s * k, in_tokens=len(ids) * 64, out_tokens=8 + out_step * k, hash_ids=ids)
        )
    return Session(f"s{i}", 64, tuple(items))


def save_chained(path: Path, sessions: int, *, turns: int, gap_s: float, out_step: int) -> Path:
    """A workload of `sessions` chained sessions written to `path`."""
    save(Workload(tuple(
        chained_session(i, turns=turns, gap_s=gap_s, out_step=out_step) for i in range(sessions)
    )), path)  # fmt: skip
    return path

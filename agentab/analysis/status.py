"""Whether a run finished, read from its manifest: analysis refuses unfinished runs by default.

Replay writes `status: running` before the first request and rewrites it with the outcome at the
end (`completed`, `interrupted`, `error_rate`, `write_error`). A run killed with SIGKILL, or one
still going, keeps `running`: its records stop at an arbitrary point and its profiling window is
cut short, so a headline from it would be a confident number about a different experiment. The
manifest also names the process that wrote it (`writer.pid`, `writer.host`), which tells a run
still in progress on this host from one whose writer is gone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentab.errors import AgentabError

COMPLETED = "completed"
_WHY: dict[str, str] = {
    "interrupted": "interrupted by a signal before its window ended",
    "error_rate": "stopped early: its error rate exceeded --max-error-rate",
    "write_error": "stopped early: its records could not be written",
    "failed": "failed",
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def describe_status(manifest: dict[str, Any]) -> str | None:
    """None for a completed run, else what the run's status means, in a few words."""
    status = manifest.get("status")
    if status == COMPLETED:
        return None
    if status == "running":
        writer = manifest.get("writer")
        if isinstance(writer, dict) and writer.get("host") == socket.gethostname():
            pid = writer.get("pid")
            if isinstance(pid, int) and pid > 0 and pid != os.getpid() and _alive(pid):
                return f"running: still in progress (process {pid})"
            return "running: never finalised (its process is gone: killed or crashed)"
        return "running: still in progress, or killed before its manifest was finalised"
    if status is None:
        return "no status in the manifest (not written by a finished replay)"
    return f"{status}: {_WHY.get(str(status), 'not completed')}"


BEHIND_PLAN_BOUND_MS = 10.0
"""A run whose replay client sent its requests more than this late at P90 (the manifest's
`clients[].behind_plan_ms`, `agentab.replay.client_load`) measured a saturated client, not the
server: analysis refuses it. The default of the replay option `max_behind_plan_ms`, which the
manifest records and the check reads (a host whose server shares the client's cores, such as a
CPU build serving on the client's machine, is late for the server's sake and may set more).
A client that keeps up sends within about a millisecond of plan;
P90, not the maximum, so that one pause (a page fault, a neighbour's burst) does not refuse a
run, while a loop that is late for a tenth of its dispatches does."""


def behind_plan(manifest: dict[str, Any]) -> str | None:
    """None when every client of the run kept to its plan, else which one did not, by how much."""
    clients = manifest.get("clients")
    if not isinstance(clients, list) or not clients:
        return None
    worst: tuple[float, dict[str, Any]] | None = None
    for client in clients:
        late = (client.get("behind_plan_ms") or {}).get("p90") if isinstance(client, dict) else None
        if isinstance(late, int | float) and (worst is None or late > worst[0]):
            worst = (float(late), client)
    replay = manifest.get("replay")
    bound = BEHIND_PLAN_BOUND_MS
    if isinstance(replay, dict) and isinstance(replay.get("max_behind_plan_ms"), int | float):
        bound = float(replay["max_behind_plan_ms"])
    if worst is None or worst[0] <= bound:
        return None
    late, client = worst
    lag = (client.get("loop_lag_ms") or {}).get("p90")
    lag_text = f", its event loop {lag:.1f} ms late at P90" if isinstance(lag, int | float) else ""
    return (
        f"its replay client {client.get('client', 0) + 1} of {len(clients)} fell behind its plan: "
        f"requests sent {late:.1f} ms late at P90 (bound {bound:g} ms, the replay's "
        f"max_behind_plan_ms){lag_text}; "
        "the timings measure the client, not the server: replay with more client processes "
        "(--clients N)"
    )


def incomplete_runs(runs: Sequence[tuple[Path, dict[str, Any]]]) -> list[str]:
    """`PATH (status: why)` for every run of `runs` that did not complete."""
    out = []
    for path, manifest in runs:
        why = describe_status(manifest)
        if why is not None:
            out.append(f"{path} ({why})")
    return out


def require_completed(runs: Sequence[tuple[Path, dict[str, Any]]], allow: bool) -> list[str]:
    """Refuse unfinished runs (one line naming the first and its status) unless `allow`.

    Returns the unfinished runs' descriptions, which a report allowed to use them shows in its
    first line.
    """
    bad = incomplete_runs(runs)
    if bad and not allow:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise AgentabError(
            f"{bad[0]}{more}: refusing to report on an unfinished run "
            "(pass --allow-incomplete to use it anyway)"
        )
    for path, manifest in runs:
        why = behind_plan(manifest)
        if why is None:
            continue
        if not allow:
            raise AgentabError(
                f"{path}: refusing to report on this run: {why} (pass --allow-incomplete to use "
                "it anyway)"
            )
        bad.append(f"{path} ({why})")
    return bad


def incomplete_line(descriptions: Sequence[str]) -> str:
    """The first line of a report that uses unfinished runs (--allow-incomplete)."""
    return (
        f"**INCOMPLETE RUN(S)**: {'; '.join(descriptions)}. Their records stop early; "
        "figures from them do not describe a full profiling window."
    )

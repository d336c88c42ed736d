"""Joining a Ray cluster (`--ray ADDRESS`), for the commands that put work on one: the runs
of `agentab ab` (`agentab.experiments.ray_cluster`) and the clients of `agentab replay`
(`agentab.replay.ray_clients`).

`ADDRESS`: `local` starts a cluster inside this process (`ray.init(num_cpus=...)`, for a
laptop or CI), `auto` joins the cluster this host belongs to (`ray start --head` ran here),
`HOST:PORT` a head node's GCS, `ray://HOST:10001` a cluster through Ray Client.
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path
from typing import Any

from agentab.errors import AgentabError, error_line
from agentab.extras import require

LOCAL = "local"


def write_files(run_dir: Path, files: dict[str, bytes]) -> None:
    """A received run dir, written where the run belongs (a leftover attempt removed first)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    for rel, data in files.items():
        path = run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse, in one line and within `timeout_s`, a `HOST:PORT` (or `ray://HOST:PORT`) that
    accepts no connection: Ray itself retries such an address for minutes, logging as it goes.
    `local`, `auto` and addresses of other forms are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise AgentabError(
            f"--ray {address}: cannot join the cluster: {host}:{port}: {reason}"
        ) from None


def connect(address: str, num_cpus: int | None) -> int:
    """Join (or, for `local`, start) the cluster; return its CPU count.

    Raises AgentabError with the install command when ray is missing, and a one-line error
    naming --ray when the cluster cannot be reached."""
    require("ray", "--ray", extra="ray")
    import ray

    # Ray's own INFO and WARNING lines (cluster start, token setup) would bury the progress
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.ERROR,
    }
    if address == LOCAL:
        kwargs["num_cpus"] = num_cpus
    else:
        check_reachable(address)
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise AgentabError(f"--ray {address}: cannot join the cluster: {error_line(exc)}") from None
    return max(1, int(ray.cluster_resources().get("CPU", 1)))

"""`agentab serve --replicas N`: N independent engine replicas, one process and one port each.

Why: one `agentab serve` is one process with one event loop, so it writes a bounded number of
chunks a second (docs/scale-out.md); a real deployment past one engine runs data-parallel
replicas behind a load balancer. Each replica here is a whole `agentab serve` in a spawned
process (its own engine, its own /metrics, /health and, with --record-emissions, its own
/agentab/emissions) on port base + i, and `agentab replay --url` repeated spreads sessions over
them.

The supervising process only starts, watches and stops them: a replica that ends while the
others serve (a crash, a port already taken) ends the whole command with one line naming it and
a non-zero status, so a run never goes on against fewer replicas than asked for.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, cast

import click

from agentab.errors import AgentabError

EXIT_REPLICA_FAILED = 1
STOP_GRACE_S = 30.0


def replica_ports(port: int, replicas: int) -> list[int]:
    """Port of each replica: base + i, or 0 for all (each picks a free one) when base is 0."""
    if port == 0:
        return [0] * replicas
    if port + replicas - 1 > 65535:
        raise AgentabError(
            f"--port {port} --replicas {replicas}: replica ports {port}..{port + replicas - 1} "
            "pass 65535"
        )
    return [port + i for i in range(replicas)]


def _replica_main(serve_one: Callable[[dict[str, Any]], None], kw: dict[str, Any]) -> None:
    """One replica's process: the serve of one engine; an error is one line and exit 2. Its
    bound port goes back over `kw['announce']` (a pipe), so that the supervisor can name a
    replica on a free port (--port 0) when it ends."""
    # the supervisor forwards SIGTERM; a terminal's Ctrl-C reaches every process of the group
    try:
        serve_one(kw)
    except AgentabError as exc:
        click.echo(f"agentab serve: replica {kw['replica']}: error: {exc}", err=True)
        sys.exit(exc.exit_code)


def serve_replicas(serve_one: Callable[[dict[str, Any]], None], kw: dict[str, Any]) -> None:
    """Run `serve_one(kw)` in `kw['replicas']` spawned processes, port base + i each, until
    SIGINT/SIGTERM (forwarded to every replica) or until one replica ends on its own (the
    others are stopped and the command exits 1, naming it)."""
    replicas = kw["replicas"]
    ports = replica_ports(kw["port"], replicas)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    announced = []
    for i, port in enumerate(ports):
        mine, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_replica_main,
            args=(serve_one, {**kw, "port": port, "replica": i, "announce": theirs}),
            name=f"agentab-serve-replica-{i}",
        )
        proc.start()
        theirs.close()
        procs.append(proc)
        announced.append(mine)
    stopping: list[int] = []

    def terminate_all() -> None:
        for proc in procs:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.terminate()

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)
        terminate_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed: tuple[int, int | None] | None = None
    try:
        alive = {p.sentinel: i for i, p in enumerate(procs)}
        while alive:
            for sentinel in wait(list(alive), timeout=1.0):
                i = alive.pop(cast(int, sentinel))  # the sentinels given: ints
                procs[i].join()
                if not stopping and failed is None:  # it ended on its own: stop the others
                    failed = (i, procs[i].exitcode)
                    terminate_all()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            proc.join(STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failed is not None:
        i, code = failed
        bound = ports[i] or _announced_port(announced[i])
        where = f"port {bound}" if bound else "before it listened"
        raise AgentabError(
            f"--replicas {replicas}: replica {i} ({where}) exited with status {code} while the "
            "others served; stopped them all",
            exit_code=EXIT_REPLICA_FAILED,
        )
    click.echo(f"agentab serve: {replicas} replicas stopped")


def _announced_port(conn: Any) -> int | None:
    """The port a replica said it listens on (None: it ended before saying)."""
    with contextlib.suppress(EOFError, OSError):
        if conn.poll():
            return int(conn.recv())
    return None

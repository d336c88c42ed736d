"""The client processes of a sharded replay as Ray actors, spread over a cluster's nodes
(`agentab replay --clients N --ray ADDRESS`).

Why: one host has so many cores; a load that needs more client loops than a host (or than the
cores the server leaves free) needs client hosts. Ray places the actors (one CPU each, the
`SPREAD` strategy: as many nodes as it can) and carries the messages; each actor runs the
client of `--clients` (`agentab.replay.shards._client_main`) in a spawned process of its own,
the same code and protocol as on one host, and relays its messages to the coordinator here.

What changes between hosts:
- the clock: hosts share no monotonic clock, so the coordinator gives the common start (and the
  profiling window's opening) in wall-clock time, and each actor turns it into its host's
  monotonic time (`time.time() - time.monotonic()`, read at the start). The start is then as
  aligned as the hosts' wall clocks are (NTP: typically well under a millisecond on one
  network); each client's entry of the manifest records its node, its host and that offset
  (`clock`);
- the disk: the nodes share none with the coordinator, so each client writes its records into
  a temporary dir on its node, and its actor sends the new part files back about every second;
  they land under `clients/<k>/` of the run dir as on one host, and are merged exactly as a
  local run's (at the end, or, if the coordinator is killed, when the run dir is next opened).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentab.errors import AgentabError, error_line
from agentab.ray_connect import LOCAL, connect, write_files
from agentab.replay.shards import ClientJob, _client_main
from agentab.rundir import METRICS_DIR, RECORDS_DIR
from agentab.rundir.clients import CLIENTS_DIR
from agentab.rundir.parts import atomic_write_bytes
from agentab.workloads.model import Workload

COLLECT_INTERVAL_S = 1.0
"""How often the coordinator asks each actor for the parts its client wrote since."""

RAY_START_DELAY_S = 1.0
"""The common start is this far after the last client is ready: time for the start message
to reach every node (Ray's actor calls take milliseconds; a start that arrives late is
recorded, as any client's, in its `behind_plan_ms`)."""


class ClientActor:
    """A Ray actor relaying between the coordinator and one client process on its node.

    Threaded (`max_concurrency`): `recv` blocks on the client's pipe while `send` forwards
    the coordinator's messages, which carry a sequence number because a threaded actor may run
    two calls out of their order of submission."""

    def __init__(self) -> None:
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.tmp = Path(tempfile.mkdtemp(prefix="agentab-client-"))
        self.folder = self.tmp
        self.conn: Any = None
        self.proc: Any = None
        self.offset = 0.0  # wall minus monotonic, read when the start arrives
        self.start_wall: float | None = None
        self._lock = threading.Lock()
        self._next = 0
        self._held: dict[int, tuple[Any, ...]] = {}
        self._sent: set[str] = set()
        self._sent_lock = threading.Lock()

    def launch(self, job: ClientJob, workload: Workload) -> dict[str, Any]:
        """Start the client process (the same one `--clients` starts on one host)."""
        self.folder = self.tmp / str(job.client)
        job = dataclasses.replace(job, workload=workload, folder=self.folder)
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.proc = context.Process(
            target=_client_main, args=(job, theirs), name=f"agentab-client-{job.client}"
        )
        self.proc.start()
        theirs.close()
        return {"host": socket.gethostname(), "node": self.node}

    def recv(self) -> tuple[Any, ...]:
        """The client's next message, its times turned to wall-clock; `("eof",)` at its end."""
        try:
            message: tuple[Any, ...] = self.conn.recv()
        except (EOFError, OSError):
            return ("eof",)
        if message[0] == "warmup":
            return ("warmup", message[1] + self.offset)
        if message[0] == "done":
            clock = {
                "sync": "wall",
                "start_wall_s": self.start_wall,
                "wall_minus_monotonic_s": self.offset,
            }
            return ("done", message[1], {**message[2], "node": self.node, "clock": clock},
                    message[3])  # fmt: skip
        return message

    def send(self, seq: int, message: tuple[Any, ...]) -> None:
        """Forward the coordinator's messages in the order it sent them."""
        with self._lock:
            self._held[seq] = message
            while self._next in self._held:
                self._forward(self._held.pop(self._next))
                self._next += 1

    def _forward(self, message: tuple[Any, ...]) -> None:
        if message[0] == "start":
            self.offset = time.time() - time.monotonic()
            self.start_wall = message[1]
            message = ("start", message[1] - self.offset)
        elif message[0] == "open":
            message = ("open", message[1] - self.offset)
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(message)

    def terminate(self) -> None:
        if self.proc is not None:
            self.proc.terminate()

    def new_parts(self) -> dict[str, bytes]:
        """The part files the client wrote since the last call (relative path -> bytes).

        A part is written once, under its final name, and never changed: a file compaction
        removed since it was listed is covered by the wider part that replaced it, sent on a
        later call (`agentab.rundir.parts.part_files` reads the wider one alone)."""
        with self._sent_lock:  # not `_lock`: the coordinator's messages do not wait on a read
            out = self._parts(skip=self._sent)
            self._sent.update(out)
        return out

    def files(self) -> dict[str, bytes]:
        """Every part file of the client (relative path -> bytes), once its process has ended."""
        if self.proc is not None:
            self.proc.join()
        return self._parts(skip=set())

    def _parts(self, skip: set[str]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for sub in (RECORDS_DIR, METRICS_DIR):
            for path in sorted((self.folder / sub).glob("part-*.arrow")):
                rel = str(path.relative_to(self.folder))
                if rel in skip:
                    continue
                try:
                    out[rel] = path.read_bytes()
                except FileNotFoundError:  # merged into a wider part meanwhile
                    continue
        return out

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class _ActorLink:
    """The coordinator's line to one actor (`agentab.replay.shards._Link`)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.seq = 0
        self.ref = actor.recv.remote()

    def send(self, message: tuple[Any, ...]) -> None:
        self.actor.send.remote(self.seq, message)
        self.seq += 1

    def recv(self) -> tuple[Any, ...]:
        import ray

        try:
            message: tuple[Any, ...] = ray.get(self.ref)
        except ray.exceptions.RayError:  # the actor or its node died
            raise EOFError from None
        if message[0] == "eof":
            raise EOFError
        self.ref = self.actor.recv.remote()
        return message

    def terminate(self) -> None:
        self.actor.terminate.remote()


class RayFleet:
    """The clients as Ray actors (`agentab.replay.shards.Fleet`); the start in wall-clock time."""

    start_delay_s = RAY_START_DELAY_S

    def __init__(self, jobs: list[ClientJob], run_dir: Path, log: Callable[[str], None] | None):
        import ray

        self.run_dir = run_dir
        self._fetching: dict[int, Any] = {}  # client -> its new_parts call in flight
        self._collected = time.monotonic()
        actor_class: Any = ray.remote(ClientActor).options(
            num_cpus=1, max_concurrency=8, max_restarts=0, scheduling_strategy="SPREAD"
        )
        workload = ray.put(jobs[0].workload)  # once through the object store, not per client
        empty = Workload(())
        self.actors: list[Any] = [actor_class.remote() for _ in jobs]
        try:
            where = ray.get(
                [
                    actor.launch.remote(dataclasses.replace(job, workload=empty), workload)
                    for actor, job in zip(self.actors, jobs, strict=True)
                ]
            )
        except ray.exceptions.RayError as exc:
            self._kill()
            raise AgentabError(f"--ray: cannot start the clients: {error_line(exc)}") from None
        self.links = [_ActorLink(actor) for actor in self.actors]
        if log is not None:
            hosts: dict[str, list[int]] = {}
            for k, w in enumerate(where):
                hosts.setdefault(w["host"], []).append(k)
            placed = ", ".join(
                f"{host} (clients {', '.join(map(str, ks))})" for host, ks in hosts.items()
            )
            nodes = len({w["node"] for w in where})
            log(f"replay: {len(jobs)} clients as Ray actors on {nodes} node(s) of {len(hosts)} "
                f"host(s): {placed}")  # fmt: skip

    def clock(self) -> float:
        return time.time()

    def wait(self, links: list[Any], timeout_s: float) -> list[Any]:
        import ray

        by_ref = {link.ref: link for link in links}
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
        self._collect()
        return [by_ref[ref] for ref in ready]

    def _collect(self) -> None:
        """Bring the parts the clients wrote since the last time here, under `clients/<k>/`,
        about every `COLLECT_INTERVAL_S`: a coordinator killed outright loses only the last
        moments (`agentab.rundir.clients.recover_clients` merges what arrived)."""
        import ray

        for k, ref in list(self._fetching.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._fetching[k]
            try:
                files = ray.get(ref)
            except ray.exceptions.RayError:  # the actor is gone; `finish` says what is left
                continue
            for rel, data in files.items():
                path = self.run_dir / CLIENTS_DIR / str(k) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, data)
        now = time.monotonic()
        if now - self._collected >= COLLECT_INTERVAL_S:
            self._collected = now
            for k, actor in enumerate(self.actors):
                if k not in self._fetching:
                    self._fetching[k] = actor.new_parts.remote()

    def finish(self) -> None:
        """Bring every client's part files here, under `clients/<k>/`; end the actors."""
        import ray

        try:
            for k, actor in enumerate(self.actors):
                try:
                    files = ray.get(actor.files.remote())
                except ray.exceptions.RayError:  # its node is gone, and its records with it
                    continue
                if files:
                    write_files(self.run_dir / CLIENTS_DIR / str(k), files)
        finally:
            self._kill()

    def _kill(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        ray.shutdown()


def ray_fleet(
    address: str, clients: int, run_dir: Path, log: Callable[[str], None] | None
) -> Callable[[list[ClientJob]], RayFleet]:
    """Join the cluster at `address` (`local`: start one of `clients` CPUs in this process)
    and check it has a CPU per client; the fleet is made by the coordinator."""
    cpus = connect(address, clients if address == LOCAL else None)
    if cpus < clients:
        import ray

        ray.shutdown()
        raise AgentabError(
            f"--ray {address}: the cluster has {cpus} CPU(s), fewer than the {clients} clients "
            "(each client takes one)"
        )
    return lambda jobs: RayFleet(jobs, run_dir, log)

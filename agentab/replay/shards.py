"""One replay plan sent by several client processes (`agentab replay --clients N`).

Why: one Python process spends microseconds of CPU per streamed chunk, so a large deployment's
load (thousands of concurrent sessions) saturates its event loop, and a saturated client times
its own lateness, not the server's (`agentab.replay.client_load`). Split by lane over N
processes, the same plan has N loops to carry it.

How the clients stay one run:
- one plan: every client builds the same plan from the same workload and options (one prompt
  salt, drawn here), and plays the plays whose lane is its index modulo N (open loop: the
  arrivals whose play index is); request ids and salts are the plan's, as in one process;
- one clock: the clients start when all are connected, at one `loop.time()` (the monotonic
  clock, shared by the processes of one host), so every record's times count from one t0;
- one profiling window: each client reports when its warmup requests are over; the window
  opens for all when the last one is (as one process opens it after its last warmup);
- one run dir: each client writes its records under `clients/<k>/` as it goes; at the end they
  are merged into `records/` (and client 0's metric scrapes into `metrics/`), the manifest's
  counters are summed, and `clients` lists each process's load and lag
  (`agentab.rundir.clients`; a run dir whose coordinator was killed is merged when next opened).
Where the clients run is a `Fleet`: processes of this host (`LocalFleet`), or Ray actors on a
cluster's hosts (`agentab.replay.ray_clients.RayFleet`), with the same messages.
What stays per client: idle compression (each compresses on its own in-flight state; under a
load that needs several clients the run is never idle) and the error-rate guard (a client that
stops the run stops the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from agentab.clock import run_real
from agentab.dir_lock import lock_dir, release_dir
from agentab.errors import AgentabError, error_line
from agentab.replay.api import (
    _backend_label,
    _gc_frozen,
    _raise_if_failed,
    _status,
    close_run_io,
    first_request,
    runner_load,
    target_urls,
)
from agentab.replay.client_load import LoopLag
from agentab.replay.eager import eager_tasks
from agentab.replay.manifest import build_manifest, now_iso, prepare_run_dir
from agentab.replay.metrics import scrape_loop, scrape_worker
from agentab.replay.options import ReplayOptions, new_prompt_salt
from agentab.replay.plan import build_plan
from agentab.replay.runner import Runner, RunStats
from agentab.rundir import (
    METRICS_DIR,
    METRICS_SCHEMA,
    RECORD_SCHEMA,
    RECORDS_DIR,
    PartWriter,
    write_manifest,
)
from agentab.rundir.clients import CLIENTS_DIR, merge_clients
from agentab.workloads.model import Workload

START_DELAY_S = 0.5
"""The common start is this far after the last client is ready: time for the start message
to reach every client before it is due."""
_STOP_ORDER = ("interrupted", "write_error", "error_rate", "max_requests", "duration", "completed")


@dataclass(frozen=True)
class ClientJob:
    """What one client process needs: the whole plan's inputs, and which share is its own."""

    client: int
    clients: int
    workload: Workload
    replay: ReplayOptions
    urls: tuple[str, ...]
    model: str | None
    api_key_env: str | None
    folder: Path
    scrape: bool


class _Parent:
    """A client's line to the coordinating process, read on the client's loop."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.loop = loop
        self.inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.runner: Runner | None = None
        loop.add_reader(conn.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            message = self.conn.recv()
        except EOFError:  # the coordinator is gone: stop sending load nobody will record
            self.loop.remove_reader(self.conn.fileno())
            message = ("abort", "interrupted", "the coordinating process ended")
        if message[0] == "open" and self.runner is not None:
            self.runner.open_window(message[1])
        elif message[0] == "abort" and self.runner is not None:
            self.runner.abort(message[1], message[2])
        else:
            self.inbox.put_nowait(message)

    def warmup_over(self, t: float) -> None:
        self.conn.send(("warmup", t))

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.conn.fileno())


async def _client(job: ClientJob, conn: Connection) -> None:
    from agentab.replay.targets.http import api_key_from_env
    from agentab.replay.targets.routed import routed_target

    loop = asyncio.get_running_loop()
    parent = _Parent(conn, loop)
    plan = build_plan(job.workload, job.replay)
    target = routed_target(
        job.urls,
        model=job.model,
        endpoint=job.replay.endpoint,
        api_key=api_key_from_env(job.api_key_env),
        timeout_s=job.replay.request_timeout_s,
    )
    records: PartWriter | None = None
    metrics: PartWriter | None = None
    scraper: asyncio.Task[None] | None = None
    stop_scrape = asyncio.Event()
    try:
        await target.start()
        # held until this process ends: a reader merging `clients/` after a lost coordinator
        # waits for the clients still writing (`recover_clients`)
        lock_dir(job.folder, "agentab replay client", "--out")
        records = PartWriter(job.folder / RECORDS_DIR, RECORD_SCHEMA)
        runner = Runner(plan, target, records, shard=(job.client, job.clients), window=parent)
        spec = first_request(plan, job.client, job.clients)
        if spec is not None:
            target.warm(spec)  # the prompt builder's first-use compile, before the common start
        if job.scrape:
            scrape_worker()  # its thread started before the common start
        conn.send(("ready", target.describe()))
        kind, start_at = await parent.inbox.get()
        assert kind == "start"
        runner.start_at = start_at
        parent.runner = runner
        if job.scrape:
            metrics = PartWriter(job.folder / METRICS_DIR, METRICS_SCHEMA)
            scraper = loop.create_task(
                scrape_loop(
                    target.scrape,
                    metrics,
                    t0=start_at,
                    interval_s=job.replay.scrape_interval_s,
                    stop=stop_scrape,
                )
            )
        with _gc_frozen(loop), eager_tasks(loop):
            lag = LoopLag(loop)  # after the freeze's collection
            stats = await runner.run()
        lag.stop()
        conn.send(("done", stats, runner_load(runner, job.client, lag), runner.t0))
    finally:
        parent.close()
        await close_run_io(stop_scrape, scraper, records, metrics, target)


def _client_main(job: ClientJob, conn: Connection) -> None:
    """A client process: run its share, report; an error goes back as one line."""
    try:
        run_real(_client(job, conn))
    except BaseException as exc:  # the coordinator reports it and stops the other clients
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", error_line(exc)))
        raise SystemExit(1) from None


def check_clients(clients: int, replay: ReplayOptions) -> None:
    """Refuse, before any process starts, a split that cannot keep one plan's rules."""
    if clients < 2:
        return
    if replay.max_requests is not None:
        raise AgentabError(
            f"--clients {clients}: --max-requests counts over all lanes at once, which separate "
            "client processes cannot share; stop the run with --duration, --lane-requests or "
            "--passes"
        )
    if not replay.open_loop and replay.concurrency < clients:
        raise AgentabError(
            f"--clients {clients}: more client processes than lanes (--concurrency "
            f"{replay.concurrency}); each client plays whole lanes"
        )


def merged_stats(parts: list[RunStats]) -> RunStats:
    """The run's account from its clients': counters summed, the most serious stop kept."""
    out = RunStats()
    for s in parts:
        out.dispatched += s.dispatched
        out.finished += s.finished
        out.errors += s.errors
        out.cancelled += s.cancelled
        out.completion_tokens += s.completion_tokens
        out.warmup += s.warmup
        out.error_classes += s.error_classes
        out.warning_classes += s.warning_classes
        for cls, message in s.first_errors.items():
            out.first_errors.setdefault(cls, message)
        out.elapsed_s = max(out.elapsed_s, s.elapsed_s)
        if s.profiling_start_s is not None:
            out.profiling_start_s = max(out.profiling_start_s or 0.0, s.profiling_start_s)
    worst = min(parts, key=lambda s: _rank(s.stop_reason))
    out.stop_reason, out.message, out.signal = worst.stop_reason, worst.message, worst.signal
    out.error_classes = Counter(dict(sorted(out.error_classes.items())))
    return out


def _rank(reason: str) -> int:
    return _STOP_ORDER.index(reason) if reason in _STOP_ORDER else len(_STOP_ORDER)


def sharded_replay_to_dir(
    workload: Workload,
    *,
    url: str | Sequence[str],
    replay: ReplayOptions,
    out_dir: str | Path,
    clients: int,
    model: str | None = None,
    api_key_env: str | None = None,
    manifest_extra: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    ray_address: str | None = None,
) -> Path:
    """`replay_to_dir` with the plan's lanes spread over `clients` processes; one run dir.

    `ray_address`: the clients run as Ray actors spread over that cluster's nodes
    (`agentab.replay.ray_clients`) instead of as processes of this host."""
    check_clients(clients, replay)
    urls = target_urls(url, api_key_env)
    if ray_address is not None and clients < 2:
        raise AgentabError(
            f"--ray {ray_address}: places the client processes of --clients N (N > 1) on a "
            "Ray cluster; add --clients"
        )
    if replay.prompt_salt is None:  # one salt for all: the clients send one plan's prompts
        replay = dataclasses.replace(replay, prompt_salt=new_prompt_salt())
    build_plan(workload, replay)  # a plan that cannot be built fails here, not in N processes
    if workload.num_requests() == 0:
        raise AgentabError(f"{workload.source or 'workload'}: no requests to replay")
    lock_dir(Path(out_dir), "agentab replay", "--out")
    try:
        run_dir = prepare_run_dir(out_dir)
        fleet_of: Callable[[list[ClientJob]], Fleet] = LocalFleet
        if ray_address is not None:
            from agentab.replay.ray_clients import ray_fleet

            fleet_of = ray_fleet(ray_address, clients, run_dir, log)
        stats = _coordinate(workload, replay, run_dir, clients, urls, model, api_key_env,
                            manifest_extra, log, fleet_of)  # fmt: skip
    finally:
        release_dir(Path(out_dir))
    _raise_if_failed(stats, replay, run_dir)
    return run_dir


class _Link(Protocol):
    """The coordinator's line to one client: a process here, or a Ray actor on some node."""

    def send(self, message: tuple[Any, ...]) -> None: ...

    def recv(self) -> tuple[Any, ...]:
        """The client's next message; EOFError when the client is gone."""
        ...

    def terminate(self) -> None: ...


class Fleet(Protocol):
    """The client processes of one sharded run, wherever they run."""

    links: list[Any]
    start_delay_s: float

    def clock(self) -> float:
        """Now, on the clock the `start` and `open` messages are given in."""
        ...

    def wait(self, links: list[Any], timeout_s: float) -> list[Any]:
        """The links among `links` with a message (or an end) to read."""
        ...

    def finish(self) -> None:
        """Wait for every client to end; leave its records under `clients/<k>/`."""
        ...


class _ProcessLink:
    def __init__(self, conn: Connection, proc: Any) -> None:
        self.conn = conn
        self.proc = proc

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send(message)

    def recv(self) -> tuple[Any, ...]:
        message: tuple[Any, ...] = self.conn.recv()
        return message

    def terminate(self) -> None:
        self.proc.terminate()


class LocalFleet:
    """Spawned processes on this host: one monotonic clock, and the run dir's own disk (each
    client writes its records under `clients/<k>/` directly)."""

    start_delay_s = START_DELAY_S

    def __init__(self, jobs: list[ClientJob]) -> None:
        context = multiprocessing.get_context("spawn")  # a clean interpreter per client
        self.links: list[_ProcessLink] = []
        for job in jobs:
            mine, theirs = context.Pipe()
            proc = context.Process(
                target=_client_main, args=(job, theirs), name=f"agentab-client-{job.client}"
            )
            proc.start()
            theirs.close()
            self.links.append(_ProcessLink(mine, proc))

    def clock(self) -> float:
        return time.monotonic()

    def wait(self, links: list[Any], timeout_s: float) -> list[Any]:
        by_conn = {link.conn: link for link in links}
        return [by_conn[c] for c in wait(list(by_conn), timeout_s)]

    def finish(self) -> None:
        for link in self.links:
            link.proc.join()


def _coordinate(
    workload: Workload,
    replay: ReplayOptions,
    run_dir: Path,
    clients: int,
    urls: tuple[str, ...],
    model: str | None,
    api_key_env: str | None,
    manifest_extra: dict[str, Any] | None,
    log: Callable[[str], None] | None,
    fleet_of: Callable[[list[ClientJob]], Fleet],
) -> RunStats:
    folders = [run_dir / CLIENTS_DIR / str(k) for k in range(clients)]
    scrape = replay.scrape_metrics
    jobs = [
        ClientJob(k, clients, workload, replay, urls, model, api_key_env, f, scrape and k == 0)
        for k, f in enumerate(folders)
    ]
    fleet = fleet_of(jobs)
    links: list[_Link] = list(fleet.links)
    index = {id(link): k for k, link in enumerate(links)}
    results: dict[int, tuple[RunStats, dict[str, Any], float]] = {}
    errors: dict[int, str] = {}
    warmups: dict[int, float] = {}
    facts: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None

    def broadcast(message: tuple[Any, ...]) -> None:
        for k, link in enumerate(links):
            if k not in results and k not in errors:
                with contextlib.suppress(OSError):
                    link.send(message)

    caught: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        caught.append(signum)
        broadcast(("abort", "interrupted", f"interrupted by {signal.Signals(signum).name}"))

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    ready = 0
    start_at = None
    try:
        open_links = list(links)
        while open_links:
            for link in fleet.wait(open_links, 0.2):
                k = index[id(link)]
                try:
                    message = link.recv()
                except (EOFError, OSError):  # the client ended (or was ended) without a word
                    open_links.remove(link)
                    if k not in results and k not in errors:
                        errors[k] = f"client process {k} ended without a result"
                        broadcast(("abort", "interrupted", f"client {k} failed: {errors[k]}"))
                    continue
                kind = message[0]
                if kind == "ready":
                    ready += 1
                    if k == 0:
                        facts = message[1]
                    if ready == clients and not errors:
                        assert facts is not None
                        extra = {**(manifest_extra or {}), **_backend_label(facts, manifest_extra)}
                        manifest = build_manifest(
                            workload, replay, run_dir, target_facts=facts, manifest_extra=extra
                        )
                        write_manifest(run_dir, manifest)
                        start_at = fleet.clock() + fleet.start_delay_s
                        if log is not None:
                            log(f"replay: {clients} client processes, lanes split by client "
                                f"index modulo {clients}, starting together")  # fmt: skip
                        broadcast(("start", start_at))
                elif kind == "warmup":
                    warmups[k] = message[1]
                    if len(warmups) == clients:
                        broadcast(("open", max(warmups.values())))
                elif kind == "done":
                    results[k] = (message[1], message[2], message[3])
                elif kind == "error":
                    errors[k] = message[1]
                    broadcast(("abort", "interrupted", f"client {k} failed: {message[1]}"))
                    if start_at is None:  # the others wait for a start that will not come
                        for other in links:
                            other.terminate()
    except BaseException:  # e.g. the server contradicts the declared decode backend
        for link in links:
            link.terminate()  # clients waiting for a start that will not come
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        fleet.finish()
    if manifest is None or len(results) < clients:
        # the first client that said what went wrong (the others may only have been ended)
        said = [k for k, e in errors.items() if not e.startswith("client process ")]
        first = said[0] if said else min(errors, default=0)
        raise AgentabError(
            f"--clients {clients}: client {first} failed before the run completed: "
            f"{errors.get(first, 'no result')}"
            + (f"; the clients' records are under {run_dir / CLIENTS_DIR}" if manifest else "")
        )
    ordered = [results[k] for k in range(clients)]
    stats = merged_stats([r[0] for r in ordered])
    if caught and stats.stop_reason == "interrupted" and stats.signal is None:
        stats.signal = caught[0]  # the exit status says which signal, as a one-process run's
    manifest.update(
        {
            "clock_t0": ordered[0][2],
            # on one host every client counts from the one monotonic clock; a Ray actor's entry
            # says how its host's clock was aligned (`agentab.replay.ray_clients`)
            "clients": [
                {**r[1], "clock": r[1].get("clock", {"sync": "monotonic"})} for r in ordered
            ],
            "status": _status(stats, replay),
            "finished_at": now_iso(),
            "stats": stats.to_dict(),
        }
    )
    merge_clients(run_dir, manifest)
    return stats

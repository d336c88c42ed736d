"""How well one, two and four replay client processes time a loaded `agentab serve`.

For each load (closed-loop lanes), each replica count (`--replicas`) and each client count, a
fresh `agentab serve --replicas R` (the simulator on the real clock, `--record-emissions`: R
independent engine processes, one port each) is started, `agentab replay --clients N` runs
against its R URLs (lane k to replica k mod R), and the script prints per run:

- the worst client's event-loop lag (P99, max) and dispatch lateness (P90, the figure the
  report refuses a run on) from the manifest;
- the ITL error: per profiling request, the client's ITL ((last chunk - first chunk) /
  (chunks - 1), from its own timestamps) against the same figure from the server's write times
  of those chunks (`/agentab/emissions` of the replica that served the request, as its record's
  `target` says; the server's monotonic clock, which the processes of one host share), as
  |client - server| / server, at P50 and P90 over requests;
- the chunk throughput: chunks received in the profiling window per second, and its ratio to
  the run with the first `--clients` value (one client by default) at the same load and replica
  count (`vs_first`): what more clients carry from one server;
- the CPU each side used in the profiling window, in cores (sampled from /proc every 0.25 s):
  the server (all its replicas together; each replica is one process with one event loop, so
  it cannot use more than one core: `server_core_max` is the busiest one's) and the clients
  (the replay and its client processes, also per chunk received: `client_us_per_chunk`, whose
  inverse is about the most chunks a second one client can take); and which side bounds the
  run: `server` when a replica used over 90% of its one core (more clients cannot add chunks
  it does not write), `host` when server and clients together used over 90% of the host's
  cores, `client` when a client fell behind its plan by more than the report's default bound
  (`max_behind_plan_ms`, 10 ms at P90) while neither saturated, else `-`.

The server shares the host's cores with the clients, so on a small machine the server may be
what saturates first; the per-process figures say which one did. Printed (and with `--json`
written as a table, one row per run), never asserted. A SIGTERM or SIGINT ends the script
and its `agentab serve` and replay children.

    python benchmarks/bench_replay_clients.py [--lanes 64 128] [--clients 1 2 4] [--replicas 1]
        [--duration 20] [--json PATH]

On a 16-core host: `--lanes 64 128 256 512 --clients 1 2 4 8`; for the chunk rate that several
clients can carry, more replicas than one client can keep up with:
`--lanes 512 --clients 1 4 --replicas 4 --layers 1` (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from agentab.workloads.io import save
from agentab.workloads.model import Request, Session, Workload

ROOT = Path(__file__).resolve().parents[1]


def session(i: int, out_tokens: int) -> Session:
    """Short prompts, long answers, back to back: the load is streamed chunks, not prefill."""
    items = []
    ids: tuple[int, ...] = ()
    for k in range(8):
        ids = (*ids, *range(1000 * i + 10 * k, 1000 * i + 10 * k + 4))
        items.append(
            Request(t=0.0, in_tokens=len(ids) * 64, out_tokens=out_tokens, hash_ids=ids, api_time=0)
        )
    return Session(f"s{i}", 64, tuple(items))


STARTED: list[subprocess.Popen[str]] = []
"""Every child started (servers and replays): `main` stops those still running on its way out,
however it leaves (a signal may come between a start and the `try` that would stop it)."""


def serve(profile: str, replicas: int) -> tuple[subprocess.Popen[str], list[str]]:
    """`agentab serve --replicas R --port 0`: the process and its replicas' URLs, replica 0
    first (each replica prints its own listening line, in whatever order they come up)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "serve", "--profile", profile, "--record-emissions",
         "--port", "0", "--replicas", str(replicas)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    STARTED.append(proc)
    assert proc.stdout is not None
    urls: dict[int, str] = {}
    while len(urls) < replicas:
        line = proc.stdout.readline()
        if "listening on http://127.0.0.1:" not in line:
            stop(proc)
            raise SystemExit(f"agentab serve did not start: {line}")
        which = re.search(r"\(replica (\d+),", line)
        url = "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0]
        urls[int(which.group(1)) if which else 0] = url
    return proc, [urls[i] for i in range(replicas)]


def replica_pids(server: subprocess.Popen[str], replicas: int) -> list[int]:
    """The processes that serve: the server itself (one replica), or its spawned replica
    children (several; not the multiprocessing helpers it may also start)."""
    if replicas == 1:
        return [server.pid]
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == server.pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_on(signum: int, frame: object) -> None:
    """SIGTERM (or SIGHUP) ends the script as Ctrl-C does: through the `finally` blocks that stop
    the server (a replay running under `subprocess.run` is killed by it on the way out)."""
    raise SystemExit(128 + signum)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of a live process and its live descendants (Linux /proc)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        grew = bool(more)
        tree |= more
    return sum(process_cpu_s(pid) or 0.0 for pid in tree)


class CpuSampler:
    """Every 0.25 s, the CPU seconds so far of each server replica and of the replay's process
    tree, so that each side's use can be taken over the profiling window alone (not the
    start-up and the drain, when both idle)."""

    def __init__(self, servers: list[int], replay: int) -> None:
        self.samples: list[tuple[float, list[float], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(servers, replay), daemon=True)
        self._thread.start()

    def _run(self, servers: list[int], replay: int) -> None:
        while not self._stop.is_set():
            self.samples.append(
                (
                    time.monotonic(),
                    [process_cpu_s(pid) or 0.0 for pid in servers],
                    tree_cpu_s(replay),
                )
            )
            self._stop.wait(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, start: float, end: float) -> tuple[list[float], float] | None:
        """(each replica's, the clients') cores used between two monotonic times; None
        without samples."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        (t0, a0, b0), (t1, a1, b1) = inside[0], inside[-1]
        return [(y - x) / (t1 - t0) for x, y in zip(a0, a1, strict=True)], (b1 - b0) / (t1 - t0)


def bound(
    server_cores: float | None,
    client_cores: float | None,
    behind_ms: float,
    cores: int,
    busiest_replica: float | None = None,
) -> str:
    """Which side saturated (see the module doc): server, client, host or -. `server_cores` is
    all replicas' together, `busiest_replica` the busiest one's (default: `server_cores`, one
    replica)."""
    busiest = server_cores if busiest_replica is None else busiest_replica
    if busiest is not None and busiest > 0.9:
        return "server"
    both = None if server_cores is None or client_cores is None else server_cores + client_cores
    if both is not None and both > 0.9 * cores:
        return "host"
    if behind_ms > 10.0:
        return "client"
    return "-"


def raise_fd_limit() -> None:
    """Hundreds of lanes hold as many sockets, in the server and in one client: the soft limit
    on open files up to the hard one (inherited by the children)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def replay(
    workload: Path,
    urls: list[str],
    out: Path,
    lanes: int,
    clients: int,
    duration: float,
    servers: list[int],
) -> CpuSampler:
    """Run the replay; return the CPU samples taken while it ran."""
    targets = [arg for url in urls for arg in ("--url", url)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "replay", str(workload), *targets, "--out", str(out),
         "--concurrency", str(lanes), "--duration", str(duration), "--warmup-requests", "1",
         "--drain", "5", "--clients", str(clients), "--quiet", "--prompt-salt", "bench"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    STARTED.append(proc)
    sampler = CpuSampler(servers, proc.pid)
    try:
        _, stderr = proc.communicate()
    except BaseException:  # stopped: the replay stops its clients and ends too
        stop(proc)
        raise
    finally:
        sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"replay --clients {clients} failed:\n{stderr[-3000:]}")
    return sampler


def itl_errors(run: Path, emissions: list[dict[str, list[float]]]) -> np.ndarray:
    """Per request, the ITL error against the emissions of the replica that served it (the
    record's `target`: an index into the replicas' URLs)."""
    from agentab.rundir import scan_records

    records = (
        scan_records(run)
        .filter((pl.col("phase") == "profiling") & pl.col("error_class").is_null())
        .select("request_id", "chunk_times_s", pl.col("target").fill_null(0))
        .collect()
    )
    errors = []
    for rid, chunks, target in records.iter_rows():
        written = emissions[target].get(rid, [])
        if len(chunks) < 3 or len(written) != len(chunks):
            continue
        client = (chunks[-1] - chunks[0]) / (len(chunks) - 1)
        server = (written[-1] - written[0]) / (len(written) - 1)
        if server > 0:
            errors.append(abs(client - server) / server)
    return np.asarray(errors)


def chunk_rate(run: Path) -> float:
    """Chunks received per second of the profiling window (warmup and drain left out)."""
    from agentab.rundir import scan_records

    manifest = json.loads((run / "manifest.json").read_text())
    start = manifest["stats"]["profiling_start_s"]
    end = start + manifest["replay"]["duration_s"]
    times = (
        scan_records(run)
        .select("sent_s", "chunk_times_s")
        .explode("chunk_times_s")
        .select((pl.col("sent_s") + pl.col("chunk_times_s")).alias("t"))
        .collect()["t"]
    )
    inside = times.filter((times >= start) & (times < end))
    return inside.len() / (end - start)


def main() -> int:
    try:
        return bench()
    finally:
        for proc in reversed(STARTED):  # the replay first, then the server it sends to
            if proc.poll() is None:
                stop(proc)


def bench() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1],
        help="Serve with this many engine replicas (`agentab serve --replicas R`, one process "
        "each), lanes spread over them (lane k to replica k mod R); one run per value",
    )
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument(
        "--sessions", type=int, default=None, help="default: 256, or twice the most lanes"
    )
    ap.add_argument("--out-tokens", type=int, default=400)
    ap.add_argument("--profile", default="gb300-tp16-kimi-k3")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="Serve the profile with this many layers: shorter simulated steps, more chunks/s "
        "(the published profile's step at batch 128 is 34 ms, which bounds 128 lanes to about "
        "3,700 chunks/s whatever the client)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    if any(c > lanes for c in args.clients for lanes in args.lanes):
        ap.error("every --clients value must be at most every --lanes value (whole lanes each)")
    if any(r < 1 or r > lanes for r in args.replicas for lanes in args.lanes):
        ap.error("every --replicas value must be from 1 to every --lanes value (a lane each)")
    sessions = args.sessions or max(256, 2 * max(args.lanes))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on)
    raise_fd_limit()
    cores = os.cpu_count() or 1
    print(
        f"# {cores} cores; profile {args.profile}"
        f"{f' with {args.layers} layers' if args.layers else ''}; {args.duration:g} s windows; "
        f"{sessions} sessions",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        profile = args.profile
        if args.layers is not None:
            profile = str(root / "profile.toml")
            text = (ROOT / "agentab/engine/profiles" / f"{args.profile}.toml").read_text()
            Path(profile).write_text(
                re.sub(r"(?m)^(num_layers|kv_layers) = \d+", rf"\1 = {args.layers}", text)
            )
        workload = root / "w.jsonl"
        save(Workload(tuple(session(i, args.out_tokens) for i in range(sessions))), workload)
        for lanes in args.lanes:
            for replicas in args.replicas:
                base = None
                for clients in args.clients:
                    row, base = run_one(
                        args, root, profile, workload, lanes, replicas, clients, cores, base
                    )
                    rows.append(row)
            saturated = [r for r in rows if r["lanes"] == lanes and r["bound"] == "server"]
            if saturated:
                runs = ", ".join(f"{r['replicas']}x{r['clients']}" for r in saturated)
                print(
                    f"# lanes {lanes}: a server replica used its one core with {runs} "
                    "(replicas x clients): it, not the clients, bounds the chunk rate there; "
                    "more clients cannot raise it, more replicas can",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"command": " ".join(sys.argv), "cores": cores, "rows": rows}, indent=2)
            + "\n"
        )
    return 0


def run_one(
    args: argparse.Namespace,
    root: Path,
    profile: str,
    workload: Path,
    lanes: int,
    replicas: int,
    clients: int,
    cores: int,
    base: tuple[float, str] | None,
) -> tuple[dict[str, Any], tuple[float, str]]:
    """One run: a fresh server of `replicas` replicas, the replay from `clients` clients, its
    row (and the base the next runs at this load are compared with)."""
    proc, urls = serve(profile, replicas)
    pids = replica_pids(proc, replicas)
    print(
        f"# lanes {lanes} replicas {replicas} clients {clients}: serving on {' '.join(urls)} "
        f"(pid {proc.pid})",
        flush=True,
    )
    try:
        out = root / f"l{lanes}-r{replicas}-c{clients}"
        sampler = replay(workload, urls, out, lanes, clients, args.duration, pids)
        emissions = []
        for url in urls:
            with urllib.request.urlopen(url + "/agentab/emissions") as resp:
                emissions.append(json.loads(resp.read()))
    finally:
        stop(proc)
    manifest = json.loads((out / "manifest.json").read_text())
    # the profiling window on this host's monotonic clock (the clients' t0 is one)
    start = manifest["clock_t0"] + manifest["stats"]["profiling_start_s"]
    used = sampler.cores(start, start + args.duration)
    per_replica, client_cores = ([], None) if used is None else used
    server_cores = sum(per_replica) if per_replica else None
    busiest = max(per_replica) if per_replica else None
    errs = itl_errors(out, emissions)
    rate = chunk_rate(out)
    base = (rate, f"{clients} client(s)") if base is None else base
    lag = max(c["loop_lag_ms"]["p99"] for c in manifest["clients"])
    lag_max = max(c["loop_lag_ms"]["max"] for c in manifest["clients"])
    behind = max(c["behind_plan_ms"]["p90"] or 0 for c in manifest["clients"])
    p50, p90 = (np.percentile(errs, [50, 90]) * 100) if errs.size else (np.nan,) * 2
    row = {
        "lanes": lanes,
        "replicas": replicas,
        "clients": clients,
        "loop_lag_p99_ms": lag,
        "loop_lag_max_ms": lag_max,
        "behind_plan_p90_ms": behind,
        "itl_error_p50_pct": None if np.isnan(p50) else round(float(p50), 3),
        "itl_error_p90_pct": None if np.isnan(p90) else round(float(p90), 3),
        "itl_requests": int(errs.size),
        "chunks_per_s": round(rate, 1),
        "vs_first": round(rate / base[0], 3) if base[0] else None,
        "server_cores": None if server_cores is None else round(server_cores, 3),
        "server_core_max": None if busiest is None else round(busiest, 3),
        "client_cores": None if client_cores is None else round(client_cores, 3),
        # the clients' CPU per chunk received: what sets the chunk rate one client can carry
        "client_us_per_chunk": None
        if client_cores is None or not rate
        else round(client_cores / rate * 1e6, 2),
        "bound": bound(server_cores, client_cores, behind, cores, busiest),
    }
    server = "n/a" if server_cores is None else f"{server_cores:4.2f} (busiest {busiest:4.2f})"
    mine = "n/a" if client_cores is None else f"{client_cores:5.2f}"
    if row["client_us_per_chunk"] is not None:
        mine += f" ({row['client_us_per_chunk']:.1f} us/chunk)"
    print(
        f"lanes {lanes:4d} replicas {replicas} clients {clients}: worst client loop lag P99 "
        f"{lag:7.2f} ms (max {lag_max:7.1f}), behind plan P90 {behind:6.2f} ms; ITL error vs "
        f"server P50 {p50:5.2f}% P90 {p90:5.2f}% over {errs.size} requests; "
        f"{rate:8.0f} chunks/s ({row['vs_first']:.2f}x {base[1]}); CPU "
        f"server {server} cores, clients {mine}; bound: {row['bound']}",
        flush=True,
    )
    return row, base


if __name__ == "__main__":
    sys.exit(main())

"""How well one, two and four replay client processes time a loaded `agentab serve`.

For each load (closed-loop lanes) and each client count, a fresh `agentab serve` (the simulator
on the real clock, `--record-emissions`) is started, `agentab replay --clients N` runs against
it, and the script prints per run:

- the worst client's event-loop lag (P99, max) and dispatch lateness (P90, the figure the
  report refuses a run on) from the manifest;
- the ITL error: per profiling request, the client's ITL ((last chunk - first chunk) /
  (chunks - 1), from its own timestamps) against the same figure from the server's write times
  of those chunks (`/agentab/emissions`, the server's monotonic clock, which the processes of
  one host share), as |client - server| / server, at P50 and P90 over requests;
- the chunk throughput: chunks received in the profiling window per second, and its ratio to
  the one-client run at the same load.

The server shares the host's cores with the clients, so on a small machine the server may be
what saturates first; the per-process figures say which one did. Printed, never asserted.

    python benchmarks/bench_replay_clients.py [--lanes 64 128] [--clients 1 2 4] [--duration 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

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


def serve(profile: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "serve", "--profile", profile, "--record-emissions",
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on http://127.0.0.1:" not in line:
        raise SystemExit(f"agentab serve did not start: {line}")
    return proc, "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0]


def replay(workload: Path, url: str, out: Path, lanes: int, clients: int, duration: float) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agentab", "replay", str(workload), "--url", url, "--out", str(out),
         "--concurrency", str(lanes), "--duration", str(duration), "--warmup-requests", "1",
         "--drain", "5", "--clients", str(clients), "--quiet", "--prompt-salt", "bench"],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"replay --clients {clients} failed:\n{done.stderr[-3000:]}")


def itl_errors(run: Path, emissions: dict[str, list[float]]) -> np.ndarray:
    from agentab.rundir import scan_records

    records = (
        scan_records(run)
        .filter((pl.col("phase") == "profiling") & pl.col("error_class").is_null())
        .select("request_id", "chunk_times_s")
        .collect()
    )
    errors = []
    for rid, chunks in records.iter_rows():
        written = emissions.get(rid, [])
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--sessions", type=int, default=256)
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
    args = ap.parse_args()
    print(
        f"# {os.cpu_count()} cores; profile {args.profile}"
        f"{f' with {args.layers} layers' if args.layers else ''}; {args.duration:g} s windows"
    )
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
        save(Workload(tuple(session(i, args.out_tokens) for i in range(args.sessions))), workload)
        for lanes in args.lanes:
            base = None
            for clients in args.clients:
                proc, url = serve(profile)
                try:
                    out = root / f"l{lanes}-c{clients}"
                    replay(workload, url, out, lanes, clients, args.duration)
                    with urllib.request.urlopen(url + "/agentab/emissions") as resp:
                        emissions = json.loads(resp.read())
                finally:
                    proc.terminate()
                    proc.wait()
                manifest = json.loads((out / "manifest.json").read_text())
                errs = itl_errors(out, emissions)
                rate = chunk_rate(out)
                base = rate if base is None else base
                lag = max(c["loop_lag_ms"]["p99"] for c in manifest["clients"])
                lag_max = max(c["loop_lag_ms"]["max"] for c in manifest["clients"])
                behind = max(c["behind_plan_ms"]["p90"] or 0 for c in manifest["clients"])
                p50, p90 = (np.percentile(errs, [50, 90]) * 100) if errs.size else (np.nan,) * 2
                print(
                    f"lanes {lanes:4d} clients {clients}: worst client loop lag P99 {lag:7.2f} ms "
                    f"(max {lag_max:7.1f}), behind plan P90 {behind:6.2f} ms; ITL error vs "
                    f"server P50 {p50:5.2f}% P90 {p90:5.2f}% over {errs.size} requests; "
                    f"{rate:8.0f} chunks/s ({rate / base:.2f}x one client)",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

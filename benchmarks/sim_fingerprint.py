"""Determinism check of the simulator: hash the records of a fixed set of simulated runs.

A speed change to the engine, the scheduler or the in-process replay must not change what a
simulation produces. This script runs a fixed set of `agentab simulate` workloads (the README
example's arms, concurrency 1 / 8 / 64 with auto, latency_specialized and 7 draft tokens, a
run under KV-cache pressure with preemptions, a request-limited run) and prints one hash per run
over every record column (chunk times as their exact float64 bytes), the scraped engine
counters (step counts, spec-decode and cache counters) and the manifest's run statistics.

With `--base REV` the same workloads also run from a temporary `git worktree` of REV (e.g. the
commit a branch started from) and each hash is compared; the exit status is 1 if any differs.
Each run is a separate `python -m agentab simulate` process, pinned with `taskset` when
available, and the wall time of both trees is printed with its ratio.

    python benchmarks/sim_fingerprint.py [--base REV] [--quick] [--only NAME ...] [--cpu 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ["--num-draft-tokens", "7", "--acceptance-probs", "0.9,0.82,0.74,0.66,0.58,0.5,0.42"]
PROFILE = ["--profile", "gb300-tp16-kimi-k3"]


@dataclass(frozen=True)
class Case:
    name: str
    workload: str  # "small" (48 sessions) or "large" (400 sessions)
    args: tuple[str, ...]


def cases(quick: bool) -> list[Case]:
    d = "200" if quick else "600"
    example = ("--concurrency", "8", "--duration", "300" if quick else "900")
    example += ("--warmup-requests", "2", "--scrape-metrics", "--scrape-interval", "10")
    out = [
        Case("example-auto", "small", (*example, *EXAMPLE_SPEC, "--decode-backend", "auto")),
        Case(
            "example-specialized",
            "small",
            (*example, *EXAMPLE_SPEC, "--decode-backend", "latency_specialized"),
        ),
    ]
    backends = {
        "auto": ("--decode-backend", "auto"),
        "specialized": ("--decode-backend", "latency_specialized"),
        "draft7": ("--decode-backend", "auto", *EXAMPLE_SPEC),
    }
    for c in (1, 8, 64):
        for label, extra in backends.items():
            args = ("--concurrency", str(c), "--duration", d, "--scrape-metrics")
            out.append(Case(f"c{c}-{label}", "large", (*args, "--scrape-interval", "10", *extra)))
    pressure = ("--concurrency", "24", "--duration", "150" if quick else "400")
    pressure += ("--kv-blocks", "18000", "--max-num-seqs", "16", "--scrape-metrics")
    out.append(Case("pressure-draft3", "large", (*pressure, "--num-draft-tokens", "3",
                                                 "--acceptance-length", "2.5")))  # fmt: skip
    out.append(Case("pressure-auto", "large", pressure))
    limit = ("--concurrency", "64", "--duration", "0", "--max-requests")
    out.append(Case("max-requests", "large", (*limit, "1500" if quick else "4000")))
    return out


def _bytes_of(series: pl.Series) -> bytes:
    """Exact content of a column: values, list lengths and nulls (floats as raw bytes)."""
    h = hashlib.sha256()
    h.update(series.is_null().to_numpy().tobytes())
    if isinstance(series.dtype, pl.List):
        h.update(series.list.len().fill_null(0).to_numpy().astype(np.int64).tobytes())
        series = series.explode().drop_nulls()
    if series.dtype == pl.String:
        h.update("\0".join(series.fill_null("").to_list()).encode())
    else:
        h.update(series.fill_null(0).to_numpy().tobytes())
    return h.digest()


def fingerprint(run_dir: Path) -> dict[str, str]:
    """Hashes of a run dir's records, metrics and stats (each part, and all together)."""
    from agentab.rundir import scan_metrics, scan_records

    records = scan_records(run_dir).collect()
    parts: dict[str, str] = {"rows": str(records.height)}
    h = hashlib.sha256()
    for name in records.columns:
        h.update(name.encode() + _bytes_of(records[name]))
    parts["records"] = h.hexdigest()[:16]
    metrics_dir = run_dir / "metrics"
    if metrics_dir.exists():
        metrics = scan_metrics(run_dir).collect()
        h = hashlib.sha256()
        for name in metrics.columns:
            h.update(name.encode() + _bytes_of(metrics[name]))
        parts["metrics"] = h.hexdigest()[:16]
        last = metrics.group_by("name").agg(pl.col("value").last())
        steps = last.filter(pl.col("name").str.contains("steps_.*_total"))
        parts["steps"] = str(int(steps["value"].sum()))
    stats = json.loads((run_dir / "manifest.json").read_text())["stats"]
    parts["stats"] = hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest()[:16]
    parts["all"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return parts


def run_case(tree: Path, case: Case, workloads: dict[str, Path], out: Path, cpu: str | None):
    cmd = [sys.executable, "-m", "agentab", "simulate", str(workloads[case.workload])]
    cmd += ["--out", str(out), "--quiet", *PROFILE, *case.args]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpu, *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree), "POLARS_MAX_THREADS": "1"}
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{case.name} ({tree}): exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return fingerprint(out), wall


def make_workloads(tmp: Path) -> dict[str, Path]:
    from agentab.workloads.generator import generate, load_config
    from agentab.workloads.native import dump_native

    paths = {}
    for name, sessions in (("small", 48), ("large", 400)):
        path = tmp / f"{name}.jsonl"
        dump_native(generate(load_config("agentx-coding"), sessions, 42), path)
        paths[name] = path
    return paths


def base_tree(rev: str, tmp: Path) -> Path:
    path = tmp / "base"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
        check=True,
        capture_output=True,
    )
    return path


def remove_scratch(tmp: Path, base: Path | None) -> None:
    """Remove the base revision's worktree (when there is one) and the scratch dir."""
    if base is not None:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
            capture_output=True,
        )
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="Also run from a git worktree of this revision and compare.")
    ap.add_argument("--quick", action="store_true", help="Shorter runs (same coverage).")
    ap.add_argument("--only", nargs="*", help="Run only these cases (names as printed).")
    ap.add_argument("--cpu", default="1", help="Pin each run to this core ('' for no pinning).")
    ap.add_argument("--json", type=Path, help="Write the hashes and times here.")
    args = ap.parse_args()
    cpu = args.cpu or None
    selected = [c for c in cases(args.quick) if not args.only or c.name in args.only]
    tmp = Path(tempfile.mkdtemp(prefix="agentab-fingerprint-"))
    base = None
    try:
        workloads = make_workloads(tmp)
        base = base_tree(args.base, tmp) if args.base else None
        results = []
        differ = 0
        print(f"{'case':<22} {'rows':>6} {'steps':>9} {'hash':<16} {'new s':>7}", end="")
        print(f" {'base s':>7} {'ratio':>6}  base hash" if base else "")
        for case in selected:
            new, wall = run_case(ROOT, case, workloads, tmp / f"new-{case.name}", cpu)
            row = {"case": case.name, "new": new, "new_s": wall}
            line = f"{case.name:<22} {new['rows']:>6} {new.get('steps', '-'):>9} "
            line += f"{new['all']:<16} {wall:>7.2f}"
            if base is not None:
                old, base_wall = run_case(base, case, workloads, tmp / f"base-{case.name}", cpu)
                same = old == new
                differ += not same
                row.update(base=old, base_s=base_wall, same=same)
                line += f" {base_wall:>7.2f} {base_wall / wall:>5.1f}x  "
                line += "same" if same else f"DIFFERS {old}"
            print(line, flush=True)
            results.append(row)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        if base is not None:
            print("all identical" if not differ else f"{differ} case(s) differ")
        return 1 if differ else 0
    finally:
        remove_scratch(tmp, base)


if __name__ == "__main__":
    sys.exit(main())

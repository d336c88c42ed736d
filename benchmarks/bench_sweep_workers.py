"""Wall time of a simulated sweep with one process against N (`agentab ab --workers N`).

The README's sweep example (30 simulated runs) is run twice into fresh dirs sharing one prompt
salt, once with `--workers 1` and once with `--workers N` (with `--ray`: as Ray tasks on a
cluster of N CPUs started in-process); the script prints both wall times,
their ratio, and whether every run's records and the sweep's points came out the same.

    python benchmarks/bench_sweep_workers.py [--workers 2] [--example FILE] [--ray]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(example: Path, out: Path, workers: int, salt: str, ray: bool = False) -> float:
    out.mkdir(parents=True)
    (out / "prompt_salt").write_text(salt + "\n")
    shutil.copyfile(example, out / "experiment.toml")
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "agentab", "ab", str(example), "-o", str(out), "--no-progress",
         "--workers", str(workers), *(["--ray", "local"] if ray else [])],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"--workers {workers} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def points(out: Path) -> list:
    data = json.loads((out / "sweep.json").read_text())["points"]
    for p in data:
        for side in ("a", "b"):
            p[side].pop("runs", None)
    return data


def same_records(one: Path, two: Path) -> bool:
    from agentab.rundir import scan_records

    for manifest in one.glob("*/*/run-*/manifest.json"):
        run = manifest.parent.relative_to(one)
        a = scan_records(one / run).collect().sort("request_id")
        b = scan_records(two / run).collect().sort("request_id")
        if not a.equals(b):
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--example", type=Path, default=ROOT / "examples" / "sweep-gb300-tp16.toml")
    ap.add_argument(
        "--ray",
        action="store_true",
        help="Run the N-worker sweep as Ray tasks on a cluster started in-process "
        "(`--ray local --workers N`; the ray extra)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        salt = "bench-sweep-workers"
        one = run(args.example, root / "one", 1, salt)
        many = run(args.example, root / "many", args.workers, salt, args.ray)
        same = points(root / "one") == points(root / "many")
        records = same_records(root / "one", root / "many")
        how = f"--ray local --workers {args.workers}" if args.ray else f"--workers {args.workers}"
        print(f"--workers 1: {one:.1f} s; {how}: {many:.1f} s; "
              f"ratio {many / one:.2f} (goal <= 0.6 at 2 workers on 2 cores)")  # fmt: skip
        print(f"sweep points identical: {same}; every run's records identical: {records}")
        return 0 if same and records else 1


if __name__ == "__main__":
    sys.exit(main())

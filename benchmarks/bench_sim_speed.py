"""Simulator speed at AgentX scale, as a ratio against a base revision measured in the same run.

Figures (400 generated AgentX-style sessions, seed 42, profile gb300-tp16-kimi-k3):
- `c64-1h-auto`, `c64-1h-specialized`, `c64-1h-draft7`: one hour of virtual time at concurrency
  64 with decode_backend auto, latency_specialized, and auto with 7 draft tokens (the README
  example's acceptance rates). Goals: <= 5 s, 6 s, 12 s.
- `100k`: `--duration 0 --max-requests 100000` at concurrency 64. Goal: <= 30 s.
- `20k`: the same with 20,000 requests. Goal: <= 6 s of CPU time.

Each figure is the wall time of `agentab.replay.simulate_to_dir` (what `agentab simulate` runs
after loading the workload), in a fresh process pinned to one core (`taskset -c CPU`), for this
tree and for a temporary `git worktree` of `--base`, alternating base and new `--repeats` times,
after one small untimed simulation in each tree (a fresh worktree has no numba cache yet, and its
first case would count the compiling);
the printed ratio is base / new of the medians, of CPU time (process time, which a busy shared
machine inflates less than wall time) and of wall time. The record hashes of both trees are compared
too (benchmarks/sim_fingerprint.py covers more workloads).

    python benchmarks/bench_sim_speed.py --base REV [--cases c64-1h-auto ...] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

PROBS = [0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42]
CASES: dict[str, tuple[dict, dict, float]] = {
    # name: (engine options, replay options, goal in seconds)
    "c64-1h-auto": ({"decode_backend": "auto"}, {"duration_s": 3600.0}, 5.0),
    "c64-1h-specialized": ({"decode_backend": "latency_specialized"}, {"duration_s": 3600.0}, 6.0),
    "c64-1h-draft7": (
        {"decode_backend": "auto", "num_draft_tokens": 7, "acceptance_probs": PROBS},
        {"duration_s": 3600.0},
        12.0,
    ),
    "100k": ({"decode_backend": "auto"}, {"duration_s": None, "max_requests": 100_000}, 30.0),
    "20k": ({"decode_backend": "auto"}, {"duration_s": None, "max_requests": 20_000}, 6.0),
}
# untimed, once per tree before the cases: fills numba's on-disk cache of every compiled kernel
# (with and without drafts: some kernels see other argument types without them, e.g. a window's
# acceptances, and a fresh tree would otherwise compile those inside its first timed case)
WARM = [
    ({"decode_backend": "auto", "num_draft_tokens": 2, "acceptance_probs": PROBS[:2]},
     {"duration_s": 60.0}, 0.0),
    ({"decode_backend": "auto"}, {"duration_s": 60.0}, 0.0),
]  # fmt: skip


def worker(case: str, out: Path) -> None:
    """Run one case in this process (agentab from PYTHONPATH) and print its figures as JSON."""
    from agentab.replay import ReplayOptions, simulate_to_dir
    from agentab.workloads.generator import generate, load_config

    if case == "warm":
        wl = generate(load_config("agentx-coding"), 8, 42)
        for i, (engine, replay, _goal) in enumerate(WARM):
            opts = ReplayOptions(concurrency=64, seed=42, **replay)
            simulate_to_dir(
                wl,
                engine_options={"profile": "gb300-tp16-kimi-k3", **engine},
                replay=opts,
                out_dir=out / str(i),
                progress=False,
            )
        print(json.dumps({}))
        return
    engine, replay, _goal = CASES[case]
    wl = generate(load_config("agentx-coding"), 400, 42)
    opts = ReplayOptions(concurrency=64, seed=42, **replay)
    wall, cpu = time.perf_counter(), time.process_time()
    simulate_to_dir(
        wl,
        engine_options={"profile": "gb300-tp16-kimi-k3", **engine},
        replay=opts,
        out_dir=out,
        progress=False,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stats = json.loads((out / "manifest.json").read_text())["stats"]
    print(json.dumps({"wall": wall, "cpu": cpu, "requests": stats["finished"]}))


def run(tree: Path, case: str, out: Path, cpu: str | None) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_sim_speed.py"), "--worker", case]
    cmd += ["--out", str(out)]
    if cpu and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpu, *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree), "POLARS_MAX_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{case} ({tree}): exit {proc.returncode}\n{proc.stderr[-2000:]}")
    from sim_fingerprint import fingerprint

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if case != "warm":
        res["hash"] = fingerprint(out)["all"]
    shutil.rmtree(out, ignore_errors=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="Revision to compare with (measured in the same run).")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cpu", default="1", help="Core to pin to ('' for none).")
    ap.add_argument("--worker", choices=[*CASES, "warm"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return 0
    from sim_fingerprint import base_tree, remove_scratch

    tmp = Path(tempfile.mkdtemp(prefix="agentab-simspeed-"))
    base = base_tree(args.base, tmp) if args.base else None
    differ = 0
    try:
        for tree in (base, ROOT):
            if tree is not None:
                run(tree, "warm", tmp / "warm", args.cpu)
        print(f"{'case':<20} {'requests':>8} {'goal':>5} {'cpu s':>7} {'wall s':>7}", end="")
        base_head = f" {'base cpu':>8} {'base wall':>9} {'cpu x':>6} {'wall x':>6}  records"
        print(base_head if base else "")
        for case in args.cases:
            news, olds = [], []
            for i in range(args.repeats):
                if base is not None:
                    olds.append(run(base, case, tmp / f"b{i}", args.cpu))
                news.append(run(ROOT, case, tmp / f"n{i}", args.cpu))
            cpu = statistics.median(r["cpu"] for r in news)
            wall = statistics.median(r["wall"] for r in news)
            goal = CASES[case][2]
            line = f"{case:<20} {news[0]['requests']:>8} {goal:>5g} {cpu:>7.2f} {wall:>7.2f}"
            if base is not None:
                b_cpu = statistics.median(r["cpu"] for r in olds)
                b_wall = statistics.median(r["wall"] for r in olds)
                same = all(o["hash"] == n["hash"] for o, n in zip(olds, news, strict=True))
                differ += not same
                line += f" {b_cpu:>8.2f} {b_wall:>9.2f} {b_cpu / cpu:>5.1f}x {b_wall / wall:>5.1f}x"
                line += f"  {'identical' if same else 'DIFFER'}"
            print(line, flush=True)
    finally:
        remove_scratch(tmp, base)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

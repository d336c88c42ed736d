"""Analysis and import speed at AgentX scale, as a ratio against a base revision in the same run.

Figures, each a fresh process pinned to one core (`taskset -c CPU`), this tree and a temporary
`git worktree` of `--base` alternating:
- `compare`: `agentab compare A B --json` of two synthetic run dirs of `--requests` records
  each (benchmarks/bench_analysis.py's records: 1..16 chunks, 2% errors, ~4,000 sessions),
  10,000 resamples. Goal: <= 15 s for 1M vs 1M.
- `import`: loading 400 generated sessions (~100k requests) written as AgentX JSONL as the
  commands that replay a trace load it (`freeze=True`), and its content hash (what every
  command that records the workload computes). Goal: <= 2.5 s.
- `report`: `agentab report RUN` of a run dir of `--report-requests` records in part files of
  10,000 rows (as a long replay leaves its records), with 1..`--report-chunks` chunks each
  (default 1..1020: ~510 on average, as AgentX-style outputs give; 510M chunk times for 1M
  records, ~6 GB of Arrow). Goal: <= 5 s and <= 1 GB.

CPU time and peak memory come from the child's resource usage (`os.wait4`); CPU time is the
primary figure (a busy shared machine inflates wall time more). The outputs of both trees are
compared (`compare --json` byte for byte, the imported workload's content hash, summary.json).

    python benchmarks/bench_analysis_speed.py --base REV [--figures compare import report]
        [--requests 1000000] [--report-requests 1000000] [--report-chunks 1020] [--repeats 1]
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

os.environ.setdefault("POLARS_MAX_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
GOALS = {"compare": (15.0, None), "import": (2.5, None), "report": (5.0, 1024.0)}


def child(tree: Path, args: list[str], cpu: str | None, stdout: Path) -> dict:
    """Run `python ARGS` with agentab from `tree`; its wall, CPU seconds and peak MB."""
    cmd = [sys.executable, *args]
    if cpu and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpu, *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    with stdout.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, cwd=tree)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args)} ({tree}): failed\n{err[-2000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "mb": usage.ru_maxrss / 1024}


def import_worker(path: str) -> None:
    import inspect

    from agentab.workloads.io import load

    # as the commands that replay a trace load it (trees that predate `freeze` load without)
    kw = {"freeze": True} if "freeze" in inspect.signature(load).parameters else {}
    wall, cpu = time.perf_counter(), time.process_time()
    wl = load(path, **kw)
    digest = wl.content_hash
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"wall": wall, "cpu": cpu, "hash": digest, "requests": wl.num_requests()}))


def make_run_dirs(
    tmp: Path, requests: int, report_requests: int, report_chunks: int
) -> dict[str, Path]:
    import orjson
    from bench_analysis import synthetic_records, write_run_dir

    dirs = {}
    for name, seed, arm in (("a", 0, "auto"), ("b", 1, "latency_specialized")):
        path = write_run_dir(tmp / name, synthetic_records(requests, seed))
        manifest = orjson.loads((path / "manifest.json").read_bytes())
        manifest.update(status="completed", arm=arm, decode_backend=arm)
        (path / "manifest.json").write_bytes(orjson.dumps(manifest))
        dirs[name] = path
    dirs["report"] = make_report_dir(tmp / "report", report_requests, report_chunks)
    return dirs


def make_report_dir(path: Path, requests: int, max_chunks: int, part_rows: int = 10_000) -> Path:
    """A run dir of `requests` records in part files of `part_rows` rows, as a long replay
    leaves it (parts merged in groups), with 1..`max_chunks` chunks per request."""
    import bench_analysis
    import orjson
    import polars as pl
    from bench_analysis import synthetic_records, write_run_dir

    bench_analysis.MAX_CHUNKS = max_chunks
    write_run_dir(path, synthetic_records(0, 0))
    (path / "records" / "part-00000000-00000000.arrow").unlink()
    for i, start in enumerate(range(0, requests, part_rows)):
        rows = synthetic_records(min(part_rows, requests - start), 100 + i)
        ids = (pl.col("request_id").cast(pl.Int64) + start).cast(pl.String)
        rows.with_columns(request_id=ids).write_ipc(
            path / "records" / f"part-{i:08d}-{i:08d}.arrow"
        )
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    manifest.update(status="completed")
    (path / "manifest.json").write_bytes(orjson.dumps(manifest))
    return path


def make_agentx(tmp: Path) -> Path:
    from agentab.workloads.agentx import dump_agentx
    from agentab.workloads.generator import generate, load_config

    path = tmp / "agentx.jsonl"
    dump_agentx(generate(load_config("agentx-coding"), 400, 42), path)
    return path


def measure(figure: str, tree: Path, inputs: dict[str, Path], cpu: str | None, tmp: Path):
    """(resources, output to compare between trees) of one figure."""
    out = tmp / f"{figure}.out"
    if figure == "compare":
        a, b = str(inputs["a"]), str(inputs["b"])
        res = child(tree, ["-m", "agentab", "compare", a, b, "--json"], cpu, out)
        return res, out.read_bytes()
    if figure == "import":
        script = str(ROOT / "benchmarks" / "bench_analysis_speed.py")
        res = child(tree, [script, "--import-worker", str(inputs["agentx"])], cpu, out)
        inner = json.loads(out.read_text().strip().splitlines()[-1])
        res.update(cpu=inner["cpu"], wall=inner["wall"])
        return res, (inner["hash"], inner["requests"])
    run = inputs["report"]
    res = child(tree, ["-m", "agentab", "report", str(run)], cpu, out)
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("generated_at", None)
    return res, json.dumps(summary, sort_keys=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="Revision to compare with (measured in the same run).")
    ap.add_argument("--figures", nargs="*", default=list(GOALS), choices=list(GOALS))
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--report-requests", type=int, default=1_000_000)
    ap.add_argument("--report-chunks", type=int, default=1020, help="Most chunks per request.")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cpu", default="1", help="Core to pin to ('' for none).")
    ap.add_argument("--import-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.import_worker:
        import_worker(args.import_worker)
        return 0
    from sim_fingerprint import base_tree, remove_scratch

    tmp = Path(tempfile.mkdtemp(prefix="agentab-anaspeed-"))
    base = base_tree(args.base, tmp) if args.base else None
    differ = 0
    try:
        inputs: dict[str, Path] = {}
        if "compare" in args.figures or "report" in args.figures:
            inputs.update(
                make_run_dirs(tmp, args.requests, args.report_requests, args.report_chunks)
            )
        if "import" in args.figures:
            inputs["agentx"] = make_agentx(tmp)
        head = f"{'figure':<8} {'goal':>11} {'cpu s':>7} {'wall s':>7} {'MB':>6}"
        if base is not None:
            head += f" {'base cpu':>8} {'base MB':>7} {'cpu x':>6} {'wall x':>6}  output"
        print(head)
        for figure in args.figures:
            news, olds = [], []
            for _ in range(args.repeats):
                if base is not None:
                    olds.append(measure(figure, base, inputs, args.cpu, tmp))
                news.append(measure(figure, ROOT, inputs, args.cpu, tmp))
            cpu = statistics.median(r["cpu"] for r, _ in news)
            wall = statistics.median(r["wall"] for r, _ in news)
            mb = max(r["mb"] for r, _ in news)
            secs, mem = GOALS[figure]
            goal = f"{secs:g} s" + (f", {mem:g} MB" if mem else "")
            line = f"{figure:<8} {goal:>11} {cpu:>7.2f} {wall:>7.2f} {mb:>6.0f}"
            if base is not None:
                b_cpu = statistics.median(r["cpu"] for r, _ in olds)
                b_wall = statistics.median(r["wall"] for r, _ in olds)
                b_mb = max(r["mb"] for r, _ in olds)
                same = all(o[1] == n[1] for o, n in zip(olds, news, strict=True))
                differ += not same
                line += f" {b_cpu:>8.2f} {b_mb:>7.0f} {b_cpu / cpu:>5.1f}x {b_wall / wall:>5.1f}x"
                line += f"  {'identical' if same else 'DIFFER'}"
            print(line, flush=True)
    finally:
        remove_scratch(tmp, base)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

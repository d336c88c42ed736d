"""Where one bench_sim_speed case spends its time: a py-spy sample profile or a cProfile.

    python benchmarks/profile_sim_case.py c64-1h-auto --py-spy OUT.txt [--tree REV]
    python benchmarks/profile_sim_case.py 20k --cprofile OUT_PREFIX [--tree REV]

The case runs as bench_sim_speed.py runs it (its `--worker`, one process pinned to a core,
POLARS_MAX_THREADS=1),
from this checkout or from a `git worktree` of REV. `--py-spy` samples at 200 Hz (py-spy must be
installed) and writes each function's inclusive share of the samples under `simulate_to_dir`,
largest first: the statistical view, which does not slow the compiled kernels against the
Python around them. `--cprofile` writes OUT_PREFIX-tottime.txt and OUT_PREFIX-cumtime.txt (the
top 60 each): exact call counts, at the price of inflating Python against the kernels. Every
output file starts with the command that made it.
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from io import StringIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sim_fingerprint import base_tree, remove_scratch  # noqa: E402

ROOT_FRAME = "simulate_to_dir (agentab/replay/api.py)"
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def short_path(path: str) -> str:
    """A path from the package on ('agentab/engine/core.py', 'asyncio/tasks.py'), so profiles
    of different checkouts and interpreters read the same."""
    for anchor in ("/agentab/", "/site-packages/", "/lib/python3"):
        if anchor in path:
            tail = path.split(anchor, 1)[1]
            if anchor == "/agentab/":
                return "agentab/" + tail
            if anchor == "/lib/python3":
                return tail.split("/", 1)[1] if "/" in tail else tail
            return tail
    return path


def inclusive_shares(raw: str) -> tuple[int, list[tuple[float, str]]]:
    """(samples under ROOT_FRAME, [(share, frame)] largest first) from py-spy's raw output
    (one 'frame;frame;... count' line per distinct stack). A frame counts once per sample
    however often it recurs in the stack."""
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = []
        for frame in stack.split(";"):
            m = _FRAME.match(frame.strip())
            frames.append(f"{m['func']} ({short_path(m['file'])})" if m else frame.strip())
        if ROOT_FRAME not in frames:
            continue
        total += int(n)
        for frame in set(frames[frames.index(ROOT_FRAME) :]):
            counts[frame] += int(n)
    shares = sorted(((100.0 * c / total, f) for f, c in counts.items()), reverse=True)
    return total, shares


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> None:
    """Run a step from `cwd`, the scratch dir: `python -m cProfile` puts the working directory
    first on sys.path, so run from a checkout it would import that checkout's agentab instead
    of PYTHONPATH's. A failure ends the script with the step's own error output."""
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"profile_sim_case: {cmd[0]} ... exit {done.returncode}\n{done.stderr[-2000:]}"
        )


def _worker(tree: Path, case: str, out: Path) -> list[str]:
    return [
        sys.executable,
        str(tree / "benchmarks" / "bench_sim_speed.py"),
        "--worker",
        case,
        "--out",
        str(out),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", help="a bench_sim_speed.py case (c64-1h-auto, 20k, ...)")
    ap.add_argument("--tree", help="profile a git worktree of this revision (default: here)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--py-spy", type=Path, help="write the inclusive shares here")
    what.add_argument("--cprofile", help="write PREFIX-tottime.txt and PREFIX-cumtime.txt")
    ap.add_argument("--top", type=int, default=90, help="lines of the py-spy table (90)")
    ap.add_argument("--cpu", default="1", help="core to pin the case to ('' for none; 1)")
    args = ap.parse_args()
    command = "python benchmarks/profile_sim_case.py " + shlex.join(sys.argv[1:])
    work = Path(tempfile.mkdtemp(prefix="agentab-profile-"))
    tree = base_tree(args.tree, work) if args.tree else None
    root = tree or ROOT
    env = {**os.environ, "PYTHONPATH": str(root), "POLARS_MAX_THREADS": "1"}
    try:
        # compile (or load) every kernel first, unprofiled, as bench_sim_speed.py does
        _run(_worker(root, "warm", work / "warm"), env, work)
        worker = _worker(root, args.case, work / "run")
        pin = ["taskset", "-c", args.cpu] if args.cpu and shutil.which("taskset") else []
        if args.py_spy:
            if shutil.which("py-spy") is None:
                raise SystemExit("profile_sim_case: py-spy is not installed (pip install py-spy)")
            raw = work / "raw.txt"
            _run(
                [*pin, "py-spy", "record", "-r", "200", "-f", "raw", "-o", str(raw), "--", *worker],
                env,
                work,
            )
            total, shares = inclusive_shares(raw.read_text())
            lines = [f"# {command}", f"total {total}"]
            lines += [f"{share:6.1f}% {frame}" for share, frame in shares[: args.top]]
            args.py_spy.write_text("\n".join(lines) + "\n")
        else:
            prof = work / "prof.out"
            _run([*pin, sys.executable, "-m", "cProfile", "-o", str(prof), *worker[1:]], env, work)
            for order in ("tottime", "cumtime"):
                text = StringIO()
                pstats.Stats(str(prof), stream=text).sort_stats(order).print_stats(60)
                body = re.sub(
                    r"/\S*?/(?=(agentab|asyncio|numba|polars|numpy)/)", "", text.getvalue()
                )
                Path(f"{args.cprofile}-{order}.txt").write_text(f"# {command}\n{body}")
    finally:
        remove_scratch(work, tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())

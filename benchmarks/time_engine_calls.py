"""Process time per call of the scheduler's event methods in one `bench_sim_speed.py` case.

Why: a whole-run ratio says whether the simulator got faster; this says which engine event
(a step's scheduling and the admissions inside it, a request's finish, a window's plan and
commit) the time went to, so a change aimed at one event can be checked against it alone.
The methods are wrapped on the `Scheduler` class (the wrapper's own cost, ~0.3 us a call, is in
every figure alike); run it once per tree, pinned to one core:

    PYTHONPATH=TREE taskset -c 1 python benchmarks/time_engine_calls.py --case 20k --label NAME
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

METHODS = ("schedule", "_admit", "finish", "plan_window", "commit_window")


def wrap(cls: type, name: str, totals: dict[str, list[float]]) -> None:
    """Replace `cls.name` by a wrapper adding its process time and one call to totals[name]."""
    inner: Callable[..., Any] = getattr(cls, name)
    spent = totals.setdefault(name, [0.0, 0])

    @functools.wraps(inner)
    def timed(*args: Any, **kw: Any) -> Any:
        t = time.process_time()
        try:
            return inner(*args, **kw)
        finally:
            spent[0] += time.process_time() - t
            spent[1] += 1

    setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="20k", help="a case of bench_sim_speed.py (default 20k)")
    ap.add_argument("--label", default="tree", help="the line's first word (e.g. base, tree)")
    a = ap.parse_args()

    from bench_sim_speed import CASES

    from agentab.engine.scheduler import Scheduler
    from agentab.replay import ReplayOptions, simulate_to_dir
    from agentab.workloads.generator import generate, load_config

    engine, replay, _goal = CASES[a.case]
    wl = generate(load_config("agentx-coding"), 400, 42)
    opts = ReplayOptions(concurrency=64, seed=42, **replay)
    run = {"profile": "gb300-tp16-kimi-k3", **engine}
    with tempfile.TemporaryDirectory() as tmp:  # untimed: numba's cache and imports warm
        warm = ReplayOptions(concurrency=64, seed=42, duration_s=60.0)
        simulate_to_dir(wl, engine_options=run, replay=warm, out_dir=Path(tmp), progress=False)
    totals: dict[str, list[float]] = {}
    for name in METHODS:
        wrap(Scheduler, name, totals)
    with tempfile.TemporaryDirectory() as tmp:
        cpu = time.process_time()
        simulate_to_dir(wl, engine_options=run, replay=opts, out_dir=Path(tmp), progress=False)
        cpu = time.process_time() - cpu
    parts = [
        f"{name} {s:.3f} s / {n} calls = {s / n * 1e6:.1f} us" if n else f"{name} 0 calls"
        for name, (s, n) in totals.items()
    ]
    print(f"{a.label:5} cpu {cpu:.2f} s; " + "; ".join(parts))


if __name__ == "__main__":
    main()

# ruff: noqa: E501  (log lines)
"""One device call: kernel versions 8 / 9 / 10 timed side by side, checked, and the winner benched.

Run on the GPU machine (repo root):  source .gpu/setup.sh && python3 scripts/gpu/ab.py
One process, so the weights are made once and every kernel compiles once. In priority order,
each stage skipped when the time budget (AB_BUDGET_S, default 400 s) would be overrun:
  A  batch 1 and 64: standard (versions 8 and 9: the shared attention differs at batch <= 4)
     and specialized (8, 9, 10), with the eager kernel breakdowns;
  B  `kernels check` semantics (fresh inputs, ragged cache, poisoned outputs, fp32 reference):
     version 9 specialized at batch 1-64, standard at 1-4; version 10 specialized at 1-4
     (above batch 4 version 10 runs version 9's kernels);
  C  the remaining batch sizes (2, 4, 8, 16, 32) for the fastest version that passed, standard
     and specialized, plus version 8 specialized at 2 and 4;
  D  the standard path at 128, 256, 512 tokens (profile only).
Writes $OUT/ab.json (everything), $OUT/check.json, $OUT/results.json (bench format, the
candidate version) and $OUT/h200-tp1-kimi-shard.toml; prints a short table last.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

VERSION_ENV = "AGENTAB_KERNELS_VERSION"
CONTEXT = 4096
CHECK_CONTEXT = 512
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class Runner:
    """Runs measurements under a kernel version, records them, and keeps to the time budget."""

    def __init__(
        self,
        bench: Callable[..., dict],
        check: Callable[..., dict],
        budget_s: float,
        dump: Path | None = None,
    ):
        self.bench_fn, self.check_fn, self.budget_s, self.dump = bench, check, budget_s, dump
        self.bench_rows: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []

    def save(self) -> None:
        """Everything so far to `dump` (a killed run still returns what it measured)."""
        if self.dump is not None:
            doc = {
                "bench": self.bench_rows,
                "checks": self.checks,
                "elapsed_s": round(time.time() - T0, 1),
            }
            self.dump.write_text(json.dumps(doc, indent=1))

    def left(self) -> float:
        return self.budget_s - (time.time() - T0)

    def bench(self, path: str, version: int, batch: int) -> dict[str, Any] | None:
        os.environ[VERSION_ENV] = str(version)
        try:
            r = self.bench_fn(path, batch)
        except Exception as exc:  # one failure must not hide the other figures
            traceback.print_exc()
            log(f"bench {path} v{version} batch {batch}: FAILED {type(exc).__name__}: {exc}")
            self.bench_rows.append({"path": path, "version": version, "batch": batch,
                                    "error": f"{type(exc).__name__}: {exc}"[:500]})  # fmt: skip
            return None
        row = {"path": path, "version": version, "batch": batch, **r}
        self.bench_rows.append(row)
        self.save()
        log(f"bench {path:11s} v{version:<2d} batch {batch:3d}: {r['us_per_layer']:8.1f} us/layer "
            f"(p10 {r['p10_us_per_layer']:.1f}, p90 {r['p90_us_per_layer']:.1f}), "
            f"{r['kernels']} kernels, build {r['build_s']:.1f}s")  # fmt: skip
        return r

    def check(self, path: str, version: int, batch: int) -> bool:
        os.environ[VERSION_ENV] = str(version)
        try:
            r = self.check_fn(path, batch)
        except Exception as exc:
            traceback.print_exc()
            r = {
                "path": path,
                "batch": batch,
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:500],
            }
        r = {**r, "version": version}
        self.checks.append(r)
        self.save()
        if "error" in r:
            log(f"check {path} v{version} batch {batch}: FAIL {r['error'][:200]}")
        else:
            log(f"check {'ok ' if r['ok'] else 'FAIL'} {path:11s} v{version:<2d} batch {batch:3d} "
                f"h1 {r['h1_err']:.2e} cache {r['cache_err']:.2e} out {r['out_err']:.2e} "
                f"w {r['weights_err']:.2e} e2e {r['e2e_err']:.2e} mism {r['expert_mismatches']} "
                f"ties {r['tie_excused']} written {r['all_written']}")  # fmt: skip
        return bool(r["ok"])

    def us(self, path: str, version: int, batch: int) -> float | None:
        r = self.bench_result(path, version, batch)
        return None if r is None else float(r["us_per_layer"])

    def bench_result(self, path: str, version: int, batch: int) -> dict[str, Any] | None:
        for r in self.bench_rows:
            if (r["path"], r["version"], r["batch"]) == (
                path,
                version,
                batch,
            ) and "us_per_layer" in r:
                return r
        return None

    def passed(self, version: int, path: str, batches: list[int]) -> bool:
        got = {
            r["batch"]: r["ok"]
            for r in self.checks
            if r["version"] == version and r["path"] == path
        }
        return all(got.get(b, False) for b in batches)


def choose(run: Runner) -> int:
    """The fastest version at batch 1 among those that passed their checks (8 otherwise)."""
    ok = {8: True,
          9: run.passed(9, "specialized", list(range(1, 65))) and run.passed(9, "standard", [1, 2, 3, 4]),
          10: run.passed(10, "specialized", [1, 2, 3, 4])}  # fmt: skip
    ok[10] = ok[10] and ok[9]  # above batch 4 version 10 runs version 9's kernels
    best, best_us = 8, run.us("specialized", 8, 1)
    for v in (9, 10):
        us = run.us("specialized", v, 1)
        if ok[v] and us is not None and (best_us is None or us < best_us):
            best, best_us = v, us
    return best


def plan(run: Runner) -> int:
    """Stages A-D (see the module docstring); returns the chosen version."""
    log("stage A: batch 1 and 64, versions side by side")
    for b in (1, 64):
        for path, versions in (("standard", (8, 9) if b <= 4 else (8,)),
                               ("specialized", (8, 9, 10) if b <= 4 else (8, 9))):  # fmt: skip
            for v in versions:
                run.bench(path, v, b)
    log("stage B: checks")
    if run.left() > 60:
        for b in (1, 2, 3, 4):
            run.check("specialized", 10, b)
        for b in range(1, 65):
            if run.left() < 40:
                log(f"stage B: out of time before batch {b}")
                break
            run.check("specialized", 9, b)
            if b <= 4:
                run.check("standard", 9, b)
    cand = choose(run)
    log(f"candidate version {cand}")
    log("stage C: remaining batch sizes")
    for b in (2, 4, 8, 16, 32):
        if run.left() < 25:
            log(f"stage C: out of time before batch {b}")
            break
        run.bench("standard", cand, b)
        run.bench("specialized", cand, b)
        if b <= 4 and cand != 8:
            run.bench("specialized", 8, b)
    log("stage D: standard path at 128, 256, 512 (profile only)")
    for b in (128, 256, 512):
        if run.left() < 15:
            log(f"stage D: out of time before batch {b}")
            break
        run.bench("standard", cand, b)
    return cand


def results_doc(
    run: Runner, cand: int, cfg: Any, device: str, torch_version: str
) -> dict[str, Any]:
    """The candidate's figures in `kernels bench`'s results format (for the profile writer)."""
    from agentab.kernels.bench import finish_row

    def same_code(path: str, b: int) -> list[int]:
        """Versions whose `path` runs the candidate's code at batch b (see NOTES.md)."""
        if path == "standard":  # only the attention split plan changed (9), at batch <= 4
            return [cand] if cand == 8 else [cand, 9, 10] if b <= 4 else [cand, 8, 9, 10]
        return [cand, 9] if cand == 10 and b > 4 else [cand]  # 10 = 9 above batch 4

    def first(path: str, b: int) -> dict[str, Any] | None:
        for v in same_code(path, b):
            r = run.bench_result(path, v, b)
            if r is not None:
                return r
        return None

    rows, extra = [], []
    for b in (1, 2, 4, 8, 16, 32, 64):
        row: dict[str, Any] = {"batch": b}
        detail: dict[str, Any] = {}
        for name, r in (
            ("standard", first("standard", b)),
            ("specialized", first("specialized", b)),
        ):
            if r is not None:
                row[f"{name}_us"] = round(r["us_per_layer"], 2)
                row[f"{name}_kernels"] = r["kernels"]
                detail[name] = r
        if detail:
            rows.append(finish_row(cfg, CONTEXT, row, detail))
    for b in (128, 256, 512):
        r = first("standard", b)
        if r is not None:
            extra.append(
                {
                    "batch": b,
                    "standard_us": round(r["us_per_layer"], 2),
                    "standard_kernels": r["kernels"],
                }
            )
    return {"device": device, "torch": torch_version, "preset": "k2-tp8-shard", "context": CONTEXT,
            "layers_per_graph": 4, "iters": 100, "hbm_roofline_bytes_per_s": 4.3e12,
            "kernel_version": cand, "rows": rows, "standard_extra_rows": extra,
            "command": "python3 scripts/gpu/ab.py (device tool, kind nvidia-h200, carry .gpu)"}  # fmt: skip


def table(run: Runner, cand: int) -> str:
    lines = [
        f"{'batch':>5} {'std_v8':>8} {'std_v9':>8} {'spec_v8':>8} {'spec_v9':>8} {'spec_v10':>8}  candidate v{cand}"
    ]
    for b in (1, 2, 4, 8, 16, 32, 64):
        vals = [run.us("standard", 8, b), run.us("standard", 9, b) or run.us("standard", cand, b),
                run.us("specialized", 8, b), run.us("specialized", 9, b), run.us("specialized", 10, b)]  # fmt: skip
        if all(v is None for v in vals):
            continue
        lines.append(
            f"{b:>5} " + " ".join(f"{v:8.1f}" if v is not None else f"{'-':>8}" for v in vals)
        )
    for v in (9, 10):
        cs = [c for c in run.checks if c["version"] == v]
        bad = [f"{c['path'][:4]}{c['batch']}" for c in cs if not c["ok"]]
        lines.append(
            f"check v{v}: {len(cs) - len(bad)}/{len(cs)} ok"
            + (f", failed {bad[:12]}" if bad else "")
        )
    return "\n".join(lines)


def main() -> int:
    import subprocess

    import torch

    from agentab.kernels.bench import bench_path
    from agentab.kernels.check import check_one
    from agentab.kernels.config import get_preset
    from agentab.kernels.profile_toml import write_profile
    from agentab.kernels.weights import init_weights

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    budget = float(os.environ.get("AB_BUDGET_S", "400"))
    smi = [
        "nvidia-smi",
        "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
        "--format=csv,noheader",
    ]
    log(
        f"torch {torch.__version__} {torch.cuda.get_device_name()} | {subprocess.run(smi, capture_output=True, text=True).stdout.strip()}"
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = get_preset("k2-tp8-shard")
    dev = torch.device("cuda")
    weights = [init_weights(cfg, 1000 * i, dev) for i in range(4)]  # as `kernels bench` (seed 0)
    w_check = init_weights(cfg, 4242, dev)  # as `kernels check` (seed 0)
    log("weights ready")

    def bench(path: str, batch: int) -> dict:
        iters = 100 if batch <= 64 else 25
        r = bench_path(path, cfg, weights, batch, CONTEXT, iters, 0)
        torch.cuda.empty_cache()
        return r

    def check(path: str, batch: int) -> dict:
        return check_one(path, cfg, w_check, batch, CHECK_CONTEXT, 0)

    run = Runner(bench, check, budget, out / "ab_partial.json")
    cand = 8
    try:
        cand = plan(run)
    finally:
        doc = {"bench": run.bench_rows, "checks": run.checks, "candidate": cand,
               "elapsed_s": round(time.time() - T0, 1)}  # fmt: skip
        (out / "ab.json").write_text(json.dumps(doc, indent=1))
        cdoc = {"device": torch.cuda.get_device_name(), "preset": "k2-tp8-shard",
                "context": CHECK_CONTEXT, "ok": all(c["ok"] for c in run.checks),
                "results": run.checks}  # fmt: skip
        (out / "check.json").write_text(json.dumps(cdoc, indent=1))
        try:
            res = results_doc(run, cand, cfg, torch.cuda.get_device_name(), torch.__version__)
            (out / "results.json").write_text(json.dumps(res, indent=1))
            if res["rows"]:
                write_profile(res, out / "h200-tp1-kimi-shard.toml")
        except Exception:
            traceback.print_exc()
        log(
            f"nvidia-smi at the end: {subprocess.run(smi, capture_output=True, text=True).stdout.strip()}"
        )
        print(table(run, cand), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

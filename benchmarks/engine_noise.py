"""Where the variance of an A/B comes from, read from one experiment dir of `agentab ab`.

Run it on an A/A experiment (both arms the same backend) to measure an engine's own noise, or on
an A/B to see what the paired design leaves. Printed, and written as JSON with --json.

- step noise: the step-to-step variation of one stream's step time, from each request's gaps
  between consecutive one-token chunks. Successive log gaps differ by the noise of two steps plus
  a slow drift (context growth), so sd(diff of log gaps) / sqrt(2), taken robustly (1.4826 MAD),
  is the per-step log sigma. Meaningful at concurrency 1, where a request's steps are its own;
  at higher concurrency it includes the batch changing under the stream.
- request level: sd of log(ITL_B / ITL_A) over the requests both arms of a repeat completed.
- run level: each repeat's log B/A of P90 interactivity on those requests, their sd, and the
  run-level variance the comparison's interval is widened by (`run_variance`).
- between plans: sd over repeats of arm A's log P90 interactivity (repeats replay different
  plans; the paired design cancels this part).
- sampling: the comparison's standard error and the change it could detect.

The simulator reproduces the first and third with its timing noise (engine options
`step_noise` = the step noise, `run_noise` = run-level sd / sqrt(2), since two runs differ).

    python benchmarks/engine_noise.py EXPERIMENT_DIR [--json out.json] [--resamples 2000]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import orjson
import polars as pl


def step_noise(run_dirs: list[Path]) -> dict[str, float | int]:
    """Per-step log sigma from one-token chunk gaps of every successful profiling request."""
    from agentab.rundir import scan_records

    diffs: list[np.ndarray] = []
    gaps_n = 0
    for run in run_dirs:
        frame = (
            scan_records(run)
            .filter(
                (pl.col("phase") == "profiling")
                & pl.col("error_class").is_null()
                & (pl.col("chunk_times_s").list.len() >= 8)
                & (
                    (pl.col("chunk_tokens").list.max() == 1)
                    | (  # no per-chunk counts: one token a chunk when the counts agree
                        pl.col("chunk_tokens").is_null()
                        & (pl.col("completion_tokens") == pl.col("chunk_times_s").list.len())
                    )
                )
            )
            .select("chunk_times_s")
            .collect()
        )
        for times in frame["chunk_times_s"].to_list():
            gaps = np.diff(np.asarray(times[1:], dtype=np.float64))  # steps after the first
            gaps = gaps[gaps > 0]
            if gaps.size < 4:
                continue
            gaps_n += gaps.size
            diffs.append(np.diff(np.log(gaps)))
    if not diffs:
        return {"gaps": 0}
    d = np.concatenate(diffs)
    mad = float(np.median(np.abs(d - np.median(d))))
    return {
        "gaps": gaps_n,
        "requests": len(diffs),
        "step_sigma": 1.4826 * mad / math.sqrt(2),
        "step_sigma_sd": float(d.std()) / math.sqrt(2),  # not robust: tail events included
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment_dir", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--resamples", type=int, default=2000)
    args = ap.parse_args()

    from agentab.analysis.compare import compare_runs
    from agentab.analysis.load import load_runs
    from agentab.analysis.matching import match_requests
    from agentab.analysis.summary import summarize_run

    arms = sorted(p for p in args.experiment_dir.iterdir() if p.is_dir())
    if len(arms) != 2:
        sys.exit(f"{args.experiment_dir}: expected two arm folders, found {len(arms)}")
    runs_a, runs_b = load_runs(arms[0]), load_runs(arms[1])
    result = compare_runs(runs_a, runs_b, resamples=args.resamples, seed=0)
    head = result.metrics["p90_interactivity_tok_s"]
    out: dict[str, object] = {
        "command": " ".join(["python", *sys.argv]),
        "arms": [arms[0].name, arms[1].name],
        "runs_per_arm": [len(runs_a), len(runs_b)],
        "step_noise": {
            arms[0].name: step_noise([r.path for r in runs_a]),
            arms[1].name: step_noise([r.path for r in runs_b]),
        },
    }
    summaries_a = sorted((summarize_run(r) for r in runs_a), key=lambda s: s.run.manifest["repeat"])
    summaries_b = sorted((summarize_run(r) for r in runs_b), key=lambda s: s.run.manifest["repeat"])
    matched = match_requests(summaries_a, summaries_b)
    if matched is not None:
        sds = []
        for fa, fb in zip(matched[0], matched[1], strict=True):
            j = (
                fa.filter(pl.col("phase") == "profiling")
                .select("request_id", a="itl_s")
                .join(fb.select("request_id", b="itl_s"), on="request_id")
                .filter((pl.col("a") > 0) & (pl.col("b") > 0))
            )
            if j.height >= 3:
                sds.append(float((j["b"].log() - j["a"].log()).std()))
        out["request_level_sd"] = sds
        out["matched"] = matched[2].to_json()
    logs = [math.log(r) for r in head.pair_ratios if r]
    a_logs = [math.log(v) for v in head.runs_a if v]
    out["run_level"] = {
        "repeat_log_ratios": logs,
        "sd": statistics.stdev(logs) if len(logs) >= 2 else None,
        "run_variance": head.run_variance,
        "run_noise_equivalent": None
        if head.run_variance is None
        else math.sqrt(head.run_variance / 2),
    }
    out["between_plans_sd"] = statistics.stdev(a_logs) if len(a_logs) >= 2 else None
    out["headline"] = {
        "ratio": head.ratio,
        "ci": [head.ci_low, head.ci_high],
        "verdict": head.verdict,
        "detectable_change": head.detectable,
        "ci_sessions": head.ci_sessions,
    }
    text = orjson.dumps(out, option=orjson.OPT_INDENT_2)
    print(text.decode())
    if args.json is not None:
        args.json.write_bytes(text)


if __name__ == "__main__":
    main()

"""How often the A/B verdict is wrong, how often it finds a known effect, and whether its interval
covers the truth: the tool's own design and estimator on simulated engines with real-engine
timing noise. Printed, and written as JSON with --json; never asserted in tests.

The design is `agentab ab`'s: repeat k of both arms replays one plan (replay seed and prompt
salt shared, engine seed shared, so spec-decode acceptance draws are the same too); repeats
differ by plan seed. Each arm's engine draws its own timing noise (agentab.engine.noise:
log-normal per step, `--step-noise`, and per run, `--run-noise`), so the two arms of one plan
differ as two runs of a real engine do: step times, which batches form, how far each lane gets
in the window. The estimator is `compare_runs`, exactly what `agentab ab` reports.

- A/A pair: both arms `auto`, noise seeds differ. A false positive is a "better" or "worse"
  headline verdict.
- Known effect e: the same pair with arm B's inter-chunk gaps divided by (1 + e) (ITL / (1 + e),
  TTFT unchanged), so B/A of P90 interactivity is exactly (1 + e) times the A/A ratio, whose
  expectation is 1 by symmetry. Power: the share of "better" (e > 0) or "worse" (e < 0)
  verdicts; coverage: the share of intervals that contain 1 + e.
- Request-count design (`--lane-requests N`): runs end after N profiling requests per lane
  instead of a window, the other way to give both arms the same requests.
- Sequential (`--sequential-pairs`): other pairs replayed block by block (one repeat per arm a
  block, each with its own plan), `ab --until-decided`'s stopping rule applied after each block;
  the budget to a verdict is counted in blocks.

- Sequential blocks are short (`--block-fraction`, a twelfth of a fixed-design window in the
  committed figures; `agentab ab --until-decided --block-seconds` in the product): the
  sequence does not know the blocks' variance, so it pays in blocks, not in seconds.

    python benchmarks/bench_verdicts.py [--aa-pairs 100] [--effect-pairs 50]
        [--effects 0.03 0.05 0.10 -0.05] [--repeats 3] [--concurrency 1 8]
        [--duration 1:3600,8:900] [--step-noise 0.02] [--run-noise 0.005]
        [--workers 2 | --ray ADDRESS] [--json benchmarks/results/verdicts.json]

The pairs are independent tasks, fanned out as `agentab ab`'s runs are
(`agentab.experiments.fanout`): `--workers N` local processes, or `--ray ADDRESS` Ray tasks on
a cluster (`local`: one started here with `--workers` CPUs). Every pair is a function of its
seeds, so the figures are the same however they are spread; a pair that fails is tried once
more, and one that fails twice ends the script with its name.

Simulating is most of the cost: `--keep DIR --simulate-only` keeps every run (numbered from
`--first-pair`, so later calls add pairs), and `--from DIR` judges the kept runs with the same
settings, so an estimator can be measured again without simulating again.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import polars as pl

ENGINE = {
    "profile": "gb300-tp16-kimi-k3",
    "decode_backend": "auto",
    "num_draft_tokens": 7,
    "acceptance_probs": [0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42],
}
HEADLINE = "p90_interactivity_tok_s"


_WORKLOADS: dict[str, Any] = {}


def simulate_pair(job: dict[str, Any]) -> list[tuple[Any, Any]]:
    """Both arms of `repeats` repeats of one pair: [(summary A_k, summary B_k), ...].

    With `job["reuse"]` the runs are read from where an earlier `--keep` left them instead."""
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run

    root = Path(job["root"] or tempfile.mkdtemp(prefix="bench-verdicts-"))
    out = []
    try:
        for k in range(job["repeats"]):
            plan_seed = job["seed"] + 1_000 * k
            summaries = []
            for arm in ("a", "b"):
                run_dir = root / arm / f"run-{k}"
                if not job.get("reuse"):
                    run_dir = _simulate_run(job, k, plan_seed, arm, run_dir)
                summaries.append(summarize_run(load_run(run_dir)))
            out.append((summaries[0], summaries[1]))
    finally:
        if not job.get("keep"):
            shutil.rmtree(root, ignore_errors=True)
    return out


def _simulate_run(
    job: dict[str, Any], repeat: int, plan_seed: int, arm: str, run_dir: Path
) -> Path:
    from agentab.replay import simulate_to_dir
    from agentab.replay.options import ReplayOptions

    key = (job["sessions"], job["workload_seed"])
    workload = _WORKLOADS.get(key)
    if workload is None:  # once per worker: a run freezes what it replays (gc.freeze)
        workload = _WORKLOADS[key] = _generated(*key)
    noise_seed = 7_919 * plan_seed + (0 if arm == "a" else 1)
    return simulate_to_dir(
        workload,
        engine_options={
            **ENGINE,
            "seed": plan_seed,
            "step_noise": job["step_noise"],
            "run_noise": job["run_noise"],
            "noise_seed": noise_seed,
        },
        replay=ReplayOptions(
            concurrency=job["concurrency"],
            duration_s=None if job.get("lane_requests") else job["duration_s"],
            lane_requests=job.get("lane_requests"),
            warmup_requests=2,
            seed=plan_seed,
            prompt_salt="bench",
        ),
        out_dir=run_dir,
        manifest_extra={"arm": "auto", "repeat": repeat},
        progress=False,
    )


def _generated(sessions: int, seed: int) -> Any:
    """The generated workload, written and read back as a file (as `agentab ab` reads one)
    where this worker runs: a Ray node has no disk in common with the driver."""
    from agentab.workloads import load, save
    from agentab.workloads.generator import generate, load_config

    with tempfile.TemporaryDirectory(prefix="bench-verdicts-") as tmp:
        path = Path(tmp) / "workload.jsonl"
        save(generate(load_config("agentx-coding"), sessions, seed), path)
        return load(path)


def with_effect(summary: Any, effect: float) -> Any:
    """The run as if its decode were 1 + effect times as fast: ITL / (1 + e), TTFT unchanged."""
    from agentab.analysis.summary import RunSummary

    f = 1.0 + effect
    requests = summary.requests.with_columns(
        itl_s=pl.col("itl_s") / f,
        interactivity_tok_s=pl.col("interactivity_tok_s") * f,
        decode_s=pl.col("decode_s") / f,
        e2e_s=pl.col("ttft_s") + pl.col("decode_s") / f,
    )
    return RunSummary(summary.run, requests, summary.values, summary.sessions)


def judge(pairs: list[tuple[Any, Any]], effect: float, resamples: int, seed: int) -> dict:
    from agentab.analysis.compare import compare_summaries

    a = [p[0] for p in pairs]
    b = [with_effect(p[1], effect) if effect else p[1] for p in pairs]
    result = compare_summaries(a, b, resamples=resamples, seed=seed)
    head = result.metrics[HEADLINE]
    return {
        "verdict": head.verdict,
        "ratio": head.ratio,
        "ci": [head.ci_low, head.ci_high],
        "detectable": head.detectable,
        "run_variance": head.run_variance,
        "matched_dropped": None if result.matching is None else result.matching.dropped_share,
        "sessions": [result.size_a.sessions, result.size_b.sessions],
        "requests": [result.size_a.itl_requests, result.size_b.itl_requests],
    }


def pair_task(job: dict[str, Any]) -> dict[str, Any]:
    """Simulate one pair and judge it: as A/A and under every effect (fixed design), or block by
    block as `ab --until-decided` stops (sequential)."""
    pairs = simulate_pair(job)
    out: dict[str, Any] = {
        "pair": job["pair"],
        "mode": job["mode"],
        "concurrency": job["concurrency"],
        "fixed": {},
        "sequential": {},
    }
    if job.get("simulate_only"):
        return out
    if job["mode"] == "fixed":
        for effect in job["effects"]:
            out["fixed"][str(effect)] = judge(pairs, effect, job["resamples"], job["seed"])
        return out
    from agentab.analysis.sequential import sequential_decision

    for effect in job["effects"]:
        blocks = [(a, with_effect(b, effect) if effect else b) for a, b in pairs]
        out["sequential"][str(effect)] = sequential_decision(blocks).to_json()
    return out


def _span(pairs: list[list[int]]) -> list[int]:
    return [min(min(p) for p in pairs), max(max(p) for p in pairs)]


def summarize(results: list[dict[str, Any]], effect: float, key: str = "fixed") -> dict:
    rows = [r[key][str(effect)] for r in results if str(effect) in r[key]]
    if not rows:
        return {}
    if key == "fixed":
        decided = {"better", "worse"}
        hits = sum(r["verdict"] in decided for r in rows)
        right = sum(r["verdict"] == ("better" if effect > 0 else "worse") for r in rows)
        truth = 1.0 + effect
        covered = sum(r["ci"][0] is not None and r["ci"][0] <= truth <= r["ci"][1] for r in rows)
        mdes = [r["detectable"] for r in rows if r["detectable"] is not None]
        return {
            "pairs": len(rows),
            "false_positive_rate" if effect == 0 else "power": (hits if effect == 0 else right)
            / len(rows),
            "coverage": covered / len(rows),
            "equivalent": sum(r["verdict"] == "equivalent" for r in rows) / len(rows),
            "median_detectable": statistics.median(mdes) if mdes else None,
            "median_ratio": statistics.median(r["ratio"] for r in rows) / truth,
            "median_dropped": statistics.median(
                r["matched_dropped"] for r in rows if r["matched_dropped"] is not None
            ),
            "sessions": [
                min(min(r["sessions"]) for r in rows),
                max(max(r["sessions"]) for r in rows),
            ],
            "requests": [
                min(min(r["requests"]) for r in rows),
                max(max(r["requests"]) for r in rows),
            ],
        }
    decided = [r for r in rows if r["verdict"] in ("better", "worse", "equivalent")]
    wrong = sum(
        (r["verdict"] in ("better", "worse"))
        if effect == 0
        else r["verdict"] != ("better" if effect > 0 else "worse")
        for r in decided
    )
    return {
        "pairs": len(rows),
        "decided": len(decided) / len(rows),
        "error_rate": wrong / len(rows),
        "median_blocks": statistics.median(r["blocks"] for r in rows),
        "verdicts": {v: sum(r["verdict"] == v for r in rows) for v in {r["verdict"] for r in rows}},
    }


def pair_jobs(
    args: argparse.Namespace,
    c: int,
    window_s: float,
    root: Path | None,
    kept: dict[str, bool],
) -> list[dict[str, Any]]:
    """The pairs of one concurrency: fixed design (A/A and the effects), then sequential."""
    common = {
        "sessions": args.sessions,
        "workload_seed": 42,
        "concurrency": c,
        "step_noise": args.step_noise,
        "run_noise": args.run_noise,
        "resamples": args.resamples,
        **kept,
    }

    def where(name: str) -> str | None:
        return None if root is None else str(root / f"c{c}" / name)

    jobs = []
    pairs = max(args.aa_pairs, args.effect_pairs)
    for i in range(args.first_pair, args.first_pair + pairs):
        chosen = [0.0] if i - args.first_pair < args.aa_pairs else []
        chosen += args.effects if i - args.first_pair < args.effect_pairs else []
        jobs.append(
            {
                **common,
                "mode": "fixed",
                "root": where(f"pair-{i}"),
                "pair": i,
                "seed": 100_000 * c + 17 * i,
                "duration_s": window_s,
                "repeats": args.repeats,
                "effects": chosen,
                "lane_requests": args.lane_requests,
            }
        )
    for i in range(args.first_pair, args.first_pair + args.sequential_pairs):
        jobs.append(
            {
                **common,
                "mode": "sequential",
                "root": where(f"seq-{i}"),
                "pair": i,
                "seed": 500_000 + 100_000 * c + 17 * i,
                "duration_s": window_s * args.block_fraction,
                "repeats": args.max_blocks,
                "effects": [0.0, 0.10],
            }
        )
    return jobs


def job_label(job: dict[str, Any]) -> str:
    return f"c{job['concurrency']} {job['mode']} pair {job['pair']}"


def run_jobs(args: argparse.Namespace, jobs: list[dict[str, Any]]) -> dict[int, list[dict]]:
    """Every pair on the chosen backend; the results by concurrency."""
    from agentab.errors import AgentabError
    from agentab.experiments.fanout import fan_out

    if args.ray is not None:
        from agentab.experiments.ray_cluster import RayCalls
        from agentab.ray_connect import LOCAL, connect

        cpus = connect(args.ray, args.workers if args.ray == LOCAL else None)
        backend: Any = RayCalls(pair_task, cpus)
    else:
        from agentab.experiments.pool import ProcessBackend

        # a worker is replaced after 5 pairs: bounds what each worker's runs leave behind
        backend = ProcessBackend(None, args.workers, pair_task, max_tasks=5)
    results: dict[int, list[dict]] = {}
    t0 = time.monotonic()

    def done(result: dict[str, Any], line: str) -> None:
        results.setdefault(result["concurrency"], []).append(result)
        n = sum(map(len, results.values()))
        if n % 10 == 0 or n == len(jobs):
            print(f"  {n}/{len(jobs)} pairs ({time.monotonic() - t0:.0f} s): {line}", flush=True)

    try:
        fan_out(backend, jobs, done, log=lambda line: print(line, flush=True), variable=None,
                interval_s=60.0, label=job_label, command="bench_verdicts",
                again="no figures were written")  # fmt: skip
    except AgentabError as exc:
        sys.exit(f"bench_verdicts: error: {exc}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aa-pairs", type=int, default=100)
    ap.add_argument("--effect-pairs", type=int, default=50)
    ap.add_argument("--effects", type=float, nargs="+", default=[0.03, 0.05, 0.10, -0.05])
    ap.add_argument(
        "--first-pair",
        type=int,
        default=0,
        help="number the pairs (and seed them) from here: more pairs for an earlier --keep",
    )
    ap.add_argument("--repeats", type=int, default=3, help="repeats per arm (fixed design)")
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument("--duration", default="1:3600,8:900", help="CONC:SECONDS,... per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--step-noise", type=float, default=0.02)
    ap.add_argument("--run-noise", type=float, default=0.005)
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument(
        "--sequential-pairs", type=int, default=50, help="pairs run block by block (A/A, +10%%)"
    )
    ap.add_argument("--max-blocks", type=int, default=6, help="sequential: most blocks")
    ap.add_argument(
        "--block-fraction",
        type=float,
        default=1 / 3,
        help="sequential: a block's window as a fraction of a fixed-design run's",
    )
    ap.add_argument(
        "--lane-requests",
        type=int,
        default=None,
        help="end each run after N profiling requests per lane instead of a window (the other "
        "paired design)",
    )
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep every simulated run under this directory (to judge again with --from)",
    )
    ap.add_argument(
        "--from",
        dest="reuse",
        type=Path,
        default=None,
        help="judge the runs an earlier --keep left here instead of simulating (same settings)",
    )
    ap.add_argument(
        "--simulate-only", action="store_true", help="with --keep: simulate, judge nothing"
    )
    ap.add_argument(
        "--workers", type=int, default=2, help="local processes (with --ray local: its CPUs)"
    )
    ap.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the pairs as Ray tasks: local, auto, HOST:PORT or ray://HOST:10001",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.ray is not None and (args.keep is not None or args.reuse is not None):
        ap.error("--keep and --from keep the runs on this host's disk: not with --ray")

    windows = {int(c): float(w) for c, w in (x.split(":") for x in args.duration.split(","))}
    started = time.monotonic()
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "engine": ENGINE,
        "step_noise": args.step_noise,
        "run_noise": args.run_noise,
        "repeats": args.repeats,
        "lane_requests": args.lane_requests,
        "sequential": {"max_blocks": args.max_blocks, "block_fraction": args.block_fraction},
        "sessions": args.sessions,
        "resamples": args.resamples,
        "concurrency": {},
    }
    effects = [0.0, *args.effects]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.reuse or args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        print(
            f"{args.aa_pairs} A/A pairs, {args.effect_pairs} pairs per effect "
            f"{', '.join(f'{e:+.0%}' for e in args.effects)}; {args.repeats} repeats per arm; "
            f"{args.sessions} generated sessions; windows {args.duration}; step noise "
            f"{args.step_noise}, run noise {args.run_noise}; {args.resamples} resamples",
            flush=True,
        )
        kept = {
            "keep": args.keep is not None or args.reuse is not None,
            "reuse": args.reuse is not None,
            "simulate_only": args.simulate_only,
        }
        # on a Ray node a pair's runs go to that node's temporary dir, removed after judging
        runs_root = None if args.ray is not None else root
        jobs = []
        for c in args.concurrency:
            jobs += pair_jobs(args, c, windows[c], runs_root, kept)
        by_conc = run_jobs(args, jobs)
        for c in args.concurrency:
            if args.simulate_only:
                continue
            results = sorted(by_conc[c], key=lambda r: (r["mode"], r["pair"]))
            per: dict[str, Any] = {"window_s": windows[c], "fixed": {}, "sequential": {}}
            for e in effects:
                per["fixed"][f"{e:+.2f}"] = summarize(results, e)
            if args.sequential_pairs:
                fixed_seconds = args.repeats * windows[c]
                for e in (0.0, 0.10):
                    row = summarize(results, e, "sequential")
                    block = windows[c] * args.block_fraction
                    row["median_budget_vs_fixed"] = row["median_blocks"] * block / fixed_seconds
                    per["sequential"][f"{e:+.2f}"] = row
            report["concurrency"][str(c)] = per
            print(f"concurrency {c} ({windows[c]:g} s windows):")
            for name, row in per["fixed"].items():
                print(f"  fixed {name}: {row}")
            for name, row in per["sequential"].items():
                print(f"  sequential {name}: {row}")
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(f"done in {report['wall_s']:.0f} s")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

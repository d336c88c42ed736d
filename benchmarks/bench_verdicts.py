"""How often the A/B verdict is wrong (A/A false positives) and how often it finds a known
effect (power), on real simulator runs; printed, never asserted.

A/A: both sides are the same arm (`auto`, gb300-tp16-kimi-k3, spec decode as in the example
experiment); each repeat of side B uses other replay and engine seeds than side A's, so the two
sides differ by every source of noise the simulator has (lane start points, co-scheduled
sessions, spec-decode acceptance draws). Runs are labelled with their repeat, so the comparison
pairs them by repeat as `agentab ab` does. A pair is a false positive when the headline verdict
(P90 interactivity) is "better" or "worse"; the rate over the printed table's metrics is shown
beside it. Goal: <= 5% at concurrency 1 and 8.

Power: the same B runs with every inter-chunk gap shortened by the effect (ITL / 1.05, so P90
interactivity is exactly 5% higher, TTFT unchanged), against the same A runs.

Single runs: the first repeat of each pair alone. The verdict must be "no verdict"; the share of
pairs whose session-bootstrap CI excludes 1 shows why.

    python benchmarks/bench_verdicts.py [--pairs 20] [--repeats 3] [--concurrency 1 8]
        [--duration 1:3600,8:900] [--workers 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import polars as pl

ENGINE = {
    "profile": "gb300-tp16-kimi-k3",
    "decode_backend": "auto",
    "num_draft_tokens": 7,
    "acceptance_probs": [0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42],
}


RUN_LIMIT_S = 300
"""Wall-clock limit of one simulated run; a run that exceeds it is replaced (see `simulate`)."""


def _alarm(signum: int, frame: object) -> None:
    raise TimeoutError(f"simulated run exceeded {RUN_LIMIT_S} s of wall time")


def simulate(job: tuple[Path, Path, int, int, float, int]) -> tuple[Path, list[str]]:
    """One run of the A/A arm into `out`; repeat `repeat`, seeds `seed`.

    A run whose engine fails (an exception inside the engine's step loop leaves the replay
    waiting, so a wall-clock alarm ends it) is replaced by one with the next seed, and the
    failure is returned so the summary can count it.
    """
    import signal

    from agentab.replay import simulate_to_dir
    from agentab.replay.options import ReplayOptions
    from agentab.workloads import load

    workload_path, out, seed, concurrency, duration_s, repeat = job
    workload = load(workload_path)
    failures: list[str] = []
    signal.signal(signal.SIGALRM, _alarm)
    for attempt in range(5):
        s = seed + 1_000_000 * attempt
        replay = ReplayOptions(
            concurrency=concurrency, duration_s=duration_s, warmup_requests=2, seed=s
        )
        target = out if attempt == 0 else out.with_name(f"{out.name}-retry{attempt}")
        signal.alarm(RUN_LIMIT_S)
        try:
            path = simulate_to_dir(
                workload,
                engine_options={**ENGINE, "seed": s},
                replay=replay,
                out_dir=target,
                manifest_extra={"arm": "auto", "repeat": repeat},
                progress=False,
            )
            return path, failures
        except Exception as exc:  # the engine's failure, recorded and replaced
            failures.append(f"seed {s}: {type(exc).__name__}: {str(exc)[:100]}")
        finally:
            signal.alarm(0)
        shutil.rmtree(target, ignore_errors=True)
    raise RuntimeError(f"{out}: five seeds failed: {failures}")


def with_effect(run: Path, out: Path, effect: float) -> Path:
    """A copy of `run` whose chunks after the first arrive `1 + effect` times sooner."""
    from agentab.replay.records import RECORD_SCHEMA, RECORDS_DIR, PartWriter, scan_records

    records = scan_records(run).collect()
    first = pl.col("chunk_times_s").list.first()
    faster = records.with_columns(
        chunk_times_s=pl.col("chunk_times_s").list.eval(
            pl.element().first() + (pl.element() - pl.element().first()) / (1.0 + effect)
        )
    )
    assert faster.select(first).equals(records.select(first))
    out.mkdir(parents=True)
    shutil.copyfile(run / "manifest.json", out / "manifest.json")
    with PartWriter(out / RECORDS_DIR, RECORD_SCHEMA) as writer:
        writer.add_many(faster.to_dicts())
    return out


def judge(job: tuple[list[Path], list[Path], int]) -> dict[str, object]:
    """Compare B against A; the headline's verdict and CIs, and every table metric's verdict."""
    from agentab.analysis.compare import compare_runs
    from agentab.analysis.load import load_run
    from agentab.analysis.markdown import TABLE_METRICS

    a, b, resamples = job
    result = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], resamples=resamples)
    head = result.metrics["p90_interactivity_tok_s"]
    return {
        "verdict": head.verdict,
        "ratio": head.ratio,
        "ci": (head.ci_low, head.ci_high),
        "ci_sessions": head.ci_sessions,
        "table": [result.metrics[name].verdict for name in TABLE_METRICS],
        "sessions": (result.size_a.sessions, result.size_b.sessions),
    }


def rate(results: list[dict[str, object]], verdicts: set[str]) -> str:
    hits = sum(r["verdict"] in verdicts for r in results)
    return f"{hits}/{len(results)} = {hits / len(results):.1%}"


def table_rate(results: list[dict[str, object]]) -> str:
    verdicts = [v for r in results for v in r["table"]]  # type: ignore[attr-defined]
    judged = [v for v in verdicts if v != "n/a"]
    hits = sum(v in ("better", "worse") for v in judged)
    return f"{hits}/{len(judged)} = {hits / len(judged):.1%}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument(
        "--duration",
        default="1:3600,8:900",
        help="Profiling window per concurrency, CONC:SECONDS,... (one lane plays about two "
        "sessions per 900 s, so concurrency 1 needs AgentX's full hour to reach the minimum "
        "sample of 10 sessions per arm over 3 repeats)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--effect", type=float, default=0.05)
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    # Workers are spawned, not forked: polars' thread pool does not survive a fork.

    from agentab.workloads import save
    from agentab.workloads.generator import generate, load_config

    windows = {int(c): float(w) for c, w in (x.split(":") for x in args.duration.split(","))}
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as tmp,
        ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        root = Path(tmp)
        workload = root / "workload.jsonl"
        save(generate(load_config("agentx-coding"), args.sessions, 42), workload)
        print(
            f"{args.pairs} pairs x {args.repeats} repeats per side, {args.sessions} generated "
            f"sessions, windows {args.duration} (concurrency:s), {args.resamples} bootstrap "
            "resamples, "
            f"effect {args.effect:.0%}"
        )
        for c in args.concurrency:
            jobs, names = [], []
            for i in range(args.pairs):
                for side, offset in (("a", 0), ("b", 50)):
                    for k in range(args.repeats):
                        seed = 100_000 * c + 100 * i + offset + k
                        out = root / f"c{c}" / f"pair-{i}" / side / f"run-{k}"
                        jobs.append((workload, out, seed, c, windows[c], k))
                        names.append((i, side))
            done = list(pool.map(simulate, jobs))
            failed = [f for _, fails in done for f in fails]
            sides: dict[tuple[int, str], list[Path]] = {}
            for key, (path, _) in zip(names, done, strict=True):
                sides.setdefault(key, []).append(path)
            for i in range(args.pairs):
                sides[i, "b+"] = [
                    with_effect(p, p.parent.parent / "b+" / p.name, args.effect)
                    for p in sides[i, "b"]
                ]
            pairs = range(args.pairs)
            aa = list(
                pool.map(judge, [(sides[i, "a"], sides[i, "b"], args.resamples) for i in pairs])
            )
            ab = list(
                pool.map(judge, [(sides[i, "a"], sides[i, "b+"], args.resamples) for i in pairs])
            )
            one = list(
                pool.map(
                    judge, [(sides[i, "a"][:1], sides[i, "b"][:1], args.resamples) for i in pairs]
                )
            )
            excl = sum(
                r["ci_sessions"] is not None
                and not (r["ci_sessions"][0] <= 1.0 <= r["ci_sessions"][1])
                for r in one
            )
            sessions = [s for r in aa for s in r["sessions"]]  # type: ignore[attr-defined]
            print(f"concurrency {c} ({min(sessions)}-{max(sessions)} sessions per side):")
            print(f"  runs whose engine failed and were replaced by the next seed: {len(failed)}")
            for failure in failed:
                print(f"    {failure}")
            print(f"  A/A false-positive rate (headline verdict): {rate(aa, {'better', 'worse'})}")
            print(f"  A/A false-positive rate (all table metrics): {table_rate(aa)}")
            print(f"  A/A verdicts: {dict(Counter(r['verdict'] for r in aa))}")
            print(f"  power at +{args.effect:.0%} (headline 'better'): {rate(ab, {'better'})}")
            shift = sorted(x["ratio"] / y["ratio"] for x, y in zip(ab, aa, strict=True))  # type: ignore[operator]
            print(
                f"  A/B verdicts: {dict(Counter(r['verdict'] for r in ab))}; the effect as "
                f"measured (A/B ratio / A/A ratio): {shift[0]:.4f} - {shift[-1]:.4f}"
            )
            print(
                f"  single runs: verdicts {dict(Counter(r['verdict'] for r in one))}; the session "
                f"bootstrap CI alone excluded 1 in {excl}/{len(one)}"
            )
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

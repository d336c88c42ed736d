"""Where a fidelity check's TTFT error comes from: request by request, by prompt shape, and at P90.

Reads an A/B experiment dir measured on an engine and the simulated runs `agentab fidelity`
wrote for it (`<fidelity out>/simulated`), pairs each request with its simulated self (same
plan, same request id) and prints:
- per bucket of uncached prompt tokens, over the requests that found nothing else in flight
  when they were sent (in both runs), the median measured and simulated TTFT and their median
  difference, beside the padding the engine's prefill graphs add to a step of that many tokens
  (their sizes from the measured run's manifest, `prefill_graph_tokens`);
- the same split by what was in flight (a request sent beside another runs its prefill in a
  mixed step);
- each arm's pooled TTFT quantiles around P90 (all completed requests, as the fidelity report
  pools them) and how many requests lie above the gap a bimodal TTFT leaves: where P90 falls on
  that gap, one or two requests more or fewer above it move P90 by tens of percent;
- the measured P90's 95% interval from resampling sessions (pooled over the repeats, as the
  A/B report's bootstrap resamples them): how far the sample itself lets P90 move.

    python benchmarks/ttft_measured_vs_simulated.py AB_DIR SIMULATED_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentab.analysis.bootstrap import percentile_ci, resample_weights, weighted_quantiles  # noqa: E402
from agentab.engine.paths import graph_padding  # noqa: E402
from agentab.rundir import read_manifest, scan_records  # noqa: E402

EDGES = [32, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192]


def requests(run: Path) -> pl.DataFrame:
    """A run's completed profiling requests: TTFT, uncached tokens and how many other requests
    of the run were in flight when each was sent."""
    r = (
        scan_records(run)
        .filter(pl.col("error_class").is_null())
        .with_columns(
            pl.col("chunk_times_s").list.first().alias("ttft"),
            (pl.col("sent_s") + pl.col("chunk_times_s").list.last()).alias("end_s"),
            (pl.col("prompt_tokens") - pl.col("cached_tokens")).alias("new"),
        )
        .collect()
    )
    sent, end = r["sent_s"].to_numpy(), r["end_s"].to_numpy()
    busy = [int(((sent < s) & (end > s)).sum()) for s in sent]
    return (
        r.with_columns(pl.Series("in_flight", busy))
        .filter(pl.col("phase") == "profiling")
        .select("request_id", "session_id", "ttft", "new", "cached_tokens", "in_flight")
    )


def bucket_label(new: int) -> str:
    """The EDGES interval holding `new`, named so that its names sort in order."""
    i = int(np.searchsorted(EDGES, new))
    lo = EDGES[i - 1] + 1 if i else 0
    return f"{lo:>5}-{EDGES[i]}" if i < len(EDGES) else f"{lo:>5}-"


def p90_session_interval(
    measured: pl.DataFrame, draws: int = 10_000, seed: int = 42
) -> tuple[float, float]:
    """95% interval of the pooled P90 TTFT over `draws` resamples of the sessions (the
    analysis package's session bootstrap)."""
    frame = measured.sort("ttft")
    sessions = frame["session_id"].to_numpy()
    names, groups = np.unique(sessions, return_inverse=True)
    weights = resample_weights(np.random.default_rng(seed), draws, len(names))
    p90 = weighted_quantiles(frame["ttft"].to_numpy(), groups, weights, [0.9])[:, 0]
    return percentile_ci(p90, 0.95)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("ab_dir", type=Path, help="the measured A/B experiment dir (arm/run-N)")
    ap.add_argument("simulated", type=Path, help="agentab fidelity's simulated dir for it")
    args = ap.parse_args()
    arms = sorted(p.name for p in args.ab_dir.iterdir() if p.is_dir() and any(p.glob("run-*")))
    first_run = next((args.ab_dir / arms[0]).glob("run-*"))
    sizes = read_manifest(first_run).get("prefill_graph_tokens") or []
    paired, pooled = [], {}
    for arm in arms:
        measured, simulated = [], []
        for run in sorted((args.ab_dir / arm).glob("run-*")):
            m, s = requests(run), requests(args.simulated / arm / run.name)
            measured.append(m)
            simulated.append(s)
            joined = m.join(s, on="request_id", suffix="_sim")
            paired.append(joined.with_columns(pl.lit(arm).alias("arm")))
        pooled[arm] = (pl.concat(measured), pl.concat(simulated)["ttft"].to_numpy())
    j = pl.concat(paired).with_columns(
        ((pl.col("ttft") - pl.col("ttft_sim")) * 1000).alias("diff_ms"),
        pl.col("new")
        .map_elements(lambda n: graph_padding(n, sizes), return_dtype=pl.Int64)
        .alias("pad"),
        pl.col("new").map_elements(bucket_label, return_dtype=pl.String).alias("uncached tokens"),
    )
    print(
        f"{len(j)} requests paired over {len(arms)} arm(s); TTFT in ms, diff = measured - simulated"
    )
    alone = j.filter((pl.col("in_flight") == 0) & (pl.col("in_flight_sim") == 0))
    table = (
        alone.group_by("uncached tokens")
        .agg(
            pl.len().alias("requests"),
            pl.col("new").median().alias("uncached (median)"),
            pl.col("cached_tokens").median().alias("cached (median)"),
            (pl.col("ttft").median() * 1000).round(1).alias("measured"),
            (pl.col("ttft_sim").median() * 1000).round(1).alias("simulated"),
            pl.col("diff_ms").median().round(1).alias("diff"),
            pl.col("pad").median().alias("padding tokens (median)"),
        )
        .sort("uncached tokens")
    )
    print("\nNothing else in flight (measured and simulated):")
    print(table)
    print("\nBy requests in flight at the send (measured, simulated):")
    print(
        j.group_by("in_flight", "in_flight_sim")
        .agg(pl.len().alias("requests"), pl.col("diff_ms").median().round(1).alias("diff (median)"))
        .sort("in_flight", "in_flight_sim")
    )
    for arm, (frame, s) in pooled.items():
        m = frame["ttft"].to_numpy()
        print(f"\n{arm}: {len(m)} measured, {len(s)} simulated requests (all completed, pooled)")
        for q in (0.86, 0.87, 0.88, 0.89, 0.90, 0.91, 0.92):
            a, b = np.quantile(m, q) * 1000, np.quantile(s, q) * 1000
            error = (b / a - 1) * 100
            print(f"  P{q * 100:.0f}: measured {a:7.1f}  simulated {b:7.1f}  ({error:+.1f}%)")
        lo, hi = p90_session_interval(frame)
        p90 = np.quantile(m, 0.9)
        print(
            f"  measured P90 {p90 * 1000:.1f}, 95% interval over "
            f"{frame['session_id'].n_unique()} sessions resampled {lo * 1000:.1f}-{hi * 1000:.1f}"
            f" ({lo / p90 - 1:+.1%} to {hi / p90 - 1:+.1%})"
        )
        gap = 0.3
        print(
            f"  above {gap * 1000:.0f} ms: measured {(m > gap).sum()}, simulated {(s > gap).sum()}"
        )


if __name__ == "__main__":
    with pl.Config(tbl_rows=20, tbl_cols=12, tbl_width_chars=160):
        main()

"""What one arm's runs contribute to a comparison, pooled over repeats, indexed by session.

Each compared metric is written once, as a function of a session-weight matrix W: with W all
ones it is the pooled point estimate, with bootstrap weights it is a resample. Pooling over
repeats: percentiles are taken over all requests of all runs of the arm, and throughputs are
total tokens over total seconds (the runs' phase wall times, or decode-busy times, added up).
Throughput denominators stay fixed under resampling: the bootstrap captures which sessions were
played, the run-to-run spread (reported beside it) captures timing noise between runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from agentab.analysis.bootstrap import QuantileLayout, weighted_quantiles
from agentab.analysis.slo import Slo
from agentab.analysis.summary import CANCELLED, QUANTILES, RunSummary


@dataclass(frozen=True)
class Metric:
    """One compared metric: its summary.json name, label, unit and which direction is better."""

    name: str
    label: str
    unit: str
    higher_is_better: bool


def _dist(key: str, label: str, unit: str, higher: bool) -> list[Metric]:
    stats = [("mean", "mean"), *((k, k) for k in QUANTILES)]
    return [Metric(f"{key}.{s}", f"{label} {t}", unit, higher) for s, t in stats]


HEADLINE = Metric(
    "p90_interactivity_tok_s",
    "P90 interactivity = 1/P90(ITL) (InferenceX, headline)",
    "tok/s/user",
    True,
)

METRICS: tuple[Metric, ...] = (
    HEADLINE,
    *_dist("itl_s", "ITL", "s", False),
    *_dist("ttft_s", "TTFT", "s", False),
    *_dist("e2e_s", "E2E latency", "s", False),
    *_dist(
        "interactivity_tok_s", "interactivity, percentiles of 1/ITL_i (AIPerf),", "tok/s/user", True
    ),
    Metric("decode_throughput_tok_s", "decode throughput (prefill excluded)", "tok/s", True),
    Metric("output_throughput_tok_s", "output throughput", "tok/s", True),
    Metric("request_throughput_req_s", "request throughput (successful)", "req/s", True),
    Metric(
        "throughput_per_gpu_tok_s",
        "throughput per GPU (input incl. cached + output; InferenceX)",
        "tok/s/GPU",
        True,
    ),
    Metric(
        "throughput_per_gpu_uncached_tok_s",
        "throughput per GPU (uncached input + output)",
        "tok/s/GPU",
        True,
    ),
    Metric("cache_hit_ratio", "cache hit ratio (client: cached / prompt tokens)", "", True),
    Metric("error_rate", "error rate", "", False),
)

GOODPUT: tuple[Metric, ...] = (
    Metric("goodput_req_s", "goodput (requests meeting the SLOs)", "req/s", True),
    Metric("slo_attainment", "SLO attainment (share of requests meeting the SLOs)", "", True),
)
"""Compared only when the user sets objectives (agentab.analysis.slo): like the throughputs,
they count every request of the window, so a paired design does not restrict them."""


def metrics_for(slo: Slo | None) -> tuple[Metric, ...]:
    """The metrics a comparison judges: METRICS, and goodput when there are objectives."""
    return METRICS if slo is None else (*METRICS, *GOODPUT)


DISTRIBUTION_KEYS: tuple[str, ...] = ("itl_s", "ttft_s", "e2e_s", "interactivity_tok_s")

PER_REQUEST: frozenset[str] = frozenset(
    m.name for m in METRICS if m is HEADLINE or m.name.partition(".")[0] in DISTRIBUTION_KEYS
)
"""Metrics of the requests' own latencies: in a paired design they compare the requests both
arms completed (agentab.analysis.matching); throughputs, cache hits and the error rate keep
every request of the window."""

_SUMS: dict[str, pl.Expr] = {
    "requests": pl.len(),
    "errors": (~pl.col("ok")).sum(),
    "good": pl.col("meets_slo").sum(),
    "output_tokens": pl.col("osl").filter("ok").sum(),
    "input_tokens": pl.col("prompt_tokens").filter("ok").sum(),
    "decode_tokens": (pl.col("osl") - 1).filter(pl.col("ok") & pl.col("itl_s").is_not_null()).sum(),
    "cached": pl.col("cached_tokens").filter("ok").sum(),
    "cached_prompt": pl.col("prompt_tokens")
    .filter(pl.col("ok") & pl.col("cached_tokens").is_not_null())
    .sum(),
    "cached_reported": pl.col("cached_tokens").filter("ok").is_not_null().sum(),
    **{f"{k}_sum": pl.col(k).filter("ok").sum() for k in DISTRIBUTION_KEYS},
    **{f"{k}_n": pl.col(k).filter("ok").is_not_null().sum() for k in DISTRIBUTION_KEYS},
}


@dataclass(frozen=True)
class ArmSample:
    """Sorted per-request values with their session index, per-session sums, run totals."""

    name: str
    values: dict[str, np.ndarray]
    groups: dict[str, np.ndarray]
    sums: dict[str, np.ndarray]
    wall_s: float
    busy_s: float
    gpu_count: int | None
    layouts: dict[str, QuantileLayout] = field(default_factory=dict, compare=False, repr=False)

    def count(self, metric: Metric) -> int:
        """How many requests enter `metric`: the measured values of a distribution (the
        headline's are the ITLs), else every profiling request of the arm."""
        key = "itl_s" if metric.name == HEADLINE.name else metric.name.partition(".")[0]
        if key in self.values:
            return int(self.values[key].size)
        return int(self.sums["requests"].sum())

    def evaluate(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """Every metric of METRICS for each row of the session-weight matrix."""
        w = weights.astype(np.float64)
        s = {k: w @ v for k, v in self.sums.items()}
        out: dict[str, np.ndarray] = {}
        qs = list(QUANTILES.values())
        for key in DISTRIBUTION_KEYS:
            layout = self.layouts.get(key)
            if layout is None or layout.sessions != weights.shape[1]:
                # built once, reused by every batch of resamples
                layout = QuantileLayout(self.groups[key], weights.shape[1], len(qs))
                self.layouts[key] = layout
            quant = weighted_quantiles(self.values[key], self.groups[key], weights, qs, layout)
            for j, name in enumerate(QUANTILES):
                out[f"{key}.{name}"] = quant[:, j]
            out[f"{key}.mean"] = _div(s[f"{key}_sum"], s[f"{key}_n"])
        out["p90_interactivity_tok_s"] = _div(np.ones_like(out["itl_s.p90"]), out["itl_s.p90"])
        out["decode_throughput_tok_s"] = _div(s["decode_tokens"], np.full(len(w), self.busy_s))
        out["output_throughput_tok_s"] = _div(s["output_tokens"], np.full(len(w), self.wall_s))
        gpus = np.full(len(w), self.wall_s * (self.gpu_count or 0))
        out["request_throughput_req_s"] = _div(
            s["requests"] - s["errors"], np.full(len(w), self.wall_s)
        )
        out["throughput_per_gpu_tok_s"] = _div(s["input_tokens"] + s["output_tokens"], gpus)
        out["throughput_per_gpu_uncached_tok_s"] = _div(
            s["input_tokens"] - s["cached"] + s["output_tokens"], gpus
        )
        hit = _div(s["cached"], s["cached_prompt"])
        out["cache_hit_ratio"] = np.where(s["cached_reported"] > 0, hit, np.nan)
        out["error_rate"] = _div(s["errors"], s["requests"])
        out["goodput_req_s"] = _div(s["good"], np.full(len(w), self.wall_s))
        out["slo_attainment"] = _div(s["good"], s["requests"])
        return out


def _div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _profiling(frames: Sequence[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(
        [f.filter((pl.col("phase") == "profiling") & ~CANCELLED) for f in frames],
        how="vertical",
    )


def session_index(*arms: Sequence[RunSummary]) -> pl.DataFrame:
    """session_id -> dense index over every session seen in any run of either arm."""
    ids = pl.concat(
        [_profiling([s.requests for s in runs]).select("session_id") for runs in arms]
    ).unique()
    return ids.sort("session_id").with_row_index("g")


def build_sample(
    name: str,
    summaries: Sequence[RunSummary],
    sessions: pl.DataFrame,
    frames: Sequence[pl.DataFrame] | None = None,
    slo: Slo | None = None,
) -> ArmSample:
    """Pool an arm's runs into the arrays the bootstrap needs.

    `frames` replaces the runs' request tables (one per run, same order): the requests both
    arms of each repeat completed (agentab.analysis.matching); run totals still come from the
    summaries. `slo`: the objectives goodput counts against (none: no request counts).
    """
    tables = [s.requests for s in summaries] if frames is None else list(frames)
    met = pl.lit(False) if slo is None else slo.met()
    frame = (
        _profiling(tables).with_columns(meets_slo=met).join(sessions, on="session_id", how="left")
    )
    per_session = (
        frame.group_by("g").agg(**_SUMS).join(sessions.select("g"), on="g", how="right").sort("g")
    )
    sums = {k: per_session[k].fill_null(0).cast(pl.Float64).to_numpy() for k in _SUMS}
    values: dict[str, np.ndarray] = {}
    groups: dict[str, np.ndarray] = {}
    for key in DISTRIBUTION_KEYS:
        col = frame.filter(pl.col("ok") & pl.col(key).is_not_null()).select(key, "g").sort(key)
        values[key] = col[key].to_numpy()
        groups[key] = col["g"].cast(pl.Int64).to_numpy()
    gpu_counts = {s.values.get("gpu_count") for s in summaries}
    return ArmSample(
        name=name,
        values=values,
        groups=groups,
        sums=sums,
        wall_s=float(sum(s.values.get("phase_wall_s") or 0.0 for s in summaries)),
        busy_s=float(sum(s.values.get("decode_busy_s") or 0.0 for s in summaries)),
        gpu_count=gpu_counts.pop() if len(gpu_counts) == 1 else None,
    )


MIN_RUNS = 2
MIN_SESSIONS = 10
MIN_REQUESTS = 200
"""The smallest sample per arm that gets a verdict (docs/analysis.md, "Minimum sample", says
why): two runs, because one run cannot show run-to-run noise; 10 sessions, because the session
bootstrap resamples sessions and with fewer clusters its intervals come out too narrow (and a
verdict about a workload should rest on more than a few of its sessions); 200 requests with a
measured ITL, so that the P90 has 20 requests beyond it rather than a handful."""


@dataclass(frozen=True)
class SampleSize:
    """How much one arm measured: runs, sessions played, successful requests, measured ITLs."""

    runs: int
    sessions: int
    requests: int
    itl_requests: int

    def to_json(self) -> dict[str, int]:
        return {
            "runs": self.runs,
            "sessions": self.sessions,
            "requests": self.requests,
            "itl_requests": self.itl_requests,
        }

    def describe(self) -> str:
        return (
            f"{self.runs} run(s), {self.sessions} sessions, {self.requests:,} requests "
            f"({self.itl_requests:,} with an ITL)"
        )


def sample_size(summaries: Sequence[RunSummary], sample: ArmSample) -> SampleSize:
    """The arm's sample: sessions are distinct over its runs, requests add up."""
    sessions = pl.concat(
        [s.requests.filter(pl.col("ok") & (pl.col("phase") == "profiling")) for s in summaries],
        how="vertical",
    )["session_id"].n_unique()
    return SampleSize(
        runs=len(summaries),
        sessions=int(sessions),
        requests=int(sum(s.values.get("requests_ok") or 0 for s in summaries)),
        itl_requests=int(sample.values["itl_s"].size),
    )


def withheld_because(a: SampleSize, b: SampleSize) -> list[str]:
    """Why the comparison gives no better/worse verdict ([] when it may)."""
    reasons = []
    if min(a.runs, b.runs) < MIN_RUNS:
        reasons.append(
            f"fewer than {MIN_RUNS} runs per arm (A {a.runs}, B {b.runs}): a single run cannot "
            "show run-to-run noise, which the session bootstrap misses; use repeats >= 3"
        )
    if min(a.sessions, b.sessions) < MIN_SESSIONS:
        reasons.append(
            f"fewer than {MIN_SESSIONS} sessions per arm (A {a.sessions}, B {b.sessions})"
        )
    if min(a.itl_requests, b.itl_requests) < MIN_REQUESTS:
        reasons.append(
            f"fewer than {MIN_REQUESTS} requests with an ITL per arm "
            f"(A {a.itl_requests}, B {b.itl_requests})"
        )
    return reasons

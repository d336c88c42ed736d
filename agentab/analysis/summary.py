"""Per-run summary: counts, distributions, the P90-interactivity headline, throughputs, caching.

The population of every latency metric is the successful profiling-phase requests; warmup
requests and errors are counted but never enter a latency or throughput figure. Parents and
subagents are each one request, counted once. Percentiles are linear-interpolated (numpy's
default), computed by polars in one aggregation pass over the request table.

The headline is the InferenceX definition: **P90 interactivity = 1 / P90(ITL)**, the slow tail of
per-user decode speed. The percentiles of the per-request 1/ITL_i (AIPerf's "interactivity",
whose p90 is the fast tail) are reported as `interactivity_tok_s`, a different number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from agentab.analysis.load import Run
from agentab.analysis.metrics import request_table

QUANTILES: dict[str, float] = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}
STAT_KEYS: tuple[str, ...] = ("mean", *QUANTILES)
# beside the percentiles, as AIPerf and `vllm bench serve` print them (std: sample, ddof 1)
SPREAD_KEYS: tuple[str, ...] = ("min", "max", "std")

# summary.json name -> request-table column; population: successful profiling requests.
DISTRIBUTIONS: dict[str, str] = {
    "ttft_s": "ttft_s",
    "ttfo_s": "ttfo_s",
    "e2e_s": "e2e_s",
    "decode_s": "decode_s",
    "itl_s": "itl_s",
    "interactivity_tok_s": "interactivity_tok_s",
    "osl_tokens": "osl",
    "prompt_tokens": "prompt_tokens",
    "cached_tokens": "cached_tokens",
}

SUMMARY_FILE = "summary.json"
SESSIONS_FILE = "sessions.csv"

# Requests cancelled by an aborted run (Ctrl-C, error-rate stop) never finished: they are counted
# apart and are neither successes nor server errors.
CANCELLED = pl.col("error_class").fill_null("") == "cancelled"
_profiling = (pl.col("phase") == "profiling") & ~CANCELLED
_ok = pl.col("ok") & _profiling
_has_itl = pl.col("itl_s").is_not_null()


@dataclass(frozen=True)
class RunSummary:
    """A run, its per-request table (all phases, all outcomes) and its summary values."""

    run: Run
    requests: pl.DataFrame
    values: dict[str, Any]
    sessions: pl.DataFrame


def stat_exprs(column: str, name: str) -> list[pl.Expr]:
    """mean and linear percentiles of one column, named `name.mean`, `name.p50`, ..."""
    col = pl.col(column)
    exprs = [col.mean().alias(f"{name}.mean")]
    exprs += [col.quantile(q, "linear").alias(f"{name}.{k}") for k, q in QUANTILES.items()]
    exprs += [col.min().alias(f"{name}.min"), col.max().alias(f"{name}.max")]
    exprs.append(col.std().alias(f"{name}.std"))
    return exprs


def decode_busy_spans(frame: pl.LazyFrame) -> pl.LazyFrame:
    """The disjoint periods during which at least one request was decoding (the union of the
    requests' [first, last] chunk intervals), one `span` (seconds) each, in time order.

    Sorting intervals by start and cutting where a start passes every earlier end gives them
    without a Python loop. Their total is `busy_seconds`: summed outside the lazy query, since
    a group_by's result arrives in chunks that vary with the threads, and a float sum's last
    digit follows how it is split.
    """
    return (
        frame.select(start="first_s", end="end_s")
        .sort("start")
        .with_columns(reach=pl.col("end").cum_max().shift(1))
        .with_columns(group=(pl.col("start") > pl.col("reach")).fill_null(True).cum_sum())
        .group_by("group", maintain_order=True)
        .agg(span=pl.col("end").max() - pl.col("start").min())
        .select("span")
    )


def busy_seconds(spans: pl.DataFrame) -> float:
    """Seconds of decode_busy_spans' periods, the same to the last digit on every run."""
    return float(spans["span"].rechunk().sum())


def series_deltas(metrics: pl.DataFrame, name: str, since_s: float | None) -> pl.DataFrame:
    """Increase of each series (label set) of a Prometheus counter over the profiling phase:
    columns `labels` (the label set as sorted JSON) and `delta`.

    The baseline is each series' last sample at or before the phase start. A series with no
    sample then counts from 0 when scraping was already running (any series sampled by then):
    a server creates a labelled series when it first counts in it, so its first sample already
    holds what it counted before that scrape. Only when scraping began after the phase start
    (no sample by then at all) is a series' first sample the baseline."""
    since = float("-inf") if since_s is None else since_s
    scraping_then = metrics.filter(pl.col("t_s") <= since).height > 0
    missing_base = pl.lit(0.0) if scraping_then else pl.col("first")
    return (
        metrics.filter(pl.col("name") == name)
        .sort("t_s")
        .group_by("labels", maintain_order=True)
        .agg(
            last=pl.col("value").last(),
            base=pl.col("value").filter(pl.col("t_s") <= since).last(),
            first=pl.col("value").first(),
        )
        .select("labels", delta=pl.col("last") - pl.coalesce("base", missing_base))
    )


def counter_delta(metrics: pl.DataFrame, name: str, since_s: float | None) -> float | None:
    """Increase of a Prometheus counter over the profiling phase, summed over its series (a
    server's engine cores, model names: the counter's total), or None when it was not scraped.
    A counter whose series must stay apart (one per draft position) is read with
    `series_deltas`."""
    deltas = series_deltas(metrics, name, since_s)
    if deltas.is_empty():
        return None
    return float(deltas["delta"].sum())


PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"


def accepted_per_position(metrics: pl.DataFrame, since_s: float | None) -> list[float] | None:
    """Accepted draft tokens at each draft position over the profiling phase (vLLM's
    `spec_decode_num_accepted_tokens_per_pos`), position 0 first, or None without the counter.

    A position's series are kept apart from the other positions' and summed over the labels
    that are not the position (a server's engines, its model name): a draft position's count is
    the server's, whichever engine core verified it."""
    by_position: dict[int, float] = {}
    for labels, delta in series_deltas(metrics, PER_POSITION, since_s).iter_rows():
        position = orjson.loads(labels).get("position")
        if position is not None:
            by_position[int(position)] = by_position.get(int(position), 0.0) + delta
    if not by_position:
        return None
    return [by_position.get(i, 0.0) for i in range(max(by_position) + 1)]


def acceptance_rates(metrics: pl.DataFrame, since_s: float | None) -> list[float] | None:
    """Per-position acceptance rates over the profiling phase: accepted tokens at draft
    position i / drafts (vLLM's own definition of the per-position vector), or None without
    the counters. They are the unconditional rates p_1 >= ... >= p_k that a synthetic
    rejection takes (`synthetic_acceptance_rates`), so a run on a real server with a real
    drafter measures what the local engine and the simulator then replay."""
    drafts = counter_delta(metrics, DRAFTS, since_s)
    accepted = accepted_per_position(metrics, since_s)
    if not drafts or accepted is None:
        return None
    return [a / drafts for a in accepted]


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, tail = key.partition(".")
        if tail:
            out.setdefault(head, {})[tail] = value
        else:
            out[key] = value
    return out


def summarize_requests(
    requests: pl.DataFrame,
    *,
    gpu_count: int | None,
    server_metrics: pl.DataFrame | None = None,
) -> dict[str, Any]:
    """The summary values of one run (or of pooled runs) from its request table."""
    lazy = requests.lazy()
    ok = lazy.filter(_ok)
    aggregates = [
        _profiling.sum().alias("requests"),
        _ok.sum().alias("requests_ok"),
        (_profiling & ~pl.col("ok")).sum().alias("requests_error"),
        (pl.col("phase") == "warmup").sum().alias("requests_warmup"),
        ((pl.col("phase") == "profiling") & CANCELLED).sum().alias("requests_cancelled"),
        pl.col("session_id").filter(_profiling).n_unique().alias("sessions"),
        pl.col("sent_s").filter(_profiling).min().alias("phase_start_s"),
        pl.col("end_s").filter(_profiling).max().alias("phase_end_s"),
        pl.col("osl").filter(_ok).sum().alias("output_tokens"),
        pl.col("prompt_tokens").filter(_ok).sum().alias("input_tokens"),
        (pl.col("osl") - 1).filter(_ok & _has_itl).sum().alias("decode_tokens"),
        pl.col("cached_tokens").filter(_ok).sum().alias("cached_sum"),
        pl.col("prompt_tokens")
        .filter(_ok & pl.col("cached_tokens").is_not_null())
        .sum()
        .alias("cached_prompt_sum"),
        pl.col("cached_tokens").filter(_ok).is_not_null().sum().alias("cached_reported"),
    ]
    dist = [e for name, col in DISTRIBUTIONS.items() for e in stat_exprs(col, name)]
    lateness = stat_exprs("lateness_s", "dispatch_lateness_s")
    failed = ~pl.col("ok") & ~CANCELLED
    head, dists, late, spans, errors, warmup_errors, examples, warnings = pl.collect_all(
        [
            lazy.select(aggregates),
            ok.select(dist),
            lazy.filter(_profiling).select(lateness),
            decode_busy_spans(ok.filter(pl.col("itl_s").is_not_null())),
            lazy.filter(_profiling & ~pl.col("ok"))
            .group_by("error_class")
            .len()
            .sort("error_class"),
            lazy.filter((pl.col("phase") == "warmup") & failed)
            .group_by("error_class")
            .len()
            .sort("error_class"),
            lazy.filter(failed)
            .sort("sent_s", nulls_last=True)
            .group_by("error_class")
            .agg(pl.col("error_message").first())
            .sort("error_class"),
            # flagged requests, failed or not: a warning never fails a request on its own
            lazy.filter(_profiling & pl.col("warning_class").is_not_null())
            .group_by("warning_class")
            .len()
            .sort("warning_class"),
        ]
    )
    h = head.row(0, named=True)
    values: dict[str, Any] = {
        "requests": h["requests"],
        "requests_ok": h["requests_ok"],
        "requests_error": h["requests_error"],
        "requests_warmup": h["requests_warmup"],
        "requests_cancelled": h["requests_cancelled"],
        "error_rate": _ratio(h["requests_error"], h["requests"]),
        "errors_by_class": dict(errors.iter_rows()),
        "warmup_errors_by_class": dict(warmup_errors.iter_rows()),
        "error_examples": dict(examples.iter_rows()),
        "warnings_by_class": dict(warnings.iter_rows()),
        "sessions": h["sessions"],
    }
    values.update(_nest(dists.row(0, named=True)))
    values.update(_nest(late.row(0, named=True)))
    p90_itl = values["itl_s"]["p90"]
    values["p90_interactivity_tok_s"] = 1.0 / p90_itl if p90_itl else None

    start, end = h["phase_start_s"], h["phase_end_s"]
    wall = end - start if start is not None and end is not None else None
    busy_s = busy_seconds(spans)
    values.update(
        {
            "phase_start_s": start,
            "phase_wall_s": wall,
            "output_tokens": h["output_tokens"],
            "input_tokens": h["input_tokens"],
            "decode_tokens": h["decode_tokens"],
            "decode_busy_s": busy_s,
            "decode_throughput_tok_s": _ratio(h["decode_tokens"], busy_s),
            "output_throughput_tok_s": _ratio(h["output_tokens"], wall),
            "gpu_count": gpu_count,
            "request_throughput_req_s": _ratio(h["requests_ok"], wall),
            "throughput_per_gpu_tok_s": (
                _ratio(h["input_tokens"] + h["output_tokens"], wall * gpu_count)
                if wall is not None and gpu_count
                else None
            ),
            # InferenceX counts cached input tokens as served; this one does not
            "throughput_per_gpu_uncached_tok_s": (
                _ratio(
                    h["input_tokens"] - (h["cached_sum"] or 0) + h["output_tokens"],
                    wall * gpu_count,
                )
                if wall is not None and gpu_count
                else None
            ),
            "cache_hit_ratio": (
                _ratio(h["cached_sum"], h["cached_prompt_sum"]) if h["cached_reported"] else None
            ),
        }
    )
    values.update(_server_side(server_metrics, start))
    return values


def _server_side(metrics: pl.DataFrame | None, since_s: float | None) -> dict[str, Any]:
    """Cache-hit ratio, spec-decode acceptance length, the specialized decode share and where
    the device's time went, from the scraped counters."""
    if metrics is None or metrics.is_empty():
        return {
            "server_cache_hit_ratio": None,
            "spec_acceptance_length": None,
            "spec_acceptance_rates": None,
            "specialized_decode_share": None,
            "prefill_device_share": None,
            "decode_step_device_s": None,
            "draft_step_device_s": None,
            "decode_idle_share": None,
        }
    special = counter_delta(metrics, "agentab:decode_steps_specialized_total", since_s)
    standard = counter_delta(metrics, "agentab:decode_steps_standard_total", since_s)
    hits = counter_delta(metrics, "vllm:prefix_cache_hits_total", since_s)
    queries = counter_delta(metrics, "vllm:prefix_cache_queries_total", since_s)
    drafts = counter_delta(metrics, DRAFTS, since_s)
    accepted = counter_delta(metrics, "vllm:spec_decode_num_accepted_tokens_total", since_s)
    acceptance = _ratio(accepted, drafts)
    busy = counter_delta(metrics, "agentab:device_busy_seconds_total", since_s)
    decode_busy = counter_delta(metrics, "agentab:decode_device_busy_seconds_total", since_s)
    decode_idle = counter_delta(metrics, "agentab:decode_device_idle_seconds_total", since_s)
    decode_steps = None if special is None or standard is None else special + standard
    return {
        "server_cache_hit_ratio": _ratio(hits, queries),
        "spec_acceptance_length": None if acceptance is None else 1.0 + acceptance,
        "spec_acceptance_rates": acceptance_rates(metrics, since_s),
        # agentab engines count their pure-decode steps by path: the share the specialized
        # decoder served (the rest fell back to the standard forward)
        "specialized_decode_share": _ratio(special, decode_steps),
        # the local engine times every step on the device: the share spent in prefill and
        # mixed steps (the standard forward in both arms) bounds what a faster decode can gain
        "prefill_device_share": (
            None if busy is None or decode_busy is None else _ratio(busy - decode_busy, busy)
        ),
        "decode_step_device_s": _ratio(decode_busy, decode_steps),
        # the local engine's drafter per step that drafted: the same drafter runs in both arms,
        # so this should match across them (the rest of a verify step is the decode path's)
        "draft_step_device_s": _ratio(
            counter_delta(metrics, "agentab:draft_device_seconds_total", since_s),
            counter_delta(metrics, "agentab:draft_steps_total", since_s),
        ),
        # the device's idle gap before each pure-decode step, per second of decode work: the
        # host overhead (scheduling, input copies, a late launch) the engine did not hide
        "decode_idle_share": _ratio(decode_idle, decode_busy),
    }


def session_rollup(requests: pl.DataFrame) -> pl.DataFrame:
    """Per-session figures over the profiling phase (all plays of a session together)."""
    ok = pl.col("ok")
    itl_p90 = pl.col("itl_s").filter(ok).quantile(0.9, "linear")
    return (
        requests.lazy()
        .filter(_profiling)
        .group_by("session_id")
        .agg(
            plays=pl.struct("lane", "pass").n_unique(),
            requests=pl.len(),
            errors=(~ok).sum(),
            output_tokens=pl.col("osl").filter(ok).sum(),
            ttft_p50_s=pl.col("ttft_s").filter(ok).quantile(0.5, "linear"),
            ttft_p90_s=pl.col("ttft_s").filter(ok).quantile(0.9, "linear"),
            itl_p50_s=pl.col("itl_s").filter(ok).quantile(0.5, "linear"),
            itl_p90_s=itl_p90,
            p90_interactivity_tok_s=1.0 / itl_p90,
            e2e_p50_s=pl.col("e2e_s").filter(ok).quantile(0.5, "linear"),
            cached_tokens=pl.col("cached_tokens").filter(ok).sum(),
            prompt_tokens=pl.col("prompt_tokens").filter(ok).sum(),
        )
        .sort("session_id")
        .collect()
    )


def summarize_run(run: Run) -> RunSummary:
    """Load the request table of one run and compute its summary."""
    # one chunk whatever the record parts: where the writer flushed (the wall clock) must not
    # change the order of a float sum, and so the last digit of a mean
    requests = request_table(run.records).collect().rechunk()
    metrics = run.server_metrics.collect()
    values = summarize_requests(requests, gpu_count=run.gpu_count, server_metrics=metrics)
    values = {"run_dir": str(run.path), "arm": run.arm, **values}
    return RunSummary(run=run, requests=requests, values=values, sessions=session_rollup(requests))


def write_summary(summary: RunSummary, directory: Path | None = None) -> Path:
    """Write summary.json (and the per-session roll-up) into the run dir."""
    directory = directory or summary.run.path
    path = directory / SUMMARY_FILE
    path.write_bytes(orjson.dumps(summary.values, option=orjson.OPT_INDENT_2))
    summary.sessions.write_csv(directory / SESSIONS_FILE)
    return path

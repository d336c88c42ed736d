"""The comparison split by context length and by turn: where a decode path helps and where not.

A pooled ratio can hide opposite effects: a decode path that speeds up short contexts and slows
long ones (or the reverse) shows one middling number. The report therefore repeats the main
latency figures per bucket of prompt length and of turn index (a session's request number, the
proxy for how far into a conversation it is), for both arms over the same requests the pooled
latency metrics use (in a paired design, those both arms completed).

These are point estimates per bucket, labelled as such: a bucket holds a fraction of the
sample, so an interval per bucket would be wide and a verdict per bucket would multiply the
chances of a false one. They show where to look, not a decision.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import polars as pl

from agentab.analysis.summary import CANCELLED

# bucket edges (a bucket holds lo <= x < hi); labels say the same in words
CONTEXT_EDGES: tuple[int, ...] = (8_192, 32_768, 65_536, 131_072)
TURN_EDGES: tuple[int, ...] = (1, 5, 10, 20)
BREAKDOWNS: dict[str, tuple[str, str, tuple[int, ...]]] = {
    # name: (request-table column, what it is, edges)
    "context": ("prompt_tokens", "prompt tokens", CONTEXT_EDGES),
    "turn": ("turn", "turn index (0 = a session's first request)", TURN_EDGES),
}
FIGURES: tuple[str, ...] = ("itl_p50_s", "p90_interactivity_tok_s", "ttft_p50_s")


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def bucket_labels(edges: Sequence[int], tokens: bool) -> list[str]:
    """`< 8k`, `8k-32k`, ..., `>= 128k` (tokens) or `0`, `1-4`, ..., `>= 20` (turns)."""
    name = _short if tokens else str
    if tokens:
        labels = [f"< {name(edges[0])}"]
        labels += [f"{name(lo)}-{name(hi)}" for lo, hi in itertools.pairwise(edges)]
    else:
        spans = itertools.pairwise((0, *edges))
        labels = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in spans]
    return [*labels, f">= {name(edges[-1])}"]


def _bucket(column: str, edges: Sequence[int]) -> pl.Expr:
    """The bucket number (0 .. len(edges)) of each row."""
    expr = pl.lit(len(edges), dtype=pl.Int64)
    for i, edge in reversed(list(enumerate(edges))):
        expr = pl.when(pl.col(column) < edge).then(pl.lit(i, dtype=pl.Int64)).otherwise(expr)
    return expr


_USED = ("ok", "phase", "error_class", "itl_s", "ttft_s")


def _per_bucket(frames: Sequence[pl.DataFrame], column: str, edges: Sequence[int]) -> pl.DataFrame:
    ok = pl.col("ok") & (pl.col("phase") == "profiling") & ~CANCELLED
    itl_p90 = pl.col("itl_s").quantile(0.9, "linear")
    return (
        pl.concat(
            [f.select("ok", "phase", "error_class", column, "itl_s", "ttft_s") for f in frames]
        )
        .filter(ok)
        .group_by(bucket=_bucket(column, edges))
        .agg(
            requests=pl.len(),
            itl_p50_s=pl.col("itl_s").quantile(0.5, "linear"),
            p90_interactivity_tok_s=pl.when(itl_p90 > 0).then(1.0 / itl_p90),
            ttft_p50_s=pl.col("ttft_s").quantile(0.5, "linear"),
        )
    )


def breakdown(
    frames_a: Sequence[pl.DataFrame], frames_b: Sequence[pl.DataFrame], name: str
) -> list[dict[str, Any]]:
    """One row per non-empty bucket of `name` (a key of BREAKDOWNS): requests and FIGURES per
    arm and each figure's B/A."""
    column, _, edges = BREAKDOWNS[name]
    labels = bucket_labels(edges, tokens=name == "context")
    a = _per_bucket(frames_a, column, edges)
    b = _per_bucket(frames_b, column, edges)
    joined = a.join(b, on="bucket", how="full", coalesce=True, suffix="_b").sort("bucket")
    rows = []
    for r in joined.iter_rows(named=True):
        row: dict[str, Any] = {
            "bucket": labels[r["bucket"]],
            "requests_a": r["requests"] or 0,
            "requests_b": r["requests_b"] or 0,
        }
        for fig in FIGURES:
            va, vb = r[fig], r[f"{fig}_b"]
            row[f"{fig}_a"], row[f"{fig}_b"] = va, vb
            row[f"{fig}_ratio"] = vb / va if va and vb is not None else None
        rows.append(row)
    return rows


def breakdowns(
    frames_a: Sequence[pl.DataFrame], frames_b: Sequence[pl.DataFrame]
) -> dict[str, list[dict[str, Any]]]:
    """Every breakdown of BREAKDOWNS (the `breakdowns` of `compare --json`)."""
    return {name: breakdown(frames_a, frames_b, name) for name in BREAKDOWNS}

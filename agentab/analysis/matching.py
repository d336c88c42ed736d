"""Which requests both arms of a repeat measured: the latency metrics compare those alone.

Both arms of a repeat replay one plan (same replay seed and prompt salt): lane L plays the same
sessions in the same order, and a request's id (`L<lane>-P<pass>-N<node>`) names the same
prompt in both. In a time window the faster arm gets further into each session, where
contexts are longer, so the two runs complete different sets of requests; comparing those sets
mixes the decode path's effect with where each arm stopped, which is noise (it varies with the
plan) and a bias against the faster arm (it grows with the effect). Restricting every latency
metric to the requests that succeeded in both runs of the repeat compares like with like.
Throughputs and the error rate keep every request: finishing more work in the same window is
what they measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from agentab.analysis.summary import RunSummary

KEY = ("request_id", "session_id")


def same_plan(a: RunSummary, b: RunSummary) -> bool:
    """Did these two runs replay one plan (same replay seed and prompt salt, same workload)?"""
    ma, mb = a.run.manifest, b.run.manifest
    ra, rb = ma.get("replay") or {}, mb.get("replay") or {}
    return (
        ra.get("seed") is not None
        and ra.get("seed") == rb.get("seed")
        and ra.get("prompt_salt") == rb.get("prompt_salt")
        and ma.get("workload_hash") == mb.get("workload_hash")
    )


def _measured(summary: RunSummary) -> pl.DataFrame:
    frame = summary.requests
    return frame.filter((pl.col("phase") == "profiling") & pl.col("ok")).select(KEY)


@dataclass(frozen=True)
class Matching:
    """Per repeat pair: requests matched, and those only one arm completed (left out)."""

    matched: list[int]
    only_a: list[int]
    only_b: list[int]

    @property
    def dropped_share(self) -> float:
        total = sum(self.matched) * 2 + sum(self.only_a) + sum(self.only_b)
        return (sum(self.only_a) + sum(self.only_b)) / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "dropped_share": self.dropped_share,
        }

    def describe(self) -> str:
        return (
            f"latency metrics on the {sum(self.matched):,} requests both arms completed "
            f"(per repeat {', '.join(f'{m:,}' for m in self.matched)}); left out: "
            f"{sum(self.only_a):,} only A completed, {sum(self.only_b):,} only B completed"
        )


def match_requests(
    runs_a: Sequence[RunSummary], runs_b: Sequence[RunSummary]
) -> tuple[list[pl.DataFrame], list[pl.DataFrame], Matching] | None:
    """Each run's request table cut to the successful profiling requests of its repeat pair.

    `runs_a[k]` and `runs_b[k]` must be repeat k of each arm (`compare.repeat_pairing` orders
    them). None when any pair did not replay one plan: there is nothing to match then.
    """
    if len(runs_a) != len(runs_b) or not runs_a:
        return None
    if not all(same_plan(a, b) for a, b in zip(runs_a, runs_b, strict=True)):
        return None
    frames_a: list[pl.DataFrame] = []
    frames_b: list[pl.DataFrame] = []
    matched, only_a, only_b = [], [], []
    for a, b in zip(runs_a, runs_b, strict=True):
        ka, kb = _measured(a), _measured(b)
        both = ka.join(kb, on=KEY, how="semi")
        frames_a.append(a.requests.join(both, on=KEY, how="semi"))
        frames_b.append(b.requests.join(both, on=KEY, how="semi"))
        matched.append(both.height)
        only_a.append(ka.height - both.height)
        only_b.append(kb.height - both.height)
    return frames_a, frames_b, Matching(matched, only_a, only_b)

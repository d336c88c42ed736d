"""What a sweep report plots and gates on, per point: each arm's frontier position, B/A with its
CI, the specialized decode share, and each point's verdict for the recommendation.

The frontier is InferenceX's view of a serving config: P90 interactivity (y, tok/s per user)
against throughput per GPU (x, tok/s per GPU), one marker per load point. Markers are the pooled
values of the point's runs (as in the comparison), and the error bars span the runs' own values
(min to max), so run-to-run noise is visible at every point. Throughput per GPU is given both
with cached input tokens (InferenceX counts them) and without.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentab.analysis.compare import Comparison
from agentab.analysis.recommend import PointVerdict

HEADLINE = "p90_interactivity_tok_s"
THROUGHPUT = "throughput_per_gpu_tok_s"
THROUGHPUT_UNCACHED = "throughput_per_gpu_uncached_tok_s"


def _present(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _span(pooled: float | None, runs: Sequence[float | None]) -> dict[str, Any]:
    present = _present(runs)
    return {
        "value": pooled,
        "runs": list(runs),
        "min": min(present) if present else None,
        "max": max(present) if present else None,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    present = _present(values)
    return sum(present) / len(present) if present else None


def arm_point(comparison: Comparison, side: str) -> dict[str, Any]:
    """One arm at one point: headline, both throughputs per GPU, specialized share."""
    out: dict[str, Any] = {}
    for name in (HEADLINE, THROUGHPUT, THROUGHPUT_UNCACHED, "request_throughput_req_s"):
        result = comparison.metrics.get(name)
        if result is None:
            continue
        out[name] = _span(getattr(result, side), getattr(result, f"runs_{side}"))
    runs = comparison.runs_a if side == "a" else comparison.runs_b
    shares = [s.values.get("specialized_decode_share") for s in runs]
    out["specialized_decode_share"] = {"value": _mean(shares), "runs": shares}
    return out


def point_verdict(point: int | float, comparison: Comparison) -> PointVerdict:
    """The point's B/A of P90 interactivity as the recommendation reads it."""
    r = comparison.metrics[HEADLINE]
    # the rule, without this point's counts, so that points withheld alike read alike
    why = "; ".join(reason.split(" (")[0] for reason in comparison.withheld)
    return PointVerdict(point, r.ratio, r.ci_low, r.ci_high, r.verdict, why=why)


def point_json(point: int | float, comparison: Comparison) -> dict[str, Any]:
    """One point of `sweep.json`: both arms, the headline ratio with its CI and verdict."""
    r = comparison.metrics[HEADLINE]
    return {
        "point": point,
        "a": arm_point(comparison, "a"),
        "b": arm_point(comparison, "b"),
        "ratio": r.ratio,
        "ci_low": r.ci_low,
        "ci_high": r.ci_high,
        "verdict": r.verdict,
        "detectable_change": r.detectable,
        "verdict_withheld": comparison.withheld,
        "runs_per_arm": [len(comparison.runs_a), len(comparison.runs_b)],
    }

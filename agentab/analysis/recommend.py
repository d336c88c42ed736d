"""The sweep's one-line recommendation, derived from each point's CI of B/A P90 interactivity.

Each point is classed by its verdict: B significantly better (the CI lies above 1), worse (below
1), equivalent (the CI lies inside the equivalence margin), not significantly different (any
other CI that contains 1), or no verdict (the minimum-sample rules of
`sample.py` withheld it, or the ratio is undefined). A point without a verdict is neither better
nor worse. Consecutive points of one class form a segment, and the line names each segment with
the range of its points' measured effects, then the range its intervals span, e.g.

    latency_specialized raises P90 interactivity by 33-36% (intervals 31-38%) up to
    concurrency 16; from concurrency 32 on the difference is not significant

The crossover is the last point of the first "better" segment and the point after it, when B
stops paying off inside the swept range. `--fail-if-worse` gates on `worse_points`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentab.analysis.compare import BETTER, EQUIVALENT, SAME, WORSE

NONE = "no verdict"
CLASSES = (BETTER, WORSE, EQUIVALENT, SAME, NONE)


@dataclass(frozen=True)
class PointVerdict:
    """One point's B/A of P90 interactivity, its CI and verdict (compare.py's strings)."""

    point: int | float
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str
    why: str = ""  # why no verdict, when there is none

    @property
    def cls(self) -> str:
        return self.verdict if self.verdict in (BETTER, WORSE, EQUIVALENT, SAME) else NONE


@dataclass(frozen=True)
class Recommendation:
    """The line, and the same as data for CI gating (`sweep.json`'s `recommendation`)."""

    line: str
    segments: list[dict[str, Any]]
    crossover: dict[str, Any] | None
    worse_points: list[int | float]

    def to_json(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "segments": self.segments,
            "crossover": self.crossover,
            "worse_points": self.worse_points,
            "any_worse": bool(self.worse_points),
        }


def _num(x: int | float) -> str:
    return f"{x:g}"


def _segments(points: Sequence[PointVerdict]) -> list[list[PointVerdict]]:
    out: list[list[PointVerdict]] = []
    for p in points:
        if out and out[-1][0].cls == p.cls:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def _where(variable: str, seg: list[PointVerdict], first: bool, last: bool) -> str:
    lo, hi = _num(seg[0].point), _num(seg[-1].point)
    if first and last:
        return f"at {variable} {lo}" if lo == hi else f"at every {variable} tested ({lo}-{hi})"
    if first:
        return f"up to {variable} {hi}"
    if last:
        return f"from {variable} {lo} on"
    return f"at {variable} {lo}" if lo == hi else f"at {variable} {lo}-{hi}"


def _percent_range(seg: list[PointVerdict]) -> str:
    """The segment's CIs as a percent change: the lowest and highest bound of any point (a
    better or worse point always has both bounds on one side of 1)."""
    lows = [p.ci_low for p in seg if p.ci_low is not None]
    highs = [p.ci_high for p in seg if p.ci_high is not None]
    ends = sorted(abs(100 * (x - 1.0)) for x in (min(lows), max(highs)))
    return f"{ends[0]:.0f}-{ends[1]:.0f}%"


def _effect_range(seg: list[PointVerdict]) -> str:
    """The segment's measured effects (each point's B/A) as a percent change: one number when
    they round to the same."""
    effects = sorted(abs(100 * (p.ratio - 1.0)) for p in seg if p.ratio is not None)
    lo, hi = f"{effects[0]:.0f}", f"{effects[-1]:.0f}"
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def _what(seg: list[PointVerdict], subject: str) -> str:
    cls = seg[0].cls
    if cls in (BETTER, WORSE):
        verb = "raises" if cls == BETTER else "lowers"
        return (
            f"{subject} {verb} P90 interactivity by {_effect_range(seg)} "
            f"(intervals {_percent_range(seg)})"
        )
    if cls == SAME:
        return "the difference is not significant"
    if cls == EQUIVALENT:
        return "the two are equivalent (every interval within the equivalence margin)"
    reasons = list(dict.fromkeys(r for p in seg if p.why for r in p.why.split("; ")))
    return "there is no verdict" + (f" ({'; '.join(reasons)})" if reasons else "")


def recommend(variable: str, arm_b: str, points: Sequence[PointVerdict]) -> Recommendation:
    """The recommendation over a sweep's points (sorted by point here)."""
    ordered = sorted(points, key=lambda p: p.point)
    if not ordered:
        return Recommendation(f"{arm_b}: no sweep points", [], None, [])
    segments = _segments(ordered)
    parts = []
    named = False
    for i, seg in enumerate(segments):
        where = _where(variable, seg, i == 0, i == len(segments) - 1)
        subject = arm_b if not named else "it"
        what = _what(seg, subject)
        named = named or seg[0].cls in (BETTER, WORSE)
        parts.append(f"{what} {where}" if i == 0 else f"{where} {what}")
    crossover = None
    for i, seg in enumerate(segments[:-1]):
        if seg[0].cls == BETTER:
            crossover = {
                "last_better": seg[-1].point,
                "next": segments[i + 1][0].point,
                "next_verdict": segments[i + 1][0].cls,
            }
            break
    return Recommendation(
        line="; ".join(parts),
        segments=[
            {
                "verdict": seg[0].cls,
                "from": seg[0].point,
                "to": seg[-1].point,
                "points": [p.point for p in seg],
            }
            for seg in segments
        ],
        crossover=crossover,
        worse_points=[p.point for p in ordered if p.cls == WORSE],
    )

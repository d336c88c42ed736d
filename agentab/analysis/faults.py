"""The A/B report's table of failed and flagged requests, per class and arm.

Why a table of its own: the metric rows show each arm's error rate, but not what failed. A server
fault that hits one arm only (a decode path that over-generates, aborts, or miscounts usage)
changes which requests enter that arm's latency figures, so the report names every class with
its count in each arm. Errors failed their request (no latency metric); warnings only flag it
(docs/replay.md, "Error and warning classes").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from agentab.analysis.summary import RunSummary

FAULT_HEADER: tuple[str, ...] = ("class", "kind", "A requests", "B requests")
FAULTS_TITLE = (
    "Failed and flagged requests by class (profiling phase, all runs of an arm; an error failed "
    "its request, a warning only flags it):"
)


def class_counts(runs: Sequence[RunSummary], key: str) -> dict[str, int]:
    """`errors_by_class` or `warnings_by_class` summed over an arm's runs (profiling phase)."""
    total: Counter[str] = Counter()
    for run in runs:
        total.update(run.values.get(key) or {})
    return dict(sorted(total.items()))


def faults_json(runs_a: Sequence[RunSummary], runs_b: Sequence[RunSummary]) -> dict[str, Any]:
    """comparison.json's `errors_by_class` and `warnings_by_class`, each per arm."""
    return {
        key: {"a": class_counts(runs_a, key), "b": class_counts(runs_b, key)}
        for key in ("errors_by_class", "warnings_by_class")
    }


def fault_rows(runs_a: Sequence[RunSummary], runs_b: Sequence[RunSummary]) -> list[list[str]]:
    """One row per class seen in either arm: errors first, then warnings; [] when none."""
    rows = []
    for key, kind in (("errors_by_class", "error"), ("warnings_by_class", "warning")):
        a, b = class_counts(runs_a, key), class_counts(runs_b, key)
        for cls in sorted(a.keys() | b.keys()):
            rows.append([cls, kind, str(a.get(cls, 0)), str(b.get(cls, 0))])
    return rows

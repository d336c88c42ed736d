"""Labelled series in an engine's `metrics()` dict: `name{label="value"}` keys.

Why: engines report their counters as a flat name -> value dict, but one of vLLM's
spec-decode counters is a family of series told apart by a label
(`vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}`, one per draft position).
A key may carry its labels in Prometheus' own spelling; the HTTP server writes them beside its
`model_name` label and an in-process scrape splits them off, so the replay client reads the
series exactly as it reads vLLM's.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"\\]*)"')


def series(name: str, **labels: str) -> str:
    """The key of one labelled series: `series("x_total", position="0")` ->
    `x_total{position="0"}`."""
    if not labels:
        return name
    inside = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return f"{name}{{{inside}}}"


def split_series(key: str) -> tuple[str, dict[str, str]]:
    """A key's metric name and labels (none for a plain name)."""
    name, brace, rest = key.partition("{")
    if not brace:
        return key, {}
    return name, dict(_LABEL.findall(rest))

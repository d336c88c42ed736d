"""Service-level objectives and goodput: which requests a user would have counted as served.

A throughput counts every successful request, however slow. Goodput counts only those that met
every objective the user sets (vLLM's `bench serve --goodput`, AIPerf's goodput): a decode path
that speeds up the median while pushing the slow tail past a user's limit shows up here and
nowhere else. Objectives are per request, on the same per-request figures the report's
distributions use (docs/analysis.md, "Goodput"):

- `ttft`: time to first token (first chunk, from the client's send time);
- `itl`: the request's mean inter-token latency ITL_i = (last chunk - first chunk) / (OSL_i - 1),
  vLLM's TPOT (`tpot` is accepted as its other name); a one-token answer has none and meets it;
- `e2e`: end-to-end latency (last chunk, from the send time).

Written `NAME:VALUE` with a unit (`s`, `ms` or `us`), e.g. `ttft:2s`, `itl:50ms`; a request
meets the objectives when it succeeded and is at or under every limit given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import polars as pl

from agentab.errors import AgentabError

# objective name -> the request-table column it limits (and the names accepted for it)
COLUMNS: dict[str, str] = {"ttft": "ttft_s", "itl": "itl_s", "e2e": "e2e_s"}
ALIASES: dict[str, str] = {"tpot": "itl", "e2el": "e2e"}
UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
LABELS: dict[str, str] = {"ttft": "TTFT", "itl": "ITL", "e2e": "E2E"}
_TERM = re.compile(r"^\s*([a-z0-9]+)\s*:\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]+)\s*$")


@dataclass(frozen=True)
class Slo:
    """Per-request limits in seconds (None: no limit on that figure)."""

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def limits(self) -> dict[str, float]:
        """objective name -> limit (s), only those set, in a fixed order."""
        given = {"ttft": self.ttft_s, "itl": self.itl_s, "e2e": self.e2e_s}
        return {k: v for k, v in given.items() if v is not None}

    def met(self) -> pl.Expr:
        """Per request: succeeded and within every limit (a missing ITL meets the ITL limit)."""
        expr = pl.col("ok")
        for name, limit in self.limits().items():
            col = pl.col(COLUMNS[name])
            within = col <= limit
            expr = expr & (within | col.is_null() if name == "itl" else within.fill_null(False))
        return expr

    def describe(self) -> str:
        """`TTFT <= 2 s, ITL <= 50 ms` (for report headers)."""
        return ", ".join(f"{LABELS[k]} <= {_format(v)}" for k, v in self.limits().items())

    def terms(self) -> list[str]:
        """The objectives as `NAME:VALUE` terms `parse_slo` reads back (for JSON and manifests)."""
        return [f"{k}:{_format(v).replace(' ', '')}" for k, v in self.limits().items()]


def _format(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms"
    return f"{seconds * 1e6:g} us"


def parse_slo(terms: Iterable[str], where: str = "--slo") -> Slo | None:
    """`["ttft:2s", "itl:50ms"]` -> Slo; None when no term is given. `where` names the flag or
    the file field in the one-line error a bad term gets."""
    limits: dict[str, float] = {}
    for raw in terms:
        term = str(raw)
        match = _TERM.match(term.lower())
        if match is None:
            raise AgentabError(
                f"{where}: {term!r} is not NAME:VALUE with a unit (e.g. ttft:2s, itl:50ms, e2e:30s)"
            )
        name, number, unit = match.groups()
        name = ALIASES.get(name, name)
        if name not in COLUMNS:
            known = ", ".join([*COLUMNS, *ALIASES])
            raise AgentabError(f"{where}: {term!r}: unknown objective {name!r} (one of {known})")
        if unit not in UNITS:
            raise AgentabError(f"{where}: {term!r}: unit {unit!r} is not one of s, ms, us")
        value = float(number) * UNITS[unit]
        if not math.isfinite(value) or value <= 0.0:
            raise AgentabError(f"{where}: {term!r}: the limit must be positive")
        if name in limits:
            raise AgentabError(f"{where}: {term!r}: {name} is given twice")
        limits[name] = value
    if not limits:
        return None
    return Slo(
        ttft_s=limits.get("ttft"),
        itl_s=limits.get("itl"),
        e2e_s=limits.get("e2e"),
    )

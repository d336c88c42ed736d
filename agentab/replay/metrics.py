"""Server metrics scraping: Prometheus text from `/metrics` (or an engine) into long-form rows.

Why scrape at all: prefix-cache hit rates and speculative-decoding acceptance are properties of
the server, not of any one request; the analysis needs their counters over time to label an
A/B result (e.g. mean acceptance length = 1 + accepted / drafts per arm).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import orjson

from agentab.replay.records import PartWriter

Sample = tuple[str, dict[str, str], float]


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments skipped, NaN/Inf kept as floats)."""
    out: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                continue
            name = line[:brace]
            labels = _parse_labels(line[brace + 1 : close])
            rest = line[close + 1 :].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out.append((name, labels, value))
    return out


def _parse_labels(body: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    i, n = 0, len(body)
    while i < n:
        eq = body.find("=", i)
        if eq < 0:
            break
        key = body[i:eq].strip().lstrip(",").strip()
        j = eq + 1
        if j >= n or body[j] != '"':
            break
        j += 1
        chars: list[str] = []
        while j < n and body[j] != '"':
            if body[j] == "\\" and j + 1 < n:
                nxt = body[j + 1]
                chars.append("\n" if nxt == "n" else nxt)
                j += 2
                continue
            chars.append(body[j])
            j += 1
        labels[key] = "".join(chars)
        i = j + 1
    return labels


def engine_samples(metrics: dict[str, float]) -> list[Sample]:
    """An in-process engine's `metrics()` dict as samples without labels."""
    return [(name, {}, float(v)) for name, v in metrics.items()]


async def scrape_loop(
    source: Callable[[], Awaitable[list[Sample]]],
    writer: PartWriter,
    *,
    t0: float,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Poll `source` every `interval_s` (loop time) until `stop`, then once more."""
    loop = asyncio.get_running_loop()
    while True:
        samples = await source()
        t = loop.time() - t0
        for name, labels, value in samples:
            writer.add(
                {
                    "t_s": t,
                    "name": name,
                    "labels": orjson.dumps(labels, option=orjson.OPT_SORT_KEYS).decode(),
                    "value": value,
                }
            )
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)

"""Server metrics scraping: Prometheus text from `/metrics` (or an engine) into long-form rows.

Why scrape at all: prefix-cache hit rates and speculative-decoding acceptance are properties of
the server, not of any one request; the analysis needs their counters over time to label an
A/B result (e.g. mean acceptance length = 1 + accepted / drafts per arm).

Why the text is parsed and its rows are written off the replay's event loop (in a worker thread;
`HttpTarget.scrape`, `scrape_loop`): prometheus_client's parser is pure Python, and vLLM's
exposition (hundreds of histogram buckets) took 13 ms of CPU per scrape to parse and 2 ms more
to write on a 2-core client, once a second. Inline, every dispatch and chunk read that fell due
meanwhile waited for it: a real-clock replay against a vLLM CPU server measured dispatches up to
330 ms behind their plan during scrapes. In a thread the loop waits at most one GIL switch
interval (5 ms) at a time. The thread is one for the process (`scrape_worker`), started before a
run's clock starts: starting a thread waits until the new thread runs, which on a client sharing
its cores with a busy server took 195 ms, and asyncio's default executor starts its threads
lazily, inside the run, once per event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import orjson
from prometheus_client.parser import text_string_to_metric_families

from agentab.clock import is_virtual
from agentab.engine.metric_keys import split_series
from agentab.rundir import PartWriter

Sample = tuple[str, dict[str, str], float]

_worker: tuple[int, ThreadPoolExecutor] | None = None


def scrape_worker() -> ThreadPoolExecutor:
    """The thread that parses and writes every scrape of this process, started on first call.

    Call it before a run's clock starts (see the module's docstring). Keyed by process id: a
    forked child does not inherit the parent's thread and gets one of its own."""
    global _worker
    if _worker is None or _worker[0] != os.getpid():
        executor = ThreadPoolExecutor(1, thread_name_prefix="agentab-scrape")
        executor.submit(int).result()  # the thread is running when this returns
        _worker = (os.getpid(), executor)
    return _worker[1]


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition, in the order the server wrote them.

    Comments and TYPE/HELP lines carry nothing the analysis reads; timestamps are dropped (the
    scrape's own loop time is what the rows are aligned on); NaN and Inf stay floats. A server
    that writes one malformed line must not cost the run every other counter of that scrape, so
    on a parse error each line is parsed on its own and the lines that fail are skipped.
    """
    try:
        return _samples(text)
    except ValueError:
        out: list[Sample] = []
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                with contextlib.suppress(ValueError):
                    out.extend(_samples(line))
        return out


def _samples(text: str) -> list[Sample]:
    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def engine_samples(metrics: dict[str, float]) -> list[Sample]:
    """An in-process engine's `metrics()` dict as samples (a key's own labels split off,
    agentab.engine.metric_keys)."""
    return [(*split_series(key), float(v)) for key, v in metrics.items()]


async def scrape_loop(
    source: Callable[[], Awaitable[list[Sample]]],
    writer: PartWriter,
    *,
    t0: float,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Poll `source` every `interval_s` (loop time) until `stop`, then once more.

    On the real clock a scrape's rows are written from `scrape_worker` (see the module's
    docstring); on the virtual clock, where no request waits on the loop's real time, inline."""
    loop = asyncio.get_running_loop()
    off_loop = not is_virtual(loop)
    while True:
        samples = await source()
        t = loop.time() - t0
        if off_loop:
            await loop.run_in_executor(scrape_worker(), write_samples, writer, t, samples)
        else:
            write_samples(writer, t, samples)
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def write_samples(writer: PartWriter, t_s: float, samples: list[Sample]) -> None:
    """One scrape's samples as long-form rows at `t_s` (labels as sorted-key JSON)."""
    for name, labels, value in samples:
        writer.add(
            {
                "t_s": t_s,
                "name": name,
                "labels": orjson.dumps(labels, option=orjson.OPT_SORT_KEYS).decode(),
                "value": value,
            }
        )

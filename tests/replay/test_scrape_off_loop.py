"""A `/metrics` scrape is parsed and written off the replay's event loop, so dispatches and chunk
reads due meanwhile are not held up by it (agentab.replay.metrics says why).

The server is a real aiohttp app on 127.0.0.1; the parser and the row writer are the real ones,
wrapped to check, while they run, that the event loop still turns: a callback handed to the loop
from inside them must run before they return, which it cannot while they hold the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

import agentab.replay.metrics as metrics
from agentab.replay.targets.http import HttpTarget
from agentab.rundir import PartWriter, scan_metrics
from agentab.rundir.schema import METRICS_SCHEMA

BUCKETS = 400
PARSED: list[tuple[int, str]] = []  # the threads (id, name) the parser ran on
WRITTEN: list[tuple[int, str]] = []  # the threads the row writer ran on


def exposition() -> str:
    """A vLLM-like exposition: one gauge and a histogram of BUCKETS buckets."""
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        "# TYPE vllm:e2e_request_latency_seconds histogram",
    ]
    lines += [
        f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="{0.01 * i:.2f}",model_name="m"}}'
        f" {float(i)}"
        for i in range(1, BUCKETS + 1)
    ]
    lines.append('vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 400.0')
    return "\n".join(lines) + "\n"


def loop_turns_meanwhile(loop: asyncio.AbstractEventLoop, calls: list[tuple[int, str]]):
    """A wrapper that records its thread and fails unless `loop` runs a callback meanwhile."""

    def wrap(real):
        def wrapped(*args, **kwargs):
            calls.append((threading.get_ident(), threading.current_thread().name))
            turned = threading.Event()
            loop.call_soon_threadsafe(turned.set)
            assert turned.wait(5.0), f"{real.__name__} held the event loop"
            return real(*args, **kwargs)

        return wrapped

    return wrap


@contextlib.asynccontextmanager
async def metrics_server() -> AsyncIterator[str]:
    """A server on 127.0.0.1 whose /metrics answers `exposition()`; yields its URL."""
    text = exposition()

    async def serve(_request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/metrics", serve)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_scrape_parses_off_the_loop_and_writes_every_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = asyncio.run(scrape_once(tmp_path, monkeypatch))
    # both on the process's one scrape thread, not the loop's
    assert len(PARSED) == 1 and PARSED[0][0] != loop_thread
    assert PARSED[0][1].startswith("agentab-scrape")
    assert WRITTEN == PARSED
    rows = scan_metrics(tmp_path).collect()
    assert rows.height == BUCKETS + 2
    first = rows.row(0, named=True)
    assert (first["name"], first["labels"], first["value"]) == (
        "vllm:num_requests_running",
        '{"engine":"0","model_name":"m"}',
        2.0,
    )
    buckets = rows.filter(rows["name"] == "vllm:e2e_request_latency_seconds_bucket")
    assert buckets["value"].to_list() == [float(i) for i in range(1, BUCKETS + 1)]


async def scrape_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """One `scrape_loop` pass (stop already set) through the wrapped parser and writer; returns
    the loop's thread."""
    PARSED.clear()
    WRITTEN.clear()
    loop = asyncio.get_running_loop()
    parse, write = metrics.parse_prometheus, metrics.write_samples
    monkeypatch.setattr(metrics, "parse_prometheus", loop_turns_meanwhile(loop, PARSED)(parse))
    monkeypatch.setattr(metrics, "write_samples", loop_turns_meanwhile(loop, WRITTEN)(write))
    async with metrics_server() as url:
        target = HttpTarget(url)
        await target.start()
        writer = PartWriter(tmp_path / "metrics", METRICS_SCHEMA)
        stop = asyncio.Event()
        stop.set()  # one scrape, then none
        try:
            await metrics.scrape_loop(
                target.scrape, writer, t0=loop.time(), interval_s=0.01, stop=stop
            )
        finally:
            writer.close()
            await target.close()

    return threading.get_ident()


def test_the_scrape_thread_is_running_when_asked_for_and_is_one_per_process() -> None:
    worker = metrics.scrape_worker()
    assert metrics.scrape_worker() is worker
    running = [t.name for t in threading.enumerate() if t.name.startswith("agentab-scrape")]
    assert len(running) == 1

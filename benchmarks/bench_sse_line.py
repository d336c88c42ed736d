"""What one huge SSE data line costs the replay client, and the stream running beside it.

Two servers, each in its own process (so that writing the huge line does not hold up the other
stream's server), stream at once: `steady` (300 chunks, 10 ms apart) and, 0.2 s later, `huge`
(one chunk, then a single `data:` line of --size bytes, then usage and [DONE]). The client is
agentab's HttpTarget on one event loop. Printed, never asserted: how long the huge request took
from send to its end (wall and the client's CPU) and its class, how late a 5 ms sleep on the
client's loop woke meanwhile, and the steady stream's chunk gaps (a loop held up by parsing
shows as gaps far above 10 ms, and past --timeout as a timeout).

    python benchmarks/bench_sse_line.py [--size 128MiB] [--max-line-bytes N] [--timeout 10]

`--max-line-bytes` sets AGENTAB_MAX_SSE_LINE_BYTES for the client: the default (16 MiB) refuses
the 128 MiB line as `line_too_long`; 256MiB has it read and parsed whole. Run with an older
checkout on PYTHONPATH for the figures before the linear line splitter (it ignores the variable).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

STEADY_CHUNKS = 300
STEADY_INTERVAL_S = 0.01


def _size(text: str) -> int:
    units = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _event(text: str) -> bytes:
    body = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _usage(n: int) -> bytes:
    usage = {"prompt_tokens": 8, "completion_tokens": n}
    return b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": usage}) + b"\n\n"


async def _serve(size: int, port_file: str) -> None:
    from aiohttp import web

    head = b'data: {"id":"x","choices":[{"index":0,"text":"'
    huge = head + b"x" * (size - len(head) - 6) + b'"}]}\n\n'

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        rid = request.headers.get("X-Request-Id", "")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if rid == "huge":
                await resp.write(_event(" a"))
                await resp.write(huge)
                await resp.write(_usage(2))
            else:
                for _ in range(STEADY_CHUNKS):
                    await resp.write(_event(" a"))
                    await asyncio.sleep(STEADY_INTERVAL_S)
                await resp.write(_usage(STEADY_CHUNKS))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client refused the line
            pass
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    Path(port_file).write_text(str(port))
    await asyncio.Event().wait()


def start_server(size: int) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tempfile.mktemp(prefix="agentab-bench-sse-")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(size), port_file])
    deadline = time.monotonic() + 30
    while not (os.path.exists(port_file) and Path(port_file).read_text()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the SSE server did not start")
        time.sleep(0.05)
    port = Path(port_file).read_text()
    os.unlink(port_file)
    return proc, f"http://127.0.0.1:{port}"


async def run_client(urls: tuple[str, str], timeout_s: float) -> None:
    from agentab.replay.targets.base import Outcome, RequestSpec
    from agentab.replay.targets.http import HttpTarget
    from agentab.workloads.model import Request, Session

    request = Request(t=0.0, in_tokens=8, out_tokens=2, hash_ids=(1,), api_time=0.0)
    session = Session("s", 16, (request,))
    target = HttpTarget(urls[0], model="bench", timeout_s=timeout_s)
    other = HttpTarget(urls[1], model="bench", timeout_s=timeout_s)
    await target.start()
    await other.start()
    loop = asyncio.get_running_loop()
    stalls: list[float] = []

    async def probe() -> None:
        """The client's own loop stalls: how late a 5 ms sleep wakes up, while the huge runs."""
        while True:
            due = loop.time() + 0.005
            await asyncio.sleep(0.005)
            stalls.append(loop.time() - due)

    try:
        steady, huge = Outcome(), Outcome()
        task = asyncio.create_task(
            other.send(RequestSpec("steady", session, request, 1, STEADY_CHUNKS), steady)
        )
        await asyncio.sleep(0.2)
        watch = asyncio.create_task(probe())
        cpu = time.process_time()
        await target.send(RequestSpec("huge", session, request, 2, 2), huge)
        cpu = time.process_time() - cpu
        watch.cancel()
        await task
    finally:
        await target.close()
        await other.close()
    assert huge.sent is not None and huge.end is not None
    print(
        f"huge request: {huge.end - huge.sent:.2f} s from send to end ({cpu:.2f} s client CPU), "
        f"class {huge.error_class}: {huge.error_message}"
    )
    print(
        f"client loop while the huge request ran: longest stall {max(stalls) * 1000:.1f} ms, "
        f"p99 {np.percentile(stalls, 99) * 1000:.1f} ms over {len(stalls)} 5 ms sleeps"
    )
    gaps = np.diff(np.asarray(steady.chunk_times, dtype=float)) * 1000
    print(
        f"steady stream: {len(steady.chunk_times)} of {STEADY_CHUNKS} chunks, class "
        f"{steady.error_class}; chunk gaps p50 {np.percentile(gaps, 50):.1f} ms, p99 "
        f"{np.percentile(gaps, 99):.1f} ms, max {gaps.max():.1f} ms "
        f"(written {STEADY_INTERVAL_S * 1000:g} ms apart)"
        if gaps.size
        else f"steady stream: {len(steady.chunk_times)} chunks, class {steady.error_class}"
    )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        asyncio.run(_serve(int(sys.argv[2]), sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="128MiB", help="bytes of the huge line (KiB/MiB/GiB)")
    parser.add_argument("--max-line-bytes", default=None, help="the client's SSE line limit")
    parser.add_argument("--timeout", type=float, default=10.0, help="--request-timeout (s)")
    args = parser.parse_args()
    if args.max_line_bytes is not None:
        os.environ["AGENTAB_MAX_SSE_LINE_BYTES"] = str(_size(args.max_line_bytes))
    size = _size(args.size)
    servers = [start_server(size), start_server(size)]
    try:
        print(
            f"one {size:,}-byte data line beside a steady stream; client limit "
            f"{os.environ.get('AGENTAB_MAX_SSE_LINE_BYTES', 'default')}"
        )
        asyncio.run(run_client((servers[0][1], servers[1][1]), args.timeout))
    finally:
        for proc, _url in servers:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()

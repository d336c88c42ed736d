"""What `agentab serve` keeps and logs when clients drop streams, and how it treats idle sockets.

Starts `agentab serve` over the simulator in its own process, then, in rounds, opens
`--per-round` streaming completions at once (prompts of `--prompt` token ids, `--max-tokens`
each), reads the first content chunk of each and drops the connection (a client killed mid-stream).
After each round it waits for the server to settle (no request running) and prints the server's
resident memory, the aborts it counted and the lines it wrote to stderr. At the end it opens a
socket that sends nothing and one that sends half a request header, and prints how long the
server keeps each open. Printed, never asserted:

    python benchmarks/bench_serve_disconnects.py [--rounds 10] [--per-round 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from agentab.replay.metrics import parse_prometheus


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(v for n, _labels, v in parse_prometheus(text) if n == name)


async def drop_one(url: str, prompt: list[int], max_tokens: int) -> None:
    """Stream one completion, read its first content chunk, then drop the connection."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url + "/v1/completions", json=body)
        async for line in resp.content:
            if line.startswith(b"data: "):
                break
        resp.connection.transport.abort()  # type: ignore[union-attr]
        resp.release()


async def settle(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> float:
    """Wait until no request is running; return the seconds it took."""
    t0 = time.monotonic()
    while await metric(http, url, "vllm:num_requests_running") > 0:
        if time.monotonic() - t0 > timeout_s:
            break
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def idle_socket_lifetime(host: str, port: int, first_bytes: bytes, limit_s: float) -> float | None:
    """Seconds until the server closes a socket that sent `first_bytes` and then nothing."""
    with socket.create_connection((host, port)) as sock:
        if first_bytes:
            sock.sendall(first_bytes)
        sock.settimeout(limit_s)
        t0 = time.monotonic()
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return None
        while data:  # an error response, then the close
            data = sock.recv(65536)
        return time.monotonic() - t0


async def bench(args: argparse.Namespace) -> None:
    fd, log_path = tempfile.mkstemp(suffix=".log")
    cmd = [sys.executable, "-m", "agentab", "serve", "--profile", args.profile, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fd, text=True)
    os.close(fd)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        url = first.split("listening on ")[1].split()[0]
        host, port = url.removeprefix("http://").split(":")
        prompt = [1 + (i * 7919) % 31000 for i in range(args.prompt)]
        async with aiohttp.ClientSession() as http:
            await metric(http, url, "vllm:num_requests_running")
            base = rss_mib(proc.pid)
            print(f"agentab serve pid {proc.pid}: RSS {base:.1f} MiB before any request")
            print(
                "disconnects  RSS MiB  retained MiB  per 10 drops  aborts  stderr lines  settle s"
            )
            for r in range(1, args.rounds + 1):
                salt = [r, r + 1, r + 2]  # fresh prompts each round: no prefix-cache reuse
                await asyncio.gather(
                    *(
                        drop_one(url, [*salt, k, *prompt], args.max_tokens)
                        for k in range(args.per_round)
                    )
                )
                wait = await settle(http, url)
                rss = rss_mib(proc.pid)
                n = r * args.per_round
                aborts = await metric(http, url, "agentab:request_abort_total")
                lines = len(Path(log_path).read_text().splitlines())
                print(
                    f"{n:11d}  {rss:7.1f}  {rss - base:12.1f}  {(rss - base) * 10 / n:12.2f}  "
                    f"{aborts:6.0f}  {lines:12d}  {wait:8.2f}"
                )
        for name, first_bytes in (
            ("sends nothing", b""),
            ("half a header", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),
        ):
            life = idle_socket_lifetime(host, int(port), first_bytes, args.idle_limit)
            shown = f"closed after {life:.1f} s" if life is not None else "still open"
            print(f"a connection that {name}: {shown} (watched {args.idle_limit:.0f} s)")
        print("server stderr, first lines:")
        for line in Path(log_path).read_text().splitlines()[:5]:
            print("  " + line[:160])
    finally:
        proc.terminate()
        proc.wait(10)
        os.unlink(log_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h200-tp1-kimi-shard")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=8000, help="prompt length, token ids")
    ap.add_argument("--max-tokens", type=int, default=4000)
    ap.add_argument("--idle-limit", type=float, default=90.0, help="watch idle sockets this long")
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()

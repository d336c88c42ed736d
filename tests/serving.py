"""`agentab serve` in its own process, as users run it, for tests that need a real server
process: its URL comes from the listening line it prints, and it is stopped on exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_process(*args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`agentab serve ARGS --port 0`: (its URL, the process); SIGTERM on exit, then a kill."""
    with serve_replicas(1, *args) as (urls, proc):
        yield urls[0], proc


@contextmanager
def serve_replicas(n: int, *args: str) -> Iterator[tuple[list[str], subprocess.Popen[str]]]:
    """`agentab serve ARGS --replicas N --port 0` (no --replicas for one): the replicas' URLs,
    replica 0 first, and the supervising process; SIGTERM on exit, then a kill."""
    many = ("--replicas", str(n)) if n > 1 else ()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "serve", *args, *many, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        urls: dict[int, str] = {}
        while len(urls) < n:
            line = proc.stdout.readline()
            assert "listening on http://127.0.0.1:" in line, line + proc.stderr.read()
            which = re.search(r"\(replica (\d+),", line)  # none with one replica
            port = line.split("127.0.0.1:")[1].split()[0]
            urls[int(which.group(1)) if which else 0] = "http://127.0.0.1:" + port
        yield [urls[i] for i in range(n)], proc
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@contextmanager
def served(*args: str) -> Iterator[str]:
    """`serve_process`, when only the URL is needed."""
    with serve_process(*args) as (url, _proc):
        yield url

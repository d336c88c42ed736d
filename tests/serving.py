"""`agentab serve` in its own process, as users run it, for tests that need a real server
process: its URL comes from the listening line it prints, and it is stopped on exit."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_process(*args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`agentab serve ARGS --port 0`: (its URL, the process); SIGTERM on exit, then a kill."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + proc.stderr.read()
        yield "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0], proc
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@contextmanager
def served(*args: str) -> Iterator[str]:
    """`serve_process`, when only the URL is needed."""
    with serve_process(*args) as (url, _proc):
        yield url

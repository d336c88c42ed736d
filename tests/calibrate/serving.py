"""`agentab serve` in a subprocess for the calibration tests (its port from the listening line)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def served(*args: str) -> Iterator[str]:
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
        yield "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0]
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()

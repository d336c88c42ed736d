"""One server process group: start, wait for health, stop, and never leave it behind.

Why each piece:
- The server runs in its own session/process group, so its engine-core and worker children are
  stopped together (`killpg`) and a terminal's Ctrl-C reaches agentab only, which then stops the
  server in order (SIGTERM, grace period, SIGKILL).
- A tiny *guard* process (own session too) holds a pipe from agentab; when the pipe closes
  because agentab exits for any reason, SIGKILL included, the guard stops the group. So no
  signal to agentab can leave a vLLM server running.
- While a server runs, SIGTERM/SIGHUP to agentab raise `SystemExit(128 + signum)` (unless
  another handler is installed), so `finally` blocks stop the server and the run dir is closed.
- The log goes straight from the server's stdout/stderr to a file (no pipe a stalled reader
  could block); a failed start reports that file's last lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from agentab.engine.vllm.introspect import http_get
from agentab.errors import AgentabError

LOG_TAIL_LINES = 20

_GUARD = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
sys.stdin.buffer.read()  # EOF: agentab stopped the server itself, or agentab is gone
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
if alive():
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        sys.exit(0)
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    if alive():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """True when a server could bind `port` now (SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, read from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        rest = stat[stat.rindex(")") + 2 :].split()
        if len(rest) >= 3 and rest[0] != "Z" and int(rest[2]) == pgid:
            members.append(int(entry.name))
    return members


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last `n` lines of a log file (reads only its end)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode(errors="replace")
    except OSError:
        return []
    return data.splitlines()[-n:]


class _SignalsToExit:
    """Turn SIGTERM/SIGHUP into SystemExit while a server runs (main thread, default handlers)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self.deferred: int | None = None
        self.defer = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.defer:
            self.deferred = signum  # stopping already; exit once the stop is done
            return
        raise SystemExit(128 + signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


class ServerProcess:
    """A server started in its own process group with its log in a file."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        host: str,
        port: int,
        stop_grace_s: float,
        label: str = "vLLM server",
    ) -> None:
        self.label = label
        self.args = list(args)
        self.log_path = log_path
        self.host = host
        self.port = port
        self.stop_grace_s = stop_grace_s
        self.url = f"http://{host}:{port}"
        self._signals = _SignalsToExit()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._signals.install()
        try:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                )
        except OSError as exc:
            self._signals.restore()
            raise AgentabError(f"{label}: cannot run {self.args[0]!r}: {exc}") from None
        self.pgid = self.proc.pid
        try:
            self.guard = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD, str(self.pgid), str(stop_grace_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            self.proc.wait()
            self._signals.restore()
            raise
        self.started = time.monotonic()

    def failure(self, what: str) -> AgentabError:
        lines = tail_lines(self.log_path)
        shown = "\n".join(f"  | {line}" for line in lines) or "  | (the log is empty)"
        return AgentabError(f"{what}; last {len(lines)} lines of {self.log_path}:\n{shown}")

    def death(self, cause: BaseException) -> AgentabError | None:
        """If the server has exited, the error to raise instead of `cause` (which its death
        likely brought about: a request that failed with a disconnect says little, the server's
        last log lines say why); None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        said = str(cause) or type(cause).__name__
        return self.failure(f"{self.label} exited with status {code} while in use ({said})")

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until `/health` answered 200; a dead or silent server raises with its log."""
        deadline = self.started + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self.failure(f"{self.label} exited with status {code} before it was healthy")
            try:
                http_get(f"{self.url}/health", timeout_s=2.0)
                return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise self.failure(
                    f"{self.label} not healthy within {timeout_s:g} s (startup_timeout_s)"
                )
            time.sleep(0.25)

    def _wait_group_gone(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)
            if not group_members(self.pgid):
                return True
            if time.monotonic() > end:
                return False
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL after the grace period, then make sure the port is free."""
        self._signals.defer = True
        try:
            if group_members(self.pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGTERM)
                if not self._wait_group_gone(self.stop_grace_s):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.pgid, signal.SIGKILL)
                    self._wait_group_gone(10.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
            if self.guard.stdin is not None:
                self.guard.stdin.close()  # group gone: the guard exits without acting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.guard.wait(timeout=5.0)
            left = group_members(self.pgid)
            if left:
                raise AgentabError(f"vllm: processes {left} of the server's group survived SIGKILL")
            end = time.monotonic() + 10.0
            while not port_is_free(self.host, self.port):
                if time.monotonic() > end:
                    raise AgentabError(
                        f"vllm: port {self.port} still in use 10 s after the server stopped"
                    )
                time.sleep(0.2)
        finally:
            self._signals.defer = False
            self._signals.restore()
        if self._signals.deferred is not None:
            raise SystemExit(128 + self._signals.deferred)

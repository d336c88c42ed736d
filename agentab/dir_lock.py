"""One writing process per experiment dir or run dir: a lock file held while it writes.

Two `agentab ab` processes on one dir would each see the other's unfinished run dirs as left
over from a killed run, remove them and run them again: duplicate and missing records in runs
that look complete; two replays into one run dir would interleave their records. The second
process is refused instead, before it touches anything. An experiment dir is held for the
process's lifetime, a run dir for its run. The lock
is an advisory `flock` on a file in the dir, so it is released by the kernel when its process
ends however it ends (SIGKILL included): a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from agentab.errors import AgentabError

LOCK_NAME = ".agentab.lock"
"""The lock file's name in the dir (readers of the dir skip names that start with a dot)."""

_held: dict[Path, int] = {}  # dir -> the open descriptor whose lock this process holds


def lock_dir(directory: Path, command: str, flag: str = "-o") -> None:
    """Take `directory`'s lock for the rest of this process (created with its parents if
    missing); refuse with one line naming the process holding it and the `flag` that names
    the dir. Taking it again in the
    process that holds it is a no-op."""
    key = directory.resolve()
    if key in _held:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise AgentabError(f"{directory}: exists and is not a directory") from None
    except OSError as exc:
        raise AgentabError(f"{directory}: cannot create ({exc.strerror or exc})") from None
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise AgentabError(f"{path}: cannot create the lock file ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AgentabError(
            f"{directory}: in use by another {command} (pid {holder}); wait for it to end, or "
            f"choose another {flag}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd


def release_dir(directory: Path) -> None:
    """Give the lock back before the process ends (tests and library callers)."""
    fd = _held.pop(directory.resolve(), None)
    if fd is not None:
        os.close(fd)

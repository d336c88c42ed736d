"""One exception type for every user-facing failure.

Bad input (a malformed trace, an unreachable server, mismatched A/B arms) must end in one clear
line on stderr and exit status 2, never a traceback. Code raises `AgentabError` with a message
that names the file, line or field; `agentab.cli.main` prints it and exits.
"""

from __future__ import annotations

import traceback
from pathlib import Path


class AgentabError(Exception):
    """A user-facing error: the message is one line and says what is wrong and where."""

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class AgentabWarning(UserWarning):
    """A user-facing warning (an ignored unknown field, a lossy export): one stderr line each."""


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type, message and the innermost frame of agentab code."""
    message = " ".join(str(exc).split()) or "(no message)"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "agentab" in f.filename]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {message}{where}"

"""One exception type for every user-facing failure.

Bad input (a malformed trace, an unreachable server, mismatched A/B arms) must end in one clear
line on stderr and exit status 2, never a traceback. Code raises `AgentabError` with a message
that names the file, line or field; `agentab.cli.main` prints it and exits.
"""

from __future__ import annotations


class AgentabError(Exception):
    """A user-facing error: the message is one line and says what is wrong and where."""

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class AgentabWarning(UserWarning):
    """A user-facing warning (an ignored unknown field, a lossy export): one stderr line each."""

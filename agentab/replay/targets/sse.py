"""Splitting a streamed SSE body into lines in time linear in its size, with a bound per line.

Why its own piece: the body arrives in reads of at most a few tens of kilobytes, and a line can
span thousands of them. Joining the pending part with every new read (`buf + data`) and
splitting the whole again copies the pending part on every read, which is quadratic: one 128 MiB
`data:` line took 50-118 s and held the event loop for up to 0.8 s at a time, so the other
streams of the run were timed late and could time out (benchmarks/bench_sse_line.py). Here a
pending line is a list of pieces that is joined once, when its newline arrives, and each read is
scanned only for its own newlines. A line longer than `max_line_bytes` is refused as soon as
that many bytes are pending, before it is joined or parsed: what a server may make the client
hold for one event is bounded.
"""

from __future__ import annotations

import os

from agentab.errors import AgentabError

DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
"""The longest SSE line accepted by default (16 MiB). A streamed chunk carries one or a few tokens
(a few hundred bytes); even a whole 1M-token output in one chunk with its token ids is ~13 MB."""

MAX_LINE_ENV = "AGENTAB_MAX_SSE_LINE_BYTES"


def max_line_bytes_from_env() -> int:
    """The SSE line limit: `AGENTAB_MAX_SSE_LINE_BYTES` when set (a positive integer), else the
    default. An unusable value is refused in one line before any request is sent."""
    raw = os.environ.get(MAX_LINE_ENV)
    if raw is None or raw == "":
        return DEFAULT_MAX_LINE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise AgentabError(f"{MAX_LINE_ENV}={raw!r}: expected a positive number of bytes")
    return value


class LineTooLong(Exception):
    """An SSE line passed the limit; `pending` bytes of it had arrived when it was refused."""

    def __init__(self, pending: int, limit: int) -> None:
        super().__init__(f"an SSE line passed {limit:,} bytes ({pending:,} bytes of it read)")
        self.pending = pending
        self.limit = limit


class LineSplitter:
    """Feed reads in order; get the complete lines (without their `\\n`) each read finished."""

    __slots__ = ("_limit", "_pending", "_size")

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self._limit = max_line_bytes
        self._pending: list[bytes] = []  # the pieces of the line that has no newline yet
        self._size = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes of the current, unfinished line held so far."""
        return self._size

    def feed(self, data: bytes) -> list[bytes]:
        """The lines that `data` completes; raises `LineTooLong` once a line passes the limit."""
        cut = data.find(b"\n")
        if cut < 0:
            self._size += len(data)
            if self._size > self._limit:
                raise LineTooLong(self._size, self._limit)
            self._pending.append(data)
            return []
        if self._pending:
            self._pending.append(data[:cut])
            first = b"".join(self._pending)
            self._pending = []
            self._size = 0
            lines = data[cut + 1 :].split(b"\n")
            lines.insert(0, first)
        else:
            lines = data.split(b"\n")
        rest = lines.pop()  # the unfinished last line ("" when `data` ended with a newline)
        longest = max(map(len, lines))
        if longest > self._limit:
            raise LineTooLong(longest, self._limit)
        if rest:
            if len(rest) > self._limit:
                raise LineTooLong(len(rest), self._limit)
            self._pending.append(rest)
            self._size = len(rest)
        return lines

    def end(self) -> list[bytes]:
        """At the end of the body: its last line when the server closed without a line end
        after it (a stream's `data: [DONE]` so sent still ends the stream)."""
        if not self._pending:
            return []
        line = b"".join(self._pending)
        self._pending, self._size = [], 0
        return [line]


class EventTooLong(LineTooLong):
    """An SSE event's data lines together passed the limit (each line alone was within it)."""

    def __init__(self, pending: int, limit: int) -> None:
        super().__init__(pending, limit)
        self.args = (f"an SSE event passed {limit:,} bytes ({pending:,} bytes of it read)",)


class EventAssembler:
    """SSE lines in, the data of each complete event out (the WHATWG event-stream rules for the
    one field a completion stream uses).

    Why not one event per `data:` line: the spec lets a server split an event's data over
    several `data:` lines, which the client joins with newlines, and dispatches the event only
    at the blank line that ends it. A JSON chunk split that way is one chunk; read line by line
    it is two undecodable halves. The rules kept: a trailing CR is dropped (CRLF line ends), a
    line starting with ":" is a comment (a keep-alive, counted), `data` with no colon is an empty
    data line, one space after the colon is not part of the value, and other fields (`event`,
    `id`, `retry`) carry nothing the client reads. An event's joined data is held to the same
    limit as a line, so many short lines cannot make the client hold more than one long line.
    """

    __slots__ = ("_data", "_limit", "_size", "comments")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self._limit = max_event_bytes
        self._data: list[bytes] = []  # the data lines of the event not yet dispatched
        self._size = 0
        self.comments = 0

    def feed(self, lines: list[bytes]) -> tuple[list[bytes], bool]:
        """(the data of every event these lines end, whether any of them was a data line)."""
        events: list[bytes] = []
        saw_data = False
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data, self._size = [], 0
                continue
            if line.startswith(b":"):
                self.comments += 1
                continue
            name, _, value = line.partition(b":")
            if name != b"data":
                continue
            if value.startswith(b" "):
                value = value[1:]
            self._size += len(value) + 1
            if self._size > self._limit:
                raise EventTooLong(self._size, self._limit)
            self._data.append(value)
            saw_data = True
        return events, saw_data

    def end(self) -> list[bytes]:
        """At the end of the body: the last event when the server closed without the blank
        line that ends it (the spec drops it; a stream's last `data: [DONE]` is kept, so a
        server that closes right after it is not taken for a broken stream)."""
        if not self._data:
            return []
        event = b"\n".join(self._data)
        self._data, self._size = [], 0
        return [event]

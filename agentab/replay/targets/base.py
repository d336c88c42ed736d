"""What the runner sends to and gets back from a target, whatever the target is.

A target gets a `RequestSpec` (which recorded request, with which salt and `max_tokens`) and fills
an `Outcome` in place while the response streams: the send time, every chunk's arrival time, the
server's usage, or an error class. Filling in place (rather than yielding chunks) keeps the
per-chunk cost to one list append, and leaves the partial outcome in the runner's hands when a
request is cancelled mid-stream (SIGINT, error-rate abort).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from agentab.workloads.model import Request, Session

ERROR_CLASSES: tuple[str, ...] = (
    "connect",  # no connection to the server (refused, unreachable, connect timeout)
    "timeout",  # no bytes for request_timeout_s (before the headers or between chunks)
    "http",  # a non-2xx status; the message starts with the status and an excerpt of the body
    "context_overflow",  # the server refused the prompt as longer than its context
    "broken_stream",  # the connection closed or reset before the stream ended properly
    "malformed_stream",  # a chunk that is not a JSON object, or a stream the client cannot read
    "stream_error",  # the server sent an error object inside the stream
    "empty_response",  # HTTP 200 and a proper end, but not one content chunk
    "short_output",  # fewer tokens than max_tokens although ignore_eos was asked
    "no_usage",  # the stream ended without the usage chunk that was asked for
    "over_generation",  # more tokens than max_tokens (delivered, or claimed by usage)
    "usage_above_delivered",  # usage counts more tokens than the chunks' token ids hold
    "aborted",  # the server ended the stream with finish_reason "abort"
    "line_too_long",  # one SSE line passed the client's line limit (it is not read further)
    "keepalive_timeout",  # only keep-alive comments, no data, for request_timeout_s
    "engine",  # the in-process engine refused or failed the request
    "client",  # an unexpected failure inside the client (a bug; the message says what)
    "cancelled",  # the run ended (signal, error-rate abort) while the request was in flight
)
"""Values of the `error_class` record column (null on success)."""

WARNING_CLASSES: tuple[str, ...] = (
    "empty_chunks",  # chunks without text or token ids: received, not timed as tokens
    "usage_above_chunks",  # usage above the chunk count, where chunks carry no token ids
    "resent",  # a pooled connection closed before any answer: sent again on a new one
)
"""Values of the `warning_class` record column (null when nothing was flagged). A warning never
fails a request: its metrics stand, but a server fault may be behind it (docs/replay.md)."""


@dataclass(slots=True)
class RequestSpec:
    """One request to send: the recorded request, its session, salt and output length, and the
    lane that plays it (closed loop; open loop: the arrival's index), which a target of several
    replicas routes on so that a session stays on one replica."""

    request_id: str
    session: Session
    request: Request
    salt: int
    max_tokens: int
    lane: int = 0


@dataclass(slots=True)
class Outcome:
    """Filled by the target while the response streams (loop times are absolute)."""

    sent: float | None = None  # loop time just before the request left the client
    end: float | None = None  # loop time when the response ended (or failed)
    # seconds after `sent`, and tokens per chunk when the target knows them (lists as they
    # stream, or float64 / int32 arrays from a target that gets them in one piece)
    chunk_times: list[float] | np.ndarray = field(default_factory=list)
    chunk_tokens: list[int] | np.ndarray | None = None
    reasoning_chunks: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error_class: str | None = None
    error_message: str | None = None
    warning_class: str | None = None
    warning_message: str | None = None
    # which of the run's target URLs served it (the manifest's `targets`); None in-process
    target: int | None = None

    def fail(self, error_class: str, message: str) -> None:
        if self.error_class is None:  # the first failure is the cause; keep it
            self.error_class = error_class
            self.error_message = message[:500]

    def warn(self, warning_class: str, message: str) -> None:
        if self.warning_class is None:  # as with failures, the first one flagged is kept
            self.warning_class = warning_class
            self.warning_message = message[:500]


class Target(Protocol):
    """Where requests go. `start` before the first `send`, `close` after the last."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        """Send `spec` and fill `out`; failures go into `out`, never raised (but cancellation)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts for the run manifest (target kind, url, model, engine facts when known)."""
        ...

    async def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        """The server's current metrics as (name, labels, value); [] when it has none."""
        ...

    def warm(self, spec: RequestSpec) -> None:
        """Pay the one-time cost of building a request (the prompt builder's first-use compile,
        about 0.2-1 s) before the run's clock starts, without sending it or changing what later
        requests are built from; nothing where there is no such cost."""
        ...

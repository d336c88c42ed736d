"""Per-request latency histograms of the OpenAI server (`agentab serve`), split where it goes.

Why: a client's time to first token holds more than the engine's steps: the server reading and
parsing the request, the wait for a step to take the request in, the steps that compute its
prompt, and the way back out to the stream. The simulator prices only the steps, so a gap
between simulated and measured TTFT can be placed only if the server says where its time went.
Each request is stamped on the server's loop clock at:

    received   the handler starts (headers parsed; the time before that is not seen here)
    arrival    the request is handed to the engine (body read and parsed, prompt tokenized)
    scheduled  the first step that includes it starts (the engine's step record; a measured
               engine's step starts when it is scheduled, a priced one's at its priced start)
    token      the engine's time of the step that produced its first token (`TokenEvent.t`)
    seen       the handler has that first token
    written    the first content chunk is written to the stream (streamed requests only)
    finished   the handler has the request's final usage

and the intervals are exported as Prometheus histograms, under vLLM's names and definitions
where vLLM has the quantity (vllm/v1/metrics/stats.py: TTFT from arrival to the frontend's
first output, queue from queued to first scheduled, prefill from first scheduled to the first
token's engine-core timestamp, e2e from arrival to the final output; preemptions do not reset
`scheduled`), with vLLM's bucket boundaries:

    agentab:request_intake_seconds         received -> arrival   (at hand-off)
    vllm:request_queue_time_seconds        arrival  -> scheduled (at finish)
    vllm:request_prefill_time_seconds      scheduled -> token    (at finish)
    vllm:time_to_first_token_seconds       arrival  -> seen      (at the first token)
    agentab:first_token_output_seconds     token    -> written   (at the first write)
    vllm:e2e_request_latency_seconds       arrival  -> finished  (at finish)

intake + queue + prefill + output is the server's own TTFT, from the handler's start to the
first chunk written; what a client measures beyond it is the network and the two processes'
loops. A request the client abandons is observed only for what it reached; one the engine
refuses is observed for its intake only.

Written here rather than with prometheus_client: the server already renders its own exposition
(with vLLM's `model_name` label), six histograms with fixed buckets are a few lines, and core
stays free of another dependency.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import asdict, dataclass
from typing import Any

# vLLM's default bucket families (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

INTAKE = "agentab:request_intake_seconds"
QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"
OUTPUT = "agentab:first_token_output_seconds"
E2E = "vllm:e2e_request_latency_seconds"

HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    INTAKE: ("Request received by the server until handed to the engine.", TTFT_BUCKETS),
    QUEUE: ("Request handed to the engine until its first step started.", REQUEST_LATENCY_BUCKETS),
    PREFILL: ("First step started until the first token was produced.", REQUEST_LATENCY_BUCKETS),
    TTFT: ("Request handed to the engine until the server had its first token.", TTFT_BUCKETS),
    OUTPUT: ("First token produced by the engine until written to the stream.", TTFT_BUCKETS),
    E2E: (
        "Request handed to the engine until the server had its final usage.",
        REQUEST_LATENCY_BUCKETS,
    ),
}
"""name -> (help text, bucket upper bounds); the order is the exposition's."""

BREAKDOWN = (INTAKE, QUEUE, PREFILL, OUTPUT)
"""The histograms whose sum is the server's TTFT (handler start to first chunk written)."""


class Histogram:
    """A Prometheus histogram: per-bucket counts (cumulated when rendered), sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket `le` holds values <= le
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str, help_text: str) -> list[str]:
        """Exposition lines; `labels` is the inside of the braces (`model_name="m"`)."""
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        total = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(total)!r}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {float(self.count)!r}")
        return out


@dataclass(slots=True)
class RequestTimes:
    """One request's stamps on the server's loop clock (see the module docstring)."""

    received: float
    arrival: float | None = None
    scheduled: float | None = None
    token: float | None = None
    seen: float | None = None
    written: float | None = None
    finished: float | None = None


class RequestMetrics:
    """The server's histograms and the stamps of requests in flight.

    `observe_step` is the engine's step observer (or is called by it): the first record that
    names a request stamps its `scheduled` time. With `record`, every request's stamps are kept
    by its `X-Request-Id` (`timings`), for comparing them with a client's records.
    """

    def __init__(self, *, record: bool = False) -> None:
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
        self.record = record
        self.timings: dict[str, dict[str, float | None]] = {}
        self._unscheduled: dict[str, RequestTimes] = {}  # engine id -> stamps, until scheduled

    def observe_step(self, record: dict[str, Any]) -> None:
        if not self._unscheduled:
            return
        for row in record["requests"]:
            times = self._unscheduled.pop(row["id"], None)
            if times is not None:
                times.scheduled = record["t_start_s"]

    def handed(self, times: RequestTimes, engine_id: str, now: float) -> None:
        """The request goes to the engine now."""
        times.arrival = now
        self.histograms[INTAKE].observe(now - times.received)
        self._unscheduled[engine_id] = times

    def first_token(self, times: RequestTimes, token_t: float, now: float) -> None:
        assert times.arrival is not None
        times.token, times.seen = token_t, now
        self.histograms[TTFT].observe(now - times.arrival)

    def first_written(self, times: RequestTimes, now: float) -> None:
        assert times.token is not None
        times.written = now
        self.histograms[OUTPUT].observe(now - times.token)

    def finished(self, times: RequestTimes, now: float) -> None:
        assert times.arrival is not None
        times.finished = now
        if times.scheduled is not None:
            self.histograms[QUEUE].observe(times.scheduled - times.arrival)
            if times.token is not None:
                self.histograms[PREFILL].observe(times.token - times.scheduled)
        self.histograms[E2E].observe(now - times.arrival)

    def close(self, times: RequestTimes, engine_id: str, client_id: str | None) -> None:
        """The request's handler is done (whatever the outcome): keep its stamps if recording."""
        self._unscheduled.pop(engine_id, None)
        if self.record and client_id:
            self.timings[client_id] = asdict(times)

    def lines(self, labels: str) -> list[str]:
        out: list[str] = []
        for name, hist in self.histograms.items():
            out.extend(hist.lines(name, labels, HISTOGRAMS[name][0]))
        return out

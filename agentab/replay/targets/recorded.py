"""RecordedTarget: answers every request with the timing the trace recorded, sending nothing.

Why: a dry run of the replay logic itself. With this target a replay reproduces the recorded
timeline (start times, joins, subagent overlap) up to idle compression and the start point, so
plans can be checked against the trace and the runner's own overhead measured without a server.

Timing of one request: first chunk after the recorded `ttft` (0 when absent), then the remaining
`max_tokens - 1` tokens evenly spaced up to the recorded `api_time` (scaled by the number of
tokens asked for, so a `max_tokens` 1 warmup request takes only its `ttft`). Only two timers
are used per request however long the output; the chunk times in between are computed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentab.replay.targets.base import Outcome, RequestSpec


class RecordedTarget:
    """A target that replays the recorded per-request timing on the current clock.

    `time_factor` stretches every response (2.0: a server twice as slow as the recording).
    """

    def __init__(self, time_factor: float = 1.0) -> None:
        self.time_factor = time_factor

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"target": "recorded", "engine": "recorded-timing", "time_factor": self.time_factor}

    async def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        return []

    def warm(self, spec: RequestSpec) -> None:
        return None  # builds no prompts

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        loop = asyncio.get_running_loop()
        r = spec.request
        f = self.time_factor
        ttft = max(0.0, r.ttft or 0.0) * f
        total = (r.api_time if r.api_time is not None else 0.0) * f
        total = max(total, ttft)
        n = spec.max_tokens
        decode = total - ttft
        per_token = decode / (r.out_tokens - 1) if r.out_tokens > 1 and decode > 0 else 0.0
        out.sent = loop.time()
        out.prompt_tokens = r.in_tokens
        times: list[float] = []
        out.chunk_times = times  # filled as the chunks arrive: an abort keeps what came
        await asyncio.sleep(ttft)
        times.append(ttft)
        if n > 1:
            await asyncio.sleep(per_token * (n - 1))
            times.extend(ttft + per_token * i for i in range(1, n))
        out.chunk_tokens = [1] * n
        out.completion_tokens = n
        out.end = loop.time()

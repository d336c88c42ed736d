"""EngineTarget: requests go straight into an in-process Engine on the same loop and clock.

Why a separate target rather than a loopback HTTP server: under the virtual clock there is no
real network, and the engine's token events carry their exact emission times, so an hour of
traffic simulates in seconds with the same runner code. The records look exactly like HTTP ones
(chunk times after the send time, usage with cached tokens), so the analysis cannot tell them
apart beyond the manifest.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentab.engine.types import EngineRequest, FinalUsage, TokenEvent
from agentab.replay.metrics import engine_samples
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.workloads.tokens import prompt_token_ids

_CONTEXT_WORDS = ("context", "too long", "max_model_len", "maximum model length", "kv blocks")


class EngineTarget:
    """Streams requests through `engine.generate`; starts and stops the engine's step loop."""

    def __init__(self, engine: Any, *, vocab_size: int = 32000, manage: bool = True) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        self.manage = manage  # start/stop the engine with the run

    async def start(self) -> None:
        if self.manage:
            self.engine.start()

    async def close(self) -> None:
        if self.manage:
            await self.engine.stop()

    def describe(self) -> dict[str, Any]:
        facts = dict(self.engine.describe())
        facts["target"] = "in-process"
        return facts

    async def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        return engine_samples(self.engine.metrics())

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        loop = asyncio.get_running_loop()
        ids = prompt_token_ids(
            spec.session, spec.request, salt=spec.salt, vocab_size=self.vocab_size
        )
        req = EngineRequest(spec.request_id, ids, spec.max_tokens)
        times = out.chunk_times
        tokens: list[int] = []
        out.sent = sent = loop.time()
        finished = False
        try:
            async for ev in self.engine.generate(req):
                if isinstance(ev, TokenEvent):
                    # The event's own time is when the engine emitted it: what an ideal client
                    # on the same machine would observe.
                    times.append(ev.t - sent)
                    tokens.append(ev.num_tokens)
                elif isinstance(ev, FinalUsage):
                    out.prompt_tokens = ev.prompt_tokens
                    out.completion_tokens = ev.completion_tokens
                    out.cached_tokens = ev.cached_tokens
                    if ev.finish_reason == "abort":
                        out.fail("engine", "the engine aborted the request")
                    finished = True
        except asyncio.CancelledError:
            self.engine.abort(spec.request_id)
            raise
        except Exception as exc:  # the engine refused the request (e.g. prompt too long)
            text = str(exc)
            overflow = any(w in text.lower() for w in _CONTEXT_WORDS)
            kind = "context_overflow" if overflow else "engine"
            out.fail(kind, f"{type(exc).__name__}: {text}")
        out.chunk_tokens = tokens
        out.end = loop.time()
        if not finished and out.error_class is None:
            out.fail("engine", "the engine stream ended without usage")

"""EngineTarget: requests go straight into an in-process Engine on the same loop and clock.

Why a separate target rather than a loopback HTTP server: under the virtual clock there is no
real network, and the engine's token events carry their exact emission times, so an hour of
traffic simulates in seconds with the same runner code. The records look exactly like HTTP ones
(chunk times after the send time, usage with cached tokens), so the analysis cannot tell them
apart beyond the manifest.

What an HTTP client sees beyond the engine's steps, a profile states as its `[frontend]`
latencies, and this target adds them: the request reaches the engine `intake_s` after it was
sent, and every chunk (so also the request's end, which the next turn waits for) reaches the
client `output_s` after the step that produced it. Both zero (every profile without the table)
is the ideal client, with nothing added.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from agentab.engine.core import Timeline
from agentab.engine.types import EngineRequest, PromptPrefix
from agentab.replay.metrics import engine_samples
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.workloads.tokens import PromptTokens

_CONTEXT_WORDS = ("context", "too long", "max_model_len", "maximum model length", "kv blocks")


class EngineTarget:
    """Streams requests through `engine.generate`; starts and stops the engine's step loop."""

    def __init__(
        self,
        engine: Any,
        *,
        vocab_size: int = 32000,
        manage: bool = True,
        intake_s: float = 0.0,
        output_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        self.manage = manage  # start/stop the engine with the run
        self.intake_s = intake_s
        self.output_s = output_s
        # an agent's prompts are built in place, one after the other: the engine keeps only
        # a prompt's stable blocks, which the next prompt of its agent does not change
        # ids as uint16 where the vocabulary allows: half the memory each new context touches
        self._dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        self._prompts = PromptTokens(vocab_size, extend=True, dtype=self._dtype)

    async def start(self) -> None:
        if self.manage:
            self.engine.start()

    async def close(self) -> None:
        if self.manage:
            await self.engine.stop()

    def describe(self) -> dict[str, Any]:
        facts = dict(self.engine.describe())
        facts["target"] = "in-process"
        if self.intake_s or self.output_s:
            facts["frontend"] = {"intake_s": self.intake_s, "output_s": self.output_s}
        return facts

    async def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        return engine_samples(self.engine.metrics())

    def warm(self, spec: RequestSpec) -> None:
        """Build `spec`'s prompt with a builder of its own: `self._prompts` would take it for
        its agent's previous prompt and tell the engine the first real one shares it."""
        builder = PromptTokens(self.vocab_size, extend=True, dtype=self._dtype)
        builder.build(spec.session, spec.request, salt=spec.salt)

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        loop = asyncio.get_running_loop()
        # the prompt is built from its agent's previous one: the engine is told how much the
        # two share instead of finding it by comparison (PromptPrefix)
        built = self._prompts.build(spec.session, spec.request, salt=spec.salt)
        prefix = PromptPrefix(built.key, built.base, built.shared_tokens, built.stable_tokens)
        req = EngineRequest(spec.request_id, built.ids, spec.max_tokens, prefix)
        out.sent = sent = loop.time()
        timeline: Timeline | None = None
        shift = self.output_s
        try:
            if self.intake_s:
                await asyncio.sleep(self.intake_s)
            # The chunks come back as arrays at the end (Engine.submit), not as one event per
            # step: the runner reacts only to a request's end, and each chunk's time is when the
            # engine emitted it, which is what an ideal client on the same machine observes.
            timeline = self.engine.submit(req)
            usage = await timeline.finished
            if shift:
                await asyncio.sleep(shift)  # the last chunk is on its way to the client
            out.prompt_tokens = usage.prompt_tokens
            out.completion_tokens = usage.completion_tokens
            out.cached_tokens = usage.cached_tokens
            if usage.finish_reason == "abort":
                out.fail("engine", "the engine aborted the request")
        except asyncio.CancelledError:
            if timeline is not None:  # the record keeps the chunks the client had at the cancel
                self.engine.abort(spec.request_id)
                times = timeline.chunk_arrays()[0]
                if shift:
                    times = times[times + shift <= loop.time()] + shift
                out.chunk_times = times - sent
            raise
        except Exception as exc:  # the engine refused the request (e.g. prompt too long)
            text = str(exc)
            overflow = any(w in text.lower() for w in _CONTEXT_WORDS)
            kind = "context_overflow" if overflow else "engine"
            out.fail(kind, f"{type(exc).__name__}: {text}")
        if timeline is None:  # refused before it was queued
            out.chunk_tokens = []
        else:
            times, counts = timeline.chunk_arrays()
            if shift:
                times = times + shift
            out.chunk_times = times - sent  # arrays: the record writer takes them as they are
            out.chunk_tokens = counts
        out.end = loop.time()

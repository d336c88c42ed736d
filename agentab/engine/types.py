"""What flows in and out of an engine: one request, its token events and its final usage.

These are the engine's public vocabulary (docs/interfaces.md, engine section). They are plain
frozen records so the replay, the OpenAI server and tests can build and compare them freely.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class EngineRequest:
    """One completion request: its prompt token ids and how many tokens to generate.

    The engine always generates exactly `max_tokens` tokens (no stop strings): traces record
    output lengths, and replay asks for exactly those.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    max_tokens: int


@dataclass(slots=True)
class TokenEvent:
    """`num_tokens` tokens emitted at loop time `t` (spec decode may emit several at once).

    `token_ids` are the ids the engine produced (a real model's samples, or the simulator's
    synthetic ids): a read-only view of the request's token buffer.
    Read-only by convention, not `frozen`: the simulator creates millions of these and a frozen
    dataclass costs four times as much to construct.
    """

    t: float
    num_tokens: int
    token_ids: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class FinalUsage:
    """The last item of a stream, delivered right after the request's last TokenEvent.

    `cached_tokens` is the prefix-cache hit of the request's first admission (a multiple of the
    block size), as vLLM reports it; `finish_reason` is "length" or "abort".
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str

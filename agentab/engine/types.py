"""What flows in and out of an engine: one request, its token events and its final usage.

These are the engine's public vocabulary (docs/interfaces.md, engine section). They are plain
frozen records so the replay, the OpenAI server and tests can build and compare them freely.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class PromptPrefix:
    """What an in-process client knows of a prompt: which earlier prompt it starts with.

    Why: a multi-turn conversation resends its whole context each turn, so finding by
    comparison which blocks a prompt shares with an earlier one (to reuse their prefix-cache
    keys) costs a pass over ~30k tokens per request, while the client that built the prompt
    from its predecessor already knows. `key` names this prompt (any object, compared by
    identity); its first `shared_tokens` ids are exactly those of the prompt named `base`.
    The engine trusts the claim, so only a client that built the prompt that way may make
    it (the replay's in-process target); the engine hashes the same keys either way, and
    without the base's keys at hand (never seen, or forgotten) it compares as usual. The
    client also leaves the prompt's first `stable_tokens` ids (None: all of them) unchanged
    after the call: the engine keeps those whole blocks of the prompt array as they are
    instead of copying them (Request.defer_prompt), and copies the ids after them.
    """

    key: object
    base: object | None = None
    shared_tokens: int = 0
    stable_tokens: int | None = None


@dataclass(frozen=True, slots=True, eq=False)
class EngineRequest:
    """One completion request: its prompt token ids and how many tokens to generate.

    The engine always generates exactly `max_tokens` tokens (no stop strings): traces record
    output lengths, and replay asks for exactly those. `prefix` is an in-process client's
    statement of the prompt shared with an earlier one (see PromptPrefix); HTTP has none.
    `draw_id` is the id speculative decoding's synthetic acceptance draws are keyed on
    (agentab.engine.spec_decode): the client's own request id where it sends one, since the
    server's `request_id` carries its arrival counter, which differs between the arms of an
    A/B and from the simulator's; None keys them on `request_id`.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    max_tokens: int
    prefix: PromptPrefix | None = None
    draw_id: str | None = None


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

"""Speculative decoding: how many drafts each verify step accepts, and vLLM's counters.

Two acceptance models. A fixed synthetic acceptance length A (the seed's "acceptance 6 with 7
drafts"): every full verify step accepts A - 1 drafts and so emits A tokens (a non-integral A
alternates between floor and ceil at random so that the mean is A). Or per-position
acceptance rates p_1 >= ... >= p_k (what vLLM reports per position, and what a user measures on
their own prompts): a verify step accepts at least i drafts with probability p_i, drawn from one
uniform u per (request, verify step) as #{i : u < p_i}. The uniform is a hash of (seed, request
id, verify index), so a request's draws do not depend on what else is batched or on arrival order:
both arms of an A/B see the same acceptance sequence per request.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np

from agentab.engine.hashing import mix64
from agentab.errors import AgentabError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class SpecConfig:
    """k draft tokens per step and the acceptance model (exactly one of the two when k > 0)."""

    num_draft_tokens: int = 0
    acceptance_length: float | None = None
    acceptance_probs: tuple[float, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if k < 0:
            raise AgentabError(f"num_draft_tokens: {k} must be >= 0")
        has_len = self.acceptance_length is not None
        has_probs = self.acceptance_probs is not None
        if k == 0:
            if has_len or has_probs:
                raise AgentabError("acceptance_length/acceptance_probs need num_draft_tokens > 0")
            return
        if has_len == has_probs:
            raise AgentabError(
                f"num_draft_tokens={k} needs exactly one of acceptance_length or acceptance_probs"
            )
        if has_len:
            a = self.acceptance_length
            if isinstance(a, bool) or not isinstance(a, int | float) or not 1 <= a <= k + 1:
                raise AgentabError(f"acceptance_length: {a!r} must be a number in [1, {k + 1}]")
        else:
            p = self.acceptance_probs or ()
            if len(p) != k:
                raise AgentabError(f"acceptance_probs: needs {k} values (one per draft position)")
            if any(not 0.0 <= x <= 1.0 for x in p):
                raise AgentabError("acceptance_probs: every value must be in [0, 1]")
            if any(b > a for a, b in itertools.pairwise(p)):
                raise AgentabError("acceptance_probs: must be non-increasing (per-position rates)")

    @property
    def enabled(self) -> bool:
        return self.num_draft_tokens > 0

    def describe(self) -> dict[str, object] | None:
        if not self.enabled:
            return None
        out: dict[str, object] = {"method": "simulated", "num_draft_tokens": self.num_draft_tokens}
        if self.acceptance_length is not None:
            out["acceptance_length"] = self.acceptance_length
        else:
            out["acceptance_probs"] = list(self.acceptance_probs or ())
        return out

    def accepted(self, keys: np.ndarray, index: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """Accepted drafts for verify steps number `index` of requests `keys` with `drafts` each.

        Arrays broadcast together (a window passes (steps, rows) matrices).
        """
        if not self.enabled:
            return np.zeros(np.broadcast(keys, index, drafts).shape, dtype=np.int64)
        a = self.acceptance_length
        if a is not None:
            whole = int(a - 1)
            if whole == a - 1:
                return np.minimum(whole, drafts)
            # a non-integral mean: floor or ceil, the ceil with probability frac(a - 1)
            extra = uniform(self.seed, keys, index) < (a - 1 - whole)
            return np.minimum(whole + extra.astype(np.int64), drafts)
        u = uniform(self.seed, keys, index)
        p = np.asarray(self.acceptance_probs, dtype=np.float64)
        count = (u[..., None] < p).sum(axis=-1)
        return np.minimum(count, drafts)


def request_key(request_id: str) -> int:
    """A 64-bit key of a request id (stable across runs and arrival orders)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def uniform(seed: int, keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Counter-based uniforms in [0, 1) from (seed, key, index)."""
    k = np.asarray(keys, dtype=np.uint64)
    i = np.asarray(index, dtype=np.uint64)
    s = np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
    z = mix64(mix64(k ^ s) + (i + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

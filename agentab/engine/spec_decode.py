"""Speculative decoding: how many drafts each verify step accepts, and vLLM's counters.

One acceptance model, vLLM's synthetic rejection method (`rejection_sample_method =
"synthetic"`, vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py), for the simulator
and the local engine alike: both call `SpecConfig.accepted`. vLLM's semantics, reproduced:

1. The model is per-position *unconditional* rates p_1 >= ... >= p_k: p_i is the probability
   that the first i drafts are all accepted. A mean acceptance length L (the seed's
   "acceptance 6 with 7 drafts") is turned into rates by vLLM's minimum-variance schedule
   (`acceptance_length_to_rates`): with a = L - 1 expected accepted drafts, the first
   floor(a) positions are always accepted, the next with probability frac(a), none after.
   L = 6, k = 7: [1, 1, 1, 1, 1, 0, 0], five drafts accepted at every full verify step.
   L = 3.8, k = 7: [1, 1, 0.8, 0, 0, 0, 0], two or three drafts (three with probability 0.8).
2. The verify loop uses the *conditional* rates c_i = p_i / p_{i-1} (p_0 = 1; 0 where
   p_{i-1} = 0), as float32 (vLLM keeps them in a float32 tensor): at draft position i it
   draws a uniform u_i and accepts iff u_i < c_i; the first rejection ends the loop. A row
   with fewer drafts (a partial verify) stops at its last draft.

What differs from vLLM is only the uniforms' source: vLLM draws Philox `tl.rand(request seed,
token position)`; here u_i is a hash of (engine seed, request key, verify index, i), so a
request's acceptance sequence does not depend on batching, arrival order or on how many tokens
earlier steps accepted (the simulator's windows also draw many steps at once from it). The
key is the client's own request id where it sends one (`X-Request-Id` over HTTP; the replay
plan's id in process), so both arms of an A/B and the simulator replaying the same plan see
the same draws for the same request. The distribution is vLLM's.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentab.engine import loops_numba
from agentab.engine.hashing import mix64
from agentab.errors import AgentabError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POSITION = loops_numba.POSITION
# a step's rows as a `StepPlan` holds them: keys, verify counters, drafts
_ROW_TYPES = (np.dtype(np.uint64), np.dtype(np.int64), np.dtype(np.int64))


def acceptance_length_to_rates(length: float, k: int) -> tuple[float, ...]:
    """vLLM's `SpeculativeConfig._acceptance_length_to_rates`: a mean acceptance length as
    per-position unconditional rates, the minimum-variance schedule (see the module)."""
    num_drafts = length - 1  # expected number of accepted draft tokens
    num_full = int(num_drafts)
    rates = [1.0] * num_full + [num_drafts - num_full] + [0.0] * (k - num_full - 1)
    return tuple(rates[:k])


def conditional_rates(rates: tuple[float, ...]) -> np.ndarray:
    """vLLM's `unconditional_to_conditional_rates` (c_i = p_i / p_{i-1}), as the float32
    values its verify kernel compares against."""
    prev = (1.0, *rates[:-1])
    return np.array([p / q if q > 0.0 else 0.0 for p, q in zip(rates, prev, strict=True)],
                    dtype=np.float32)  # fmt: skip


@dataclass(frozen=True)
class SpecConfig:
    """k draft tokens per step and the acceptance model (exactly one of the two when k > 0):
    a mean acceptance length, or per-position unconditional rates (vLLM's
    `synthetic_acceptance_length` / `synthetic_acceptance_rates`)."""

    num_draft_tokens: int = 0
    acceptance_length: float | None = None
    acceptance_probs: tuple[float, ...] | None = None
    seed: int = 0
    # "synthetic": drafts are accepted by the model above; "standard": by a real model's
    # greedy verification (the local engine's executor), which needs no acceptance model
    rejection_sample_method: str = "synthetic"
    # derived in __post_init__: the conditional rates, and whether they decide every draw
    # (0s and 1s only: an integral acceptance length) with how many drafts then accepted
    _conditional: np.ndarray = field(
        init=False, repr=False, compare=False, default_factory=lambda: np.zeros(0)
    )
    _decided: bool = field(init=False, repr=False, compare=False, default=True)
    _whole: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if k < 0:
            raise AgentabError(f"num_draft_tokens: {k} must be >= 0")
        has_len = self.acceptance_length is not None
        has_probs = self.acceptance_probs is not None
        if self.rejection_sample_method not in ("synthetic", "standard"):
            raise AgentabError(
                f"rejection_sample_method: {self.rejection_sample_method!r} is not one of "
                "standard, synthetic"
            )
        if self.rejection_sample_method == "standard":
            if has_len or has_probs:
                raise AgentabError("acceptance_length/acceptance_probs need synthetic rejection")
            return
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
        # the conditional rates, as float64 holding vLLM's float32 values (compared per draw)
        cond = conditional_rates(self.rates).astype(np.float64)
        object.__setattr__(self, "_conditional", cond)
        object.__setattr__(self, "_decided", bool(np.all((cond == 0.0) | (cond == 1.0))))
        object.__setattr__(self, "_whole", int(np.cumprod(cond == 1.0).sum()))

    @property
    def enabled(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def synthetic(self) -> bool:
        """Whether drafts are accepted by the synthetic model (not by comparing tokens)."""
        return self.enabled and self.rejection_sample_method == "synthetic"

    @property
    def rates(self) -> tuple[float, ...]:
        """The per-position unconditional rates (empty without drafts)."""
        if self.acceptance_probs is not None:
            return tuple(float(p) for p in self.acceptance_probs)
        if self.acceptance_length is None:
            return ()
        return acceptance_length_to_rates(float(self.acceptance_length), self.num_draft_tokens)

    def describe(self) -> dict[str, object] | None:
        if not self.enabled:
            return None
        out: dict[str, object] = {"method": "simulated", "num_draft_tokens": self.num_draft_tokens}
        if self.acceptance_length is not None:
            out["acceptance_length"] = self.acceptance_length
        else:
            out["acceptance_probs"] = list(self.acceptance_probs or ())
        return out

    def draws(self) -> tuple[np.uint64, np.ndarray, int]:
        """What a compiled loop needs to draw `accepted`'s values itself (loops_numba.verify_run):
        the mixed seed, the conditional rates, and the drafts every full verify step accepts
        when the rates decide every draw (-1 when they do not)."""
        if not self.synthetic:
            raise AgentabError("standard rejection: the executor accepts drafts (a real model)")
        s = np.uint64((self.seed * 0x9E3779B97F4A7C15) % (1 << 64))
        return s, self._conditional, self._whole if self._decided else -1

    def accepted(self, keys: np.ndarray, index: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """Accepted drafts for verify steps number `index` of requests `keys` with `drafts` each
        (vLLM's synthetic verify loop, see the module).

        Arrays broadcast together (a window passes (steps, rows) matrices).
        """
        if not self.enabled:
            return np.zeros(np.broadcast(keys, index, drafts).shape, dtype=np.int64)
        if not self.synthetic:
            raise AgentabError("standard rejection: the executor accepts drafts (a real model)")
        cond = self._conditional
        k = self.num_draft_tokens
        if loops_numba.ENABLED and not self._decided and _step_rows(keys, index, drafts):
            # a step's rows go to the compiled loop as they are: the broadcasting and dtype
            # passes below cost a step several times the draws (~3% of a 7-draft hour); an
            # int64 counter viewed as uint64 has the bits numpy's cast gives it
            out = np.empty(len(keys), dtype=np.int64)
            loops_numba.accepted_drafts(
                keys, index.view(np.uint64), drafts, self.draws()[0], cond, out
            )
            return out
        shape = np.broadcast(keys, index, drafts).shape
        if self._decided:  # rates of 0 and 1 only: u < 1 always holds, u < 0 never
            return np.minimum(np.broadcast_to(self._whole, shape), drafts).astype(np.int64)
        if loops_numba.ENABLED:  # the same draws, one compiled loop (stops at a rejection)
            flat = np.broadcast_arrays(
                np.asarray(keys, dtype=np.uint64),
                np.asarray(index, dtype=np.uint64),
                np.asarray(drafts, dtype=np.int64),
            )
            out = np.empty(shape, dtype=np.int64)
            s = self.draws()[0]
            k_, i_, d_ = (np.ascontiguousarray(x).reshape(-1) for x in flat)
            loops_numba.accepted_drafts(k_, i_, d_, s, cond, out.reshape(-1))
            return out
        u = position_uniforms(self.seed, keys, index, k)
        # the leading run of accepted positions (the loop stops at its first rejection)
        run = np.cumprod(u < cond, axis=-1).sum(axis=-1)
        return np.minimum(run, drafts).astype(np.int64)


def _step_rows(keys: Any, index: Any, drafts: Any) -> bool:
    """Whether the arrays are one step's rows as a `StepPlan` holds them: 1-D, one length, keys
    uint64, verify counters and drafts int64."""
    return (
        isinstance(keys, np.ndarray)
        and isinstance(index, np.ndarray)
        and isinstance(drafts, np.ndarray)
        and (keys.dtype, index.dtype, drafts.dtype) == _ROW_TYPES
        and keys.ndim == index.ndim == drafts.ndim == 1
        and len(keys) == len(index) == len(drafts)
    )


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


def position_uniforms(seed: int, keys: np.ndarray, index: np.ndarray, k: int) -> np.ndarray:
    """One uniform per draft position of each verify step: (..., k), u[..., i] from
    (seed, key, verify index, i)."""
    k_ = np.asarray(keys, dtype=np.uint64)[..., None]
    i = np.asarray(index, dtype=np.uint64)[..., None]
    s = np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
    pos = np.arange(1, k + 1, dtype=np.uint64)
    z = mix64(mix64(mix64(k_ ^ s) + (i + np.uint64(1)) * _GOLDEN) + pos * _POSITION)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

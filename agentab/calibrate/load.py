"""The calibration load: what is sent, phase by phase.

Each phase isolates one term of the simulator's step-time model (docs/engine.md, "Step-time
model"), so a least-squares fit can separate them:
- a decode phase sends `batch` requests with unique prompts of `context` tokens at once and
  lets them decode `steps` tokens together: once every request has its first token and until
  the first finishes, every step is a pure decode step of `batch` rows, whose time is the
  decode table's value at that batch plus the KV read of the rows' context. Two contexts per
  batch separate the two;
- a prefill phase sends one request at a time (the engine otherwise idle) with `new` unique
  prompt tokens after `cached` tokens that an earlier request left in the prefix cache, and
  times its first token. Varying both separates the per-token cost from the per-token-pair
  (attention) cost;
- a mixed phase starts `rows` decode requests (as a decode phase) and, once they decode
  steadily, sends one request of `new` prompt tokens that fits one step: that step carries the
  prompt beside `rows` decode rows. Its time less what the prefill and decode terms already
  price, over several `rows`, gives the cost per decode row of a mixed step. On a server that
  drafts (k drafts a row) the same phase runs verify rows of 1 + k tokens beside the prompt,
  and gives the cost per verify row of a mixed step instead.
Prompts are random token ids from a seeded generator, so no two phases share a block by chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentab.errors import AgentabError

DEFAULT_BATCHES = (1, 2, 4, 8, 16)
# Steps a mixed phase's rows are sure to run: the client's lead and window before the prompt
# (12 chunks), the prompt's step, and slack for the prompt's way in (a read of /metrics and a
# request: one or two steps on an idle host, several on a busy one; with only the 4 steps that
# --steps 16 left, a loaded host missed the prompt's step in every attempt). A server that
# drafts emits up to 1 + k tokens a step, so its rows ask for (1 + k) x this many tokens; its
# decode phases' (1 + k) x --steps tokens would run several times as many steps, which the
# mixed phase only waits out.
MIXED_STEPS = 24


@dataclass(frozen=True)
class DecodePhase:
    batch: int
    context: int  # prompt tokens per request
    steps: int  # max_tokens per request


@dataclass(frozen=True)
class PrefillPhase:
    new: int  # uncached prompt tokens
    cached: int  # tokens of an earlier prompt this one starts with
    repeat: int  # which repetition of this point (distinct prompts)


@dataclass(frozen=True)
class MixedPhase:
    rows: int  # decode requests running beside the prompt
    context: int  # prompt tokens of each decode request
    new: int  # prompt tokens of the request whose prefill is one step beside them
    steps: int  # max_tokens per decode request
    repeat: int  # which repetition of this point (distinct prompts)


@dataclass(frozen=True)
class CalibrationLoad:
    decode: tuple[DecodePhase, ...]
    prefill: tuple[PrefillPhase, ...]
    seed: int
    mixed: tuple[MixedPhase, ...] = ()

    def describe(self) -> dict[str, object]:
        return {
            "decode": [(p.batch, p.context, p.steps) for p in self.decode],
            "prefill": [(p.new, p.cached) for p in self.prefill if p.repeat == 0],
            "prefill_repeats": 1 + max((p.repeat for p in self.prefill), default=0),
            "mixed": [(p.rows, p.context, p.new) for p in self.mixed if p.repeat == 0],
            "seed": self.seed,
        }


def build_load(
    *,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    contexts: tuple[int, int] | None = None,
    steps: int = 96,
    max_model_len: int,
    block_size: int,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None = None,
    prefill_repeats: int = 3,
    seed: int = 0,
    one_prefill_step: bool = False,
    with_mixed: bool = True,
    mixed_repeats: int | None = None,
    draft_tokens: int = 0,
) -> CalibrationLoad:
    """A load sized to the engine: contexts and prefill lengths fit `max_model_len`, and each
    prefill request fits one step's token budget (so it is one step, as the fit assumes).
    `with_mixed`: add the mixed phases (the clock that times the load can single out a step
    while other requests stream); `mixed_repeats`: their repetitions (default
    `prefill_repeats`); `draft_tokens`: k of a server that drafts, whose decode rows in the
    mixed step are verify rows of 1 + k tokens (the prompt is shortened so that they fit the
    step's budget beside it)."""
    if not batches or any(b < 1 for b in batches) or list(batches) != sorted(set(batches)):
        raise AgentabError(f"--batches {batches}: need increasing batch sizes >= 1")
    if steps < 16:
        raise AgentabError(f"--steps {steps}: need at least 16 decode steps per phase")
    room = max_model_len - steps - 1
    if contexts is None:
        contexts = (min(32 if one_prefill_step else 128, room // 4), min(room, 4096) * 3 // 4)
    lo, hi = contexts
    if not 1 <= lo < hi <= room:
        raise AgentabError(
            f"--contexts {lo},{hi}: need 1 <= short < long <= {room} "
            f"(max_model_len {max_model_len} less {steps + 1} decode tokens)"
        )
    if one_prefill_step:  # every phase's prompts fit one step's budget (see client.py)
        fits = (max_num_batched_tokens or max_model_len) - 1
        if batches[-1] * lo > fits:
            raise AgentabError(
                f"--batches {batches[-1]} x --contexts short {lo} exceeds the step budget {fits}"
            )
        decode = tuple(
            DecodePhase(b, c, steps)
            for b in batches
            for c in sorted({lo, max(lo, min(hi, fits // b))})
        )
    else:
        decode = tuple(DecodePhase(b, c, steps) for b in batches for c in (lo, hi))
    budget = min(max_model_len - 2, max_num_batched_tokens or max_model_len)
    # the shortest prompt sits just past the largest decode batch: prefill steps of a few
    # dozen new tokens (a turn after a prefix hit) are priced near there
    short = max(block_size, 2 * batches[-1])
    news = sorted({short, max(short, budget // 16), budget // 4, budget // 2, budget})
    cached = max(block_size, (min(budget, max_model_len // 2) // block_size) * block_size)
    points = [(n, 0) for n in news]
    # the three shortest again after a cached prefix: an agent's turn is a few hundred to a
    # few thousand new tokens after a long prefix, and the cost of a chunk over a cached
    # context (its pairs and the context term) is measured there, not extrapolated to it
    points += [(n, cached) for n in news[:3] if n + cached <= max_model_len - 2]
    prefill = tuple(PrefillPhase(n, c, r) for r in range(prefill_repeats) for n, c in points)
    # mixed steps: a prompt of the second prefill length beside a quarter, half and all of the
    # largest decode batch, decoding at the short context; the prompt needs a sequence slot of
    # its own, else it waits in the queue until the decode rows end and no mixed step is run
    top = batches[-1] if max_num_seqs is None else min(batches[-1], max_num_seqs - 1)
    rows = sorted({max(1, top // 4), max(1, top // 2), top})
    new = min(news[1], budget - batches[-1] * (1 + draft_tokens))
    repeats = prefill_repeats if mixed_repeats is None else mixed_repeats
    tokens = MIXED_STEPS * (1 + draft_tokens) if draft_tokens else max(steps, MIXED_STEPS)
    tokens = min(tokens, max_model_len - lo - 1)  # the rows' prompts and tokens fit a sequence
    if draft_tokens and (new < 1 or len(rows) < 2):
        # the verify rows leave the prompt no room, or one row count cannot give a slope: the
        # drafter's part runs without them (a verify row of a mixed step is then priced as a
        # decode row there)
        with_mixed = False
    mixed: tuple[MixedPhase, ...] = ()
    if with_mixed:
        mixed = tuple(MixedPhase(b, lo, new, tokens, r) for r in range(repeats) for b in rows)
    return CalibrationLoad(decode, prefill, seed, mixed)


def unique_prompts(rng: np.random.Generator, count: int, length: int, vocab: int) -> np.ndarray:
    """`count` random prompts of `length` ids in [1, vocab) (0 is often a special token)."""
    return rng.integers(1, vocab, size=(count, length), dtype=np.int64)

"""A prompt that names the earlier prompt it extends (PromptPrefix) gives the scheduler exactly
the state it reaches by comparing the prompts itself, while skipping the comparison."""

from __future__ import annotations

import numpy as np
import pytest

from agentab.engine import loops_numba
from agentab.engine.hashing import PrefixHashes, chain_hashes_raw
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.types import PromptPrefix
from agentab.workloads.generator import generate, load_config
from agentab.workloads.tokens import PromptTokens
from tests.engine.kernels import KERNELS


def _jobs(seed: int) -> list:
    """Every request of a small generated workload, with and without a salt, interleaved the
    way a replay interleaves agents (half in turn order, half shuffled)."""
    wl = generate(load_config("agentx-coding"), 3, seed)
    jobs = [(s, r, salt) for s in wl.sessions for r in s.all_requests() for salt in (None, 5)]
    order = np.random.default_rng(seed).permutation(len(jobs))
    order[: len(jobs) // 2].sort()
    return [jobs[i] for i in order]


def _count_comparisons(monkeypatch) -> list[int]:
    calls = [0]
    first_diff = loops_numba.first_diff

    def counted(*args):
        calls[0] += 1
        return first_diff(*args)

    monkeypatch.setattr(loops_numba, "first_diff", counted)
    return calls


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_prompts_built_in_place_give_the_compared_state(block_size) -> None:
    """The in-process target's builder extends each agent's prompt in place (the tail of a
    prompt the engine holds is overwritten by the next one): with `stable_tokens` the engine
    keeps only what stays, so every request's tokens and keys equal those of a scheduler
    that got a private copy of each prompt, block sizes of trace and engine apart or not."""
    jobs = _jobs(3)
    cfg = SchedulerConfig(num_blocks=1 << 20, block_size=block_size)
    told, compared = Scheduler(cfg), Scheduler(cfg)
    builder = PromptTokens(max_entries=8, extend=True)
    pairs = []
    for i, (session, request, salt) in enumerate(jobs):
        built = builder.build(session, request, salt)
        prefix = PromptPrefix(built.key, built.base, built.shared_tokens, built.stable_tokens)
        a = told.add(f"r{i}", built.ids, request.out_tokens or 1, prefix)
        b = compared.add(f"r{i}", built.ids.copy(), request.out_tokens or 1)
        assert a.hashes.tobytes() == b.hashes.tobytes() and a.raw_hash == b.raw_hash
        pairs.append((a, b))
    for a, b in pairs:  # read after every later build: the kept blocks did not change
        assert a.tokens.tobytes() == b.tokens.tobytes()
    assert told.counters == compared.counters


@pytest.mark.parametrize("use_compiled", [True, False])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # plain Python's wrapping uint64 math
def test_told_prefix_gives_the_compared_state(monkeypatch, use_compiled, block_size) -> None:
    """Two schedulers get the same prompts, one with the builder's PromptPrefix and one
    without: every request's tokens, block keys and raw hash, and the prefix memo, are equal
    byte for byte; the told one compares only where no named base is known."""
    jobs = _jobs(3)
    if not use_compiled:  # the kernels as plain Python (slow: a third of the requests)
        jobs = jobs[: len(jobs) // 3]
        for name in KERNELS:
            monkeypatch.setattr(loops_numba, name, getattr(loops_numba, name).py_func)
    calls = _count_comparisons(monkeypatch)
    cfg = SchedulerConfig(num_blocks=1 << 20, block_size=block_size)
    told, compared = Scheduler(cfg), Scheduler(cfg)
    builder = PromptTokens(max_entries=8)
    told_calls = compared_calls = shared = 0
    for i, (session, request, salt) in enumerate(jobs):
        built = builder.build(session, request, salt)
        shared += built.shared_tokens
        prefix = PromptPrefix(built.key, built.base, built.shared_tokens)
        before = calls[0]
        a = told.add(f"r{i}", built.ids, request.out_tokens or 1, prefix)
        told_calls += calls[0] - before
        if built.base is not None:  # its base was added before: no comparison
            assert calls[0] == before
        before = calls[0]
        b = compared.add(f"r{i}", built.ids.copy(), request.out_tokens or 1)
        compared_calls += calls[0] - before
        assert a.tokens.tobytes() == b.tokens.tobytes()
        assert a.hashes.tobytes() == b.hashes.tobytes()
        assert a.raw_hash == b.raw_hash and a.prompt_len == b.prompt_len
        keys, _ = chain_hashes_raw(built.ids, block_size)
        assert a.hashes[: len(keys)].tobytes() == keys.tobytes()
    assert told.counters == compared.counters
    memo_a, memo_b = told._prefix_hashes._memo, compared._prefix_hashes._memo
    assert list(memo_a) == list(memo_b)
    for tag in memo_a:  # the told one keeps the client's int32 prompt, not a copy: same ids
        (tokens_a, known_a), (tokens_b, known_b) = memo_a[tag], memo_b[tag]
        assert np.array_equal(tokens_a, tokens_b) and len(tokens_a) == len(tokens_b)
        n = known_a.valid
        assert n == known_b.valid
        assert known_a.keys[:n].tobytes() == known_b.keys[:n].tobytes()
        assert known_a.raws[:n].tobytes() == known_b.raws[:n].tobytes()
    assert shared > 0
    assert 0 < told_calls < compared_calls


def test_forgotten_or_unknown_base_falls_back_to_comparing() -> None:
    """A base the memo no longer holds (evicted) or never saw is no shortcut: the prompt is
    compared with what the memo has and hashed exactly as without a prefix."""
    rng = np.random.default_rng(1)
    system = rng.integers(1, 32000, size=64)
    memo = PrefixHashes(16, max_entries=2)
    first = PromptPrefix(object())
    memo.hashes(np.concatenate([system, rng.integers(1, 32000, size=40)]), prefix=first)
    for _ in range(3):  # evicts `first` from the by-name index
        memo.hashes(rng.integers(1, 32000, size=50), prefix=PromptPrefix(object()))
    for base in (first.key, object()):
        prompt = np.concatenate([system, rng.integers(1, 32000, size=90)])
        keys, raw = memo.hashes(prompt, prefix=PromptPrefix(object(), base, 64))
        want_keys, want_raw = chain_hashes_raw(prompt, 16)
        assert np.array_equal(keys, want_keys) and np.array_equal(raw, want_raw)


def test_a_claim_longer_than_the_prompt_uses_only_its_full_blocks() -> None:
    """The claim is capped at the prompt's and the base's full blocks."""
    rng = np.random.default_rng(2)
    base_prompt = rng.integers(1, 32000, size=100)
    memo = PrefixHashes(16)
    base = PromptPrefix(object())
    memo.hashes(base_prompt, prefix=base)
    shorter = base_prompt[:40]
    keys, raw = memo.hashes(shorter, prefix=PromptPrefix(object(), base.key, 100))
    want_keys, want_raw = chain_hashes_raw(shorter, 16)
    assert np.array_equal(keys, want_keys) and np.array_equal(raw, want_raw)
    longer = np.concatenate([base_prompt, rng.integers(1, 32000, size=30)])
    keys, raw = memo.hashes(longer, prefix=PromptPrefix(object(), base.key, 100))
    want_keys, want_raw = chain_hashes_raw(longer, 16)
    assert np.array_equal(keys, want_keys) and np.array_equal(raw, want_raw)

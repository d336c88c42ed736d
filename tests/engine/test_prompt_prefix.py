"""A prompt that names the earlier prompt it extends (PromptPrefix) gives the scheduler exactly
the state it reaches by comparing the prompts itself, while skipping the comparison."""

from __future__ import annotations

from typing import Any

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
        a, b = _add_to_both(told, compared, f"r{i}", built, request.out_tokens or 1)
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


def _conversation(rng: np.random.Generator, steps: int, bs: int) -> list[tuple]:
    """Prompts as a replay sends them, each with the claim a client could make: most extend
    the previous prompt, some keep only part of it (the claim may also be shorter than what
    they share), some name an older prompt or none, some start afresh."""
    prompts: list[np.ndarray] = [rng.integers(1, 32000, size=int(rng.integers(1, 12 * bs)))]
    claims: list[tuple[int | None, int]] = [(None, 0)]
    for _ in range(steps - 1):
        kind = rng.choice(["extend", "extend", "extend", "cut", "older", "fresh", "unnamed"])
        base = len(prompts) - 1 if kind != "older" else int(rng.integers(0, len(prompts)))
        old = prompts[base]
        if kind == "fresh":
            prompts.append(rng.integers(1, 32000, size=int(rng.integers(1, 12 * bs))))
            claims.append((None, 0))
            continue
        keep = len(old) if kind in ("extend", "older") else int(rng.integers(0, len(old) + 1))
        new = rng.integers(1, 32000, size=int(rng.integers(0, 4 * bs)))
        prompts.append(np.concatenate([old[:keep], new]))
        shared = keep if rng.integers(4) else int(rng.integers(0, keep + 1))
        claims.append((base if kind != "unnamed" else None, shared))
    return list(zip(prompts, claims, strict=True))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # plain Python's wrapping uint64 math
def test_keys_written_in_place_equal_hashing_every_prompt_whole(
    monkeypatch, compiled, block_size
) -> None:
    """`with_output` gives, for every prompt, the keys and last raw value of hashing the prompt
    and its synthetic output from scratch (and that output), whether it shared a key buffer
    with the prompt it extends or not; the keys of a request that has not finished never
    change; and an agent's next turn after a finished one does write in place."""
    from agentab.engine import hashing_numba
    from agentab.engine.hashing import chain_hashes, synthetic_output_ids
    from agentab.engine.request import Request, RequestStatus

    if not compiled:
        fn = hashing_numba.request_keys.py_func
        monkeypatch.setattr(hashing_numba, "request_keys", fn)
    rng = np.random.default_rng(block_size)
    memo = PrefixHashes(block_size, max_entries=4)
    names = [object() for _ in range(60)]
    held: list[tuple[Request, np.ndarray, bytes]] = []  # unfinished requests and their keys
    in_place = 0
    previous = None
    for i, (prompt, (base, shared)) in enumerate(_conversation(rng, 60, block_size)):
        n_out = int(rng.integers(1, 3 * block_size))
        head = int(rng.integers(0, len(prompt) // block_size + 1)) * block_size
        out = np.empty(len(prompt) - head + n_out, dtype=np.int64)
        owner = Request(f"r{i}", out, len(prompt), n_out)
        claim = PromptPrefix(names[i], None if base is None else names[base], shared)
        keys, raw = memo.with_output(prompt, out, head, 32000, claim, owner)
        whole = np.concatenate([prompt, synthetic_output_ids(prompt, n_out)])
        want_keys, want_raw = chain_hashes(whole, block_size)
        assert keys.tobytes() == want_keys.tobytes() and raw == want_raw
        assert out.tobytes() == whole[head:].tobytes()
        in_place += previous is not None and np.shares_memory(keys, previous)
        previous = keys
        if rng.integers(3):  # most finish before the next prompt; the others stay in flight
            owner.move_to(RequestStatus.FINISHED_ABORTED)
        else:
            held.append((owner, keys, keys.tobytes()))
    for _, keys, at_add in held:
        assert keys.tobytes() == at_add
    assert in_place >= 10


def test_scheduler_keys_of_finished_turns_reused_in_place() -> None:
    """Requests whose previous turn has finished get their keys written after the blocks
    they share with it, in its key buffer: every request's keys still equal those of a
    scheduler that compares each prompt with the last one and copies."""
    jobs = _jobs(5)
    cfg = SchedulerConfig(num_blocks=1 << 20, block_size=16)
    told, compared = Scheduler(cfg), Scheduler(cfg)
    builder = PromptTokens(max_entries=8, extend=True)
    shared_buffers = 0
    last_keys: dict[object, np.ndarray] = {}
    for i, (session, request, salt) in enumerate(jobs):
        built = builder.build(session, request, salt)
        a, b = _add_to_both(told, compared, f"r{i}", built, request.out_tokens or 1)
        assert a.tokens.tobytes() == b.tokens.tobytes()
        if built.base in last_keys:
            shared_buffers += np.shares_memory(a.hashes, last_keys[built.base])
        last_keys[built.key] = a.hashes
        told.abort(f"r{i}")  # finished: its keys may be written over by its next turn
        compared.abort(f"r{i}")
    assert shared_buffers > len(jobs) // 4


def test_a_turn_that_keeps_less_than_an_earlier_one_does_not_write_over_it() -> None:
    """A, then B extending A, then C keeping only part of A's blocks, then D extending A again:
    C may not write over the keys A still has in the buffer B extended, so D gets A's keys."""
    from agentab.engine.hashing import chain_hashes, synthetic_output_ids
    from agentab.engine.request import Request, RequestStatus

    rng = np.random.default_rng(3)
    memo = PrefixHashes(16)
    a = rng.integers(1, 32000, size=16 * 10)
    b = np.concatenate([a, rng.integers(1, 32000, size=16 * 3)])
    c = np.concatenate([a[: 16 * 4], rng.integers(1, 32000, size=16 * 2)])
    d = np.concatenate([a, rng.integers(1, 32000, size=16 * 2)])
    names = [object() for _ in range(4)]
    claims = [(None, 0), (0, len(a)), (1, 16 * 4), (0, len(a))]
    held = []
    for i, (prompt, (base, shared)) in enumerate(zip((a, b, c, d), claims, strict=True)):
        out = np.empty(len(prompt) + 8, dtype=np.int64)
        owner = Request(f"r{i}", out, len(prompt), 8)
        claim = PromptPrefix(names[i], None if base is None else names[base], shared)
        keys, raw = memo.with_output(prompt, out, 0, 32000, claim, owner)
        owner.move_to(RequestStatus.FINISHED_ABORTED)
        want_keys, want_raw = chain_hashes(
            np.concatenate([prompt, synthetic_output_ids(prompt, 8)]), 16
        )
        assert keys.tobytes() == want_keys.tobytes() and raw == want_raw
        held.append(keys)
    assert np.shares_memory(held[0], held[1])  # B extended A in place
    assert not np.shares_memory(held[1], held[2])  # C would have written over A's blocks


def _add_to_both(
    told: Scheduler, compared: Scheduler, rid: str, built: Any, out_tokens: int
) -> tuple[Any, Any]:
    """Add one built prompt to a scheduler told its prefix and to one given a private copy;
    their block keys must be equal."""
    prefix = PromptPrefix(built.key, built.base, built.shared_tokens, built.stable_tokens)
    a = told.add(rid, built.ids, out_tokens, prefix)
    b = compared.add(rid, built.ids.copy(), out_tokens)
    assert a.hashes.tobytes() == b.hashes.tobytes() and a.raw_hash == b.raw_hash
    return a, b

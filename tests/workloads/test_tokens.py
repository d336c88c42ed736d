"""Prompt token content: exact length, prefix identity, no cross-session collisions, salts."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from agentab.workloads import Request, Session
from agentab.workloads.generator import generate, load_config
from agentab.workloads.tokens import prompt_text, prompt_token_ids, salt_digits

MASK = (1 << 64) - 1


def mix(z: int) -> int:
    """splitmix64's finalizer on Python ints: an independent reference for the numpy code."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_ids(session_id: str, hash_ids: list[int], bs: int, n: int, vocab: int) -> list[int]:
    key = int.from_bytes(
        hashlib.blake2b(f"session:{session_id}".encode(), digest_size=8).digest(), "little"
    )
    out = []
    for h in hash_ids:
        seed = mix(mix((h + 0x632BE59BD9B4E019) & MASK) ^ key)
        out += [
            mix((seed + (j + 1) * 0x9E3779B97F4A7C15) & MASK) % (vocab - 1) + 1 for j in range(bs)
        ]
    last = hash_ids[-1] if hash_ids else MASK
    seed = mix(last ^ 0x8CB92BA72F3D8DD7) ^ key
    out += [
        mix(((p + 1) * 0x9E3779B97F4A7C15 + seed) & MASK) % (vocab - 1) + 1
        for p in range(len(out), n)
    ]
    return out


S = Session(id="pin", block_size=4, items=())


def test_matches_the_documented_formula_and_pinned_values() -> None:
    r = Request(t=0, in_tokens=10, out_tokens=1, hash_ids=(1, 2))
    got = prompt_token_ids(S, r)
    assert got.dtype == np.int32
    assert got.tolist() == reference_ids("pin", [1, 2], 4, 10, 32000)
    assert got.tolist() == [10149, 9821, 5756, 16486, 30361, 18507, 14405, 27061, 28364, 25231]
    big = Request(t=0, in_tokens=700, out_tokens=1, hash_ids=tuple(range(5, 15)))
    s64 = Session(id="other", block_size=64, items=())
    assert prompt_token_ids(s64, big, vocab_size=128256).tolist() == reference_ids(
        "other", list(range(5, 15)), 64, 700, 128256
    )


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 63, 64, 65, 1000])
def test_exact_length_and_range(n: int) -> None:
    r = Request(t=0, in_tokens=n, out_tokens=1, hash_ids=tuple(range(1, n // 4 + 1)))
    ids = prompt_token_ids(S, r, vocab_size=50)
    assert len(ids) == n
    assert n == 0 or (ids.min() >= 1 and ids.max() < 50)


def test_identical_hash_prefixes_give_identical_token_prefixes() -> None:
    wl = generate(load_config("agentx-coding"), 2, 3)
    s = wl.sessions[0]
    reqs = list(s.requests())
    a, b = reqs[3], reqs[4]
    assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids
    ta, tb = prompt_token_ids(s, a), prompt_token_ids(s, b)
    full = len(a.hash_ids) * s.block_size
    assert np.array_equal(ta[:full], tb[:full])
    # a subagent of the same session shares the namespace: equal ids, equal blocks
    sub = next(iter(next(s.subagents()).requests()))
    solo = Request(t=0, in_tokens=len(sub.hash_ids) * 64, out_tokens=1, hash_ids=sub.hash_ids)
    assert np.array_equal(prompt_token_ids(s, solo), prompt_token_ids(s, sub)[: solo.in_tokens])


def test_sessions_never_share_blocks_unless_global() -> None:
    r = Request(t=0, in_tokens=64 * 50, out_tokens=1, hash_ids=tuple(range(50)))
    a = prompt_token_ids(Session(id="a", block_size=64, items=()), r).reshape(50, 64)
    b = prompt_token_ids(Session(id="b", block_size=64, items=()), r).reshape(50, 64)
    assert not any(np.array_equal(x, y) for x in a for y in b)
    g1 = Session(id="a", block_size=64, items=(), hash_scope="global")
    g2 = Session(id="b", block_size=64, items=(), hash_scope="global")
    assert np.array_equal(prompt_token_ids(g1, r), prompt_token_ids(g2, r))


def test_salt_changes_only_the_first_ids_and_is_injective() -> None:
    r = Request(t=0, in_tokens=200, out_tokens=1, hash_ids=(1, 2, 3))
    plain = prompt_token_ids(S, r)
    k = len(salt_digits(0, 32000))
    assert k == 5  # 31999**5 > 2**64
    salted = {salt: prompt_token_ids(S, r, salt=salt) for salt in (0, 1, 31999, 2**63, 2**64 - 1)}
    heads = {tuple(v[:k].tolist()) for v in salted.values()}
    assert len(heads) == len(salted)  # two salts never share the first block
    for v in salted.values():
        assert np.array_equal(v[k:], plain[k:])
    assert salt_digits(31999, 32000).tolist() == [1, 2, 1, 1, 1]


def test_prompt_text_keeps_prefixes_and_tags_salts() -> None:
    a = Request(t=0, in_tokens=10, out_tokens=1, hash_ids=(1, 2))
    b = Request(t=0, in_tokens=30, out_tokens=1, hash_ids=(1, 2, 3, 4, 5))
    ta, tb = prompt_text(S, a), prompt_text(S, b)
    assert len(ta.split(" ")) == 10 and len(tb.split(" ")) == 30
    assert tb.split(" ")[:8] == ta.split(" ")[:8]
    assert prompt_text(S, a, salt=7) == "[0000000000000007] " + ta
    assert prompt_text(S, a, salt=8) != prompt_text(S, a, salt=7)


def test_prompt_tokens_reuse_gives_prompt_token_ids_exactly() -> None:
    """PromptTokens (reusing each conversation's previous prompt) equals building from scratch,
    with and without salts, for parents and subagents in an interleaved order."""
    from agentab.workloads.tokens import PromptTokens

    wl = generate(load_config("agentx-coding"), 4, 11)
    jobs = [(s, r, salt) for s in wl.sessions for r in s.all_requests() for salt in (None, 5)]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(jobs))
    order[: len(jobs) // 2].sort()  # half in turn order (the usual case), half shuffled
    builder = PromptTokens(vocab_size=32000, max_entries=4)
    for i in order:
        session, request, salt = jobs[i]
        got = builder.token_ids(session, request, salt)
        want = prompt_token_ids(session, request, salt=salt, vocab_size=32000)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_prompt_tokens_agents_and_shared_first_blocks() -> None:
    """Each agent continues from its own previous prompt; an agent's first prompt may start
    from another agent's that began with the same hash id. Both equal building from scratch,
    whichever entry was reused and however the prompts diverge."""
    from agentab.workloads.tokens import PromptTokens

    s = Session(id="agents", block_size=4, items=())

    def req(agent: str, ids: tuple[int, ...], extra: int) -> Request:
        return Request(
            t=0, in_tokens=4 * len(ids) + extra, out_tokens=1, hash_ids=ids, agent_id=agent
        )

    seq = [
        req("main", (1, 2, 3), 2),
        req("a1", (7, 8), 0),
        req("main", (1, 2, 3, 4), 1),
        req("a2", (7, 8, 9), 3),  # a new agent: starts from a1's prompt (same first id)
        req("a1", (7, 8, 10), 0),
        req("main", (1, 2, 5), 0),  # diverges after two blocks
        req("a2", (7, 8, 9, 11), 2),
        req("a3", (7,), 3),
        req("main", (), 3),
    ]
    builder = PromptTokens(vocab_size=1000, max_entries=2)
    for salt in (None, 9):
        for r in seq:
            got = builder.token_ids(s, r, salt)
            assert np.array_equal(got, prompt_token_ids(s, r, salt=salt, vocab_size=1000))


def test_prompt_tokens_extending_in_place_keeps_every_stable_prefix() -> None:
    """`extend=True` builds each agent's prompt after its previous one in one buffer: every
    prompt still equals building from scratch, and the first `stable_tokens` ids of every
    prompt returned earlier are never changed by later builds (only their tails may be)."""
    from agentab.workloads.tokens import PromptTokens

    wl = generate(load_config("agentx-coding"), 4, 11)
    jobs = [(s, r, salt) for s in wl.sessions for r in s.all_requests() for salt in (None, 5)]
    order = np.random.default_rng(1).permutation(len(jobs))
    order[: len(jobs) // 2].sort()  # half in turn order (the usual case), half shuffled
    builder = PromptTokens(vocab_size=32000, max_entries=4, extend=True)
    kept: list[tuple[np.ndarray, np.ndarray]] = []  # (prompt as returned, its stable ids)
    in_place = 0
    for i in order:
        session, request, salt = jobs[i]
        built = builder.build(session, request, salt)
        want = prompt_token_ids(session, request, salt=salt, vocab_size=32000)
        assert built.ids.dtype == want.dtype and np.array_equal(built.ids, want)
        bs = session.block_size
        assert built.stable_tokens == min(len(request.hash_ids), len(want) // bs) * bs
        in_place += any(np.shares_memory(built.ids, ids) for ids, _ in kept[-8:])
        kept.append((built.ids, want[: built.stable_tokens].copy()))
    for ids, stable in kept:
        assert np.array_equal(ids[: len(stable)], stable)
    assert in_place > len(jobs) // 4  # most turns of the ordered half extend their agent's


@pytest.mark.parametrize("vocab", [3, 50, 32000, 128256])
def test_compiled_fill_equals_the_numpy_code(monkeypatch, vocab: int) -> None:
    """The optional numba kernel and the numpy code give the same ids, bit for bit (without
    numba the kernel runs as plain Python: the comparison holds either way)."""
    from agentab.workloads import tokens_numba

    rng = np.random.default_rng(vocab)
    for bs in (1, 4, 64):
        for _ in range(20):
            n = int(rng.integers(0, 12 * bs))
            ids = tuple(int(x) for x in rng.integers(0, 2**63, size=int(rng.integers(0, 14))))
            ids = (*ids, 2**64 - 2) if rng.integers(2) else ids  # ids up to 64 bits
            session = Session(id=f"s{bs}", block_size=bs, items=())
            r = Request(t=0, in_tokens=n, out_tokens=1, hash_ids=ids)
            got = []
            for on in (False, True):
                monkeypatch.setattr(tokens_numba, "ENABLED", on)
                got.append(prompt_token_ids(session, r, salt=7, vocab_size=vocab))
            assert got[0].dtype == got[1].dtype == np.int32
            assert np.array_equal(got[0], got[1])


def test_prompt_tokens_in_a_narrower_dtype_hold_the_same_ids() -> None:
    """A builder that stores ids as uint16 (the in-process target, for vocabularies that fit)
    gives the values `prompt_token_ids` gives, salted or not, extended in place or not; a
    dtype that cannot hold every id of the vocabulary is refused."""
    from agentab.workloads.tokens import PromptTokens

    wl = generate(load_config("agentx-coding"), 3, 5)
    for vocab in (32000, 1 << 16):
        builder = PromptTokens(vocab_size=vocab, max_entries=4, extend=True, dtype=np.uint16)
        for s in wl.sessions:
            for r in s.all_requests():
                for salt in (None, 3):
                    got = builder.token_ids(s, r, salt)
                    assert got.dtype == np.uint16
                    want = prompt_token_ids(s, r, salt=salt, vocab_size=vocab)
                    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="uint16"):
        PromptTokens(vocab_size=(1 << 16) + 1, dtype=np.uint16)

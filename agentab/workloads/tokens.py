"""Token content of prompts: deterministic, prefix-consistent, built with numpy in milliseconds.

Traces record sizes and block hash ids, not text. Replay must still send prompts whose shared
prefixes are byte-identical (so an engine's prefix cache hits exactly where the recording did)
and whose unshared parts never collide. Each (session scope, hash id) maps to one block of
`block_size` token ids; the prompt's tail after its last full block is filled from (scope, last
id, position); an optional salt overwrites the first ids so two salts never share a block.

Token j of block h: splitmix64(splitmix64(key ^ splitmix64(h + c)) + (j + 1) * golden), reduced to
[1, vocab_size) (id 0 is avoided: many vocabularies reserve it). All of it runs as whole-array
uint64 arithmetic, so a 256k-token prompt costs a few milliseconds and no per-block Python work.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from agentab.workloads import tokens_numba
from agentab.workloads.model import Request, Session

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_BLOCK_C = np.uint64(0x632BE59BD9B4E019)
_TAIL_C = np.uint64(0x8CB92BA72F3D8DD7)  # keeps tail fill apart from block content
_NO_BLOCK = np.uint64(0xFFFFFFFFFFFFFFFF)  # "last id" of a prompt shorter than one block


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (in place; returns it)."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


@lru_cache(maxsize=1 << 16)
def _scope_key(hash_scope: str | None, session_id: str) -> np.uint64:
    """64-bit key of a hash-id namespace: the session (local ids) or one shared global scope."""
    name = f"global:{hash_scope}" if hash_scope is not None else f"session:{session_id}"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def session_key(session: Session) -> np.uint64:
    return _scope_key(session.hash_scope, session.id)


def _reduce(z: np.ndarray, vocab_size: int) -> np.ndarray:
    return (z % np.uint64(vocab_size - 1)).astype(np.int32) + np.int32(1)


def block_token_ids(
    key: np.uint64, hash_ids: np.ndarray, block_size: int, vocab_size: int = 32000
) -> np.ndarray:
    """The (len(hash_ids), block_size) token ids of these blocks in namespace `key`."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    seeds = _mix(_mix(ids + _BLOCK_C) ^ key)
    return _reduce(_mix(seeds[:, None] + _block_positions(block_size)), vocab_size)


@lru_cache(maxsize=64)
def _block_positions(block_size: int) -> np.ndarray:
    """(1, block_size): (j + 1) * golden for the tokens j of a block (read-only, shared)."""
    pos = (np.arange(1, block_size + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    pos.setflags(write=False)
    return pos


def salt_digits(salt: int, vocab_size: int) -> np.ndarray:
    """The salt (mod 2**64) in base vocab_size-1, as ids in [1, vocab_size): injective, so two
    salts differ in at least one of these leading positions."""
    base = vocab_size - 1
    value = salt % (1 << 64)
    digits = []
    span = 1
    while span < (1 << 64):
        digits.append(value % base + 1)
        value //= base
        span *= base
    return np.asarray(digits, dtype=np.int32)


@lru_cache(maxsize=1024)
def _salt_head(salt: int, vocab_size: int) -> np.ndarray:
    """`salt_digits`, computed once per (salt, vocabulary): a replay uses one or a few salts."""
    digits = salt_digits(salt, vocab_size)
    digits.setflags(write=False)
    return digits


_NO_SALT = np.zeros(0, dtype=np.int32)


def _salt_ids(salt: int | None, vocab_size: int) -> np.ndarray:
    """The ids a salt writes over a prompt's first ones (none without a salt)."""
    return _NO_SALT if salt is None else _salt_head(salt, vocab_size)


def prompt_token_ids(
    session: Session, request: Request, *, salt: int | None = None, vocab_size: int = 32000
) -> np.ndarray:
    """Exactly `request.in_tokens` int32 ids in [1, vocab_size).

    Blocks come from (session scope, hash id), so requests sharing leading hash ids share those
    leading tokens, also between a parent and its subagents (one namespace per session tree).
    """
    if vocab_size < 3:
        raise ValueError("vocab_size must be at least 3")
    n = request.in_tokens
    bs = session.block_size
    n_blocks = min(len(request.hash_ids), n // bs)
    out = np.empty(n, dtype=np.int32)
    ids = np.fromiter(request.hash_ids[:n_blocks], dtype=np.uint64, count=n_blocks)
    key = session_key(session)
    _fill_from(
        out, 0, ids, request.hash_ids, n_blocks, bs, key, vocab_size, _salt_ids(salt, vocab_size)
    )
    return out


class PromptTokens:
    """`prompt_token_ids` for a stream of requests, reusing each agent's previous prompt.

    Why: each turn of an agent resends its whole context, which extends its previous turn's,
    so building every prompt from scratch costs O(context) hashing per request, a large share
    of a long in-process simulation. One entry per (scope, block size, salt, vocabulary, agent)
    keeps the last prompt built there and its hash ids; the next prompt copies the blocks of
    the common leading hash ids and computes only the rest, in one vectorised pass over the new
    blocks and the tail. Keying by agent matters: a session's parent and subagents interleave,
    and one entry per session would keep being replaced by the other agent's prompt (3x more
    tokens computed on the generated corpus). An agent's first prompt starts from the last
    prompt that began with the same hash id, if any (subagents of one type share their system
    prompt). The result is exactly `prompt_token_ids(...)`, whatever entry it started from (the
    common prefix is always checked); entries are evicted least recently used first.
    `build` also says which earlier prompt a new one starts with, and for how many tokens,
    so that an in-process engine need not compare the two again (engine.types.PromptPrefix).

    `extend=True` (the in-process target) builds an agent's next prompt in place after the
    previous one, in a buffer with room to grow, when it keeps every block of that prompt
    (an agent's turn resends its context and adds to it): no copy of the context. The ids
    after a prompt's last hash-id block (its tail) may then be overwritten by its agent's
    next prompt; the first `stable_tokens` (its blocks) never are. A caller that keeps a
    prompt beyond the next `build` of its agent reads only those, or copies it.
    `dtype`: the ids' integer type (int32, as `prompt_token_ids`; the in-process target
    takes uint16 where the vocabulary fits, halving the memory each new context touches).
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        max_entries: int = 256,
        *,
        extend: bool = False,
        dtype: type[np.integer] = np.int32,
    ) -> None:
        if vocab_size < 3:
            raise ValueError("vocab_size must be at least 3")
        if np.iinfo(dtype).max < vocab_size - 1:
            raise ValueError(f"{np.dtype(dtype).name} cannot hold every id below {vocab_size}")
        from collections import OrderedDict

        self.vocab_size = vocab_size
        self.dtype = np.dtype(dtype)
        self.max_entries = max_entries
        self.extend = extend
        # chain -> (hash ids of its last prompt's blocks, that prompt, its name, its buffer)
        self._memo: OrderedDict[
            tuple[object, ...], tuple[tuple[int, ...], np.ndarray, object, np.ndarray]
        ] = OrderedDict()
        self._by_first: dict[tuple[object, ...], tuple[object, ...]] = {}

    def token_ids(self, session: Session, request: Request, salt: int | None = None) -> np.ndarray:
        return self.build(session, request, salt).ids

    def build(self, session: Session, request: Request, salt: int | None = None) -> BuiltPrompt:
        """The prompt's ids and which earlier prompt of this builder they start with."""
        n = request.in_tokens
        bs = session.block_size
        key = session_key(session)
        hash_ids = request.hash_ids
        n_blocks = min(len(hash_ids), n // bs)
        ids = hash_ids if n_blocks == len(hash_ids) else hash_ids[:n_blocks]
        tag = (int(key), bs, salt, self.vocab_size)
        chain = (*tag, request.agent_id)
        memo = self._memo
        entry = own = memo.get(chain)
        first = (*tag, ids[0]) if n_blocks else None
        if entry is None and first is not None:
            other = self._by_first.get(first)
            entry = memo.get(other) if other is not None else None
        same = _common_prefix(entry[0], ids) if entry is not None else 0
        if own is not None and self.extend and same == len(own[0]) and n <= len(own[3]):
            buf = own[3]  # the blocks of the agent's previous prompt stay: write after them
            out = buf[:n]
        else:
            buf = np.empty(n + n // 2 if self.extend else n, dtype=self.dtype)
            out = buf[:n] if self.extend else buf
            if same:
                assert entry is not None
                out[: same * bs] = entry[1][: same * bs]
        rest = np.fromiter(ids[same:], dtype=np.uint64, count=n_blocks - same)
        salted = _salt_ids(salt, self.vocab_size)
        _fill_from(out, same, rest, hash_ids, n_blocks, bs, key, self.vocab_size, salted)
        name = object()
        memo[chain] = (ids, out, name, buf)
        memo.move_to_end(chain)
        if len(memo) > self.max_entries:
            memo.popitem(last=False)
        if first is not None:
            if len(self._by_first) > 4 * self.max_entries:
                self._by_first.clear()
            self._by_first[first] = chain
        stable = n_blocks * bs if self.extend else n
        if not same:
            return BuiltPrompt(out, name, None, 0, stable)
        assert entry is not None
        return BuiltPrompt(out, name, entry[2], same * bs, stable)


class BuiltPrompt(NamedTuple):
    """A prompt from `PromptTokens.build`: `ids`, a name for it (`key`, an object compared by
    identity) and, when it was built from an earlier prompt, that prompt's name (`base`) and
    how many leading ids the two share (`shared_tokens`, whole blocks); `stable_tokens`: how
    many leading ids never change (all of them unless the builder extends in place)."""

    ids: np.ndarray
    key: object
    base: object | None
    shared_tokens: int
    stable_tokens: int


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common leading run of two hash-id tuples."""
    n = min(len(a), len(b))
    # the usual case: one extends the other (slice only the longer one: each slice is a copy)
    if (a == b[:n]) if len(a) == n else (a[:n] == b):
        return n
    x = np.fromiter(a[:n], dtype=np.uint64, count=n)
    y = np.fromiter(b[:n], dtype=np.uint64, count=n)
    return int(np.argmax(x != y))


def _fill_from(
    out: np.ndarray,
    lo: int,
    ids: np.ndarray,
    hash_ids: tuple[int, ...],
    n_blocks: int,
    bs: int,
    key: np.uint64,
    vocab_size: int,
    salted: np.ndarray,
) -> None:
    """`out` from block `lo` on: blocks lo..n_blocks-1 (`ids`: their hash ids) and the tail;
    then the salt's ids (`salted`) over the first ones, wherever the fill began.

    Block token j of block h is mix(seed(h) + (j + 1) * golden) and tail token p is
    mix(seed(last id) + (p + 1) * golden): both are one mix of (seed + position term), so the
    new blocks and the tail are filled by one pass over one array (a prompt extends its
    predecessor by a few blocks: the number of numpy calls, not the tokens, is the cost)."""
    n = len(out)
    start = lo * bs
    if tokens_numba.ENABLED:
        last = np.uint64(hash_ids[n_blocks - 1]) if n_blocks else _NO_BLOCK
        tokens_numba.fill_from(out, lo, ids, n_blocks, bs, key, last, vocab_size, salted)
        return
    if start < n:
        z = np.empty(n - start, dtype=np.uint64)
        nb = n_blocks - lo
        if nb:
            seeds = _mix(_mix(ids + _BLOCK_C) ^ key)
            np.add(seeds[:, None], _block_positions(bs), out=z[: nb * bs].reshape(nb, bs))
        tail = n_blocks * bs
        if tail < n:
            last_id = hash_ids[n_blocks - 1] if n_blocks else _NO_BLOCK_INT
            seed = _mix_int(last_id ^ _TAIL_C_INT) ^ int(key)
            t = z[tail - start :]
            np.multiply(np.arange(tail + 1, n + 1, dtype=np.uint64), _GOLDEN, out=t)
            t += np.uint64(seed)
        _mix(z)
        np.remainder(z, np.uint64(vocab_size - 1), out=z)
        out[start:] = z
        out[start:] += 1
    k = min(len(salted), n)
    out[:k] = salted[:k]


_MASK = (1 << 64) - 1
_NO_BLOCK_INT = int(_NO_BLOCK)
_TAIL_C_INT = int(_TAIL_C)


def _mix_int(z: int) -> int:
    """`_mix` of one value as a Python int (one seed per prompt: cheaper than numpy calls)."""
    z &= _MASK
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _word_table() -> np.ndarray:
    consonants = "bcdfghjklmnprstvwz"
    vowels = "aeiou"
    words = [c + v for c in consonants for v in vowels]
    words += [c + v + e for c in consonants for v in vowels for e in consonants]
    return np.asarray(words, dtype=object)


_WORDS = _word_table()


def prompt_text(
    session: Session, request: Request, *, salt: int | None = None, vocab_size: int = 32000
) -> str:
    """The same content as `prompt_token_ids` rendered as words for chat endpoints.

    One short word per token id, so identical token prefixes give identical text prefixes; the
    server's tokenizer decides the exact token count (about one token per word). A salt is
    written as a leading hexadecimal tag, which is distinct for every salt.
    """
    ids = prompt_token_ids(session, request, vocab_size=vocab_size)
    text = " ".join(_WORDS[ids % len(_WORDS)].tolist())
    if salt is not None:
        return f"[{salt % (1 << 64):016x}] {text}"
    return text

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

import numpy as np

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
    pos = (np.arange(1, block_size + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    return _reduce(_mix(seeds[:, None] + pos), vocab_size)


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
    key = session_key(session)
    n_blocks = min(len(request.hash_ids), n // bs)
    out = np.empty(n, dtype=np.int32)
    if n_blocks:
        ids = np.fromiter(request.hash_ids[:n_blocks], dtype=np.uint64, count=n_blocks)
        out[: n_blocks * bs] = block_token_ids(key, ids, bs, vocab_size).reshape(-1)
    _fill_tail(out, n_blocks * bs, request.hash_ids, n_blocks, key, vocab_size)
    if salt is not None and n:
        digits = salt_digits(salt, vocab_size)
        k = min(len(digits), n)
        out[:k] = digits[:k]
    return out


class PromptTokens:
    """`prompt_token_ids` for a stream of requests, reusing the previous prompt's blocks.

    Why: each turn of a session resends its whole context, which extends the previous turn's,
    so building every prompt from scratch costs O(context) hashing per request, a large share
    of a long in-process simulation. One entry per (scope, block size, salt, vocabulary) keeps
    the last prompt built there and its hash ids; the next prompt copies the blocks of the
    common leading hash ids and computes only the rest. The result is exactly
    `prompt_token_ids(...)`; entries are evicted least recently used first.
    """

    def __init__(self, vocab_size: int = 32000, max_entries: int = 256) -> None:
        if vocab_size < 3:
            raise ValueError("vocab_size must be at least 3")
        from collections import OrderedDict

        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._memo: OrderedDict[tuple[object, ...], tuple[tuple[int, ...], np.ndarray]] = (
            OrderedDict()
        )

    def token_ids(self, session: Session, request: Request, salt: int | None = None) -> np.ndarray:
        n = request.in_tokens
        bs = session.block_size
        key = session_key(session)
        n_blocks = min(len(request.hash_ids), n // bs)
        ids = request.hash_ids[:n_blocks]
        tag = (int(key), bs, salt, self.vocab_size)
        entry = self._memo.get(tag)
        same = 0  # leading blocks shared with the remembered prompt
        if entry is not None:
            same = _common_prefix(entry[0], ids)
        if same == 0:
            out = prompt_token_ids(session, request, salt=salt, vocab_size=self.vocab_size)
        else:
            assert entry is not None
            out = np.empty(n, dtype=np.int32)
            out[: same * bs] = entry[1][: same * bs]
            if n_blocks > same:
                rest = np.fromiter(ids[same:], dtype=np.uint64, count=n_blocks - same)
                out[same * bs : n_blocks * bs] = block_token_ids(
                    key, rest, bs, self.vocab_size
                ).reshape(-1)
            _fill_tail(out, n_blocks * bs, request.hash_ids, n_blocks, key, self.vocab_size)
            if salt is not None and n:
                digits = salt_digits(salt, self.vocab_size)
                k = min(len(digits), n)
                out[:k] = digits[:k]
        self._memo[tag] = (ids, out)
        self._memo.move_to_end(tag)
        if len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
        return out


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common leading run of two hash-id tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one extends the other
        return n
    x = np.fromiter(a[:n], dtype=np.uint64, count=n)
    y = np.fromiter(b[:n], dtype=np.uint64, count=n)
    return int(np.argmax(x != y))


def _fill_tail(
    out: np.ndarray,
    start: int,
    hash_ids: tuple[int, ...],
    n_blocks: int,
    key: np.uint64,
    vocab_size: int,
) -> None:
    """The ids after a prompt's last full block: from (scope, last hash id, position)."""
    n = len(out)
    if start < n:
        last = np.uint64(hash_ids[n_blocks - 1]) if n_blocks else _NO_BLOCK
        seed = _mix(np.array([last ^ _TAIL_C], dtype=np.uint64))[0] ^ key
        pos = np.arange(start + 1, n + 1, dtype=np.uint64) * _GOLDEN
        out[start:] = _reduce(_mix(pos + seed), vocab_size)


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

"""Prefix-block hashes and synthetic output tokens, vectorized with numpy.

vLLM's prefix cache keys each full block by a hash chained from the first block, so a block's
key identifies the whole prefix that ends with it. Chaining block by block in Python would cost
16k Python steps for a 256k-token prompt; instead each block's key is a polynomial hash of the
entire prefix, H_j = sum_{l<=j} local_l * Q^(j-l) (mod 2**64), computed for every block at once as
Q^j * cumsum(local_l * Q^-l) (Q odd, so invertible mod 2**64). It identifies the same thing as
the chained hash (two blocks get one key iff their whole prefixes are equal, up to 64-bit
collisions), so hit/miss behaviour is vLLM's.

Generated tokens are hashed too (the next turn of a conversation hits what this turn
generated). The simulator has no model, so its output ids are synthetic: a deterministic function
of the prompt (`synthetic_output_ids`), which a client can reproduce to build a next turn that
continues this one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from agentab.engine import hashing_numba, loops_numba

if TYPE_CHECKING:
    from agentab.engine.request import Request
    from agentab.engine.types import PromptPrefix

_MASK = (1 << 64) - 1
_ZERO = np.uint64(0)
_P = int(loops_numba.HASH_BASE)  # odd base of the within-block polynomial (a Python int: pow())
_TOK_ADD, _TOK_MUL, _GOLDEN = loops_numba.TOK_ADD, loops_numba.TOK_MUL, loops_numba.GOLDEN
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (returns a new array; wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = z ^ (z >> _S30)
        z = z * _M1
        z = z ^ (z >> _S27)
        z = z * _M2
        return z ^ (z >> _S31)


class _Powers:
    """Tables Q^j and Q^-j (mod 2**64) for one block size, grown on demand."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        p = _P
        within = [pow(p, block_size - 1 - i, 1 << 64) for i in range(block_size)]
        self.within = np.array(within, dtype=np.uint64)
        self.q = pow(p, block_size, 1 << 64)
        self.q_inv = pow(self.q, -1, 1 << 64)
        self.fwd = np.ones(0, dtype=np.uint64)
        self.inv = np.ones(0, dtype=np.uint64)
        self.salt = np.zeros(0, dtype=np.uint64)

    def ensure(self, n: int) -> None:
        if len(self.fwd) >= n:
            return
        size = max(n, 2 * len(self.fwd), 1024)
        fwd = [1] * size
        inv = [1] * size
        for j in range(1, size):
            fwd[j] = (fwd[j - 1] * self.q) & _MASK
            inv[j] = (inv[j - 1] * self.q_inv) & _MASK
        self.fwd = np.array(fwd, dtype=np.uint64)
        self.inv = np.array(inv, dtype=np.uint64)
        self.salt = np.arange(1, size + 1, dtype=np.uint64) * _GOLDEN


_POWERS: dict[int, _Powers] = {}


def block_hashes(token_ids: np.ndarray, block_size: int) -> np.ndarray:
    """Nonzero uint64 keys of every full block; key j covers tokens [0, (j+1)*bs)."""
    return chain_hashes(token_ids, block_size)[0]


def chain_hashes(
    token_ids: np.ndarray, block_size: int, first_block: int = 0, prev: int = 0
) -> tuple[np.ndarray, int]:
    """Keys of the full blocks of `token_ids`, which continue a prefix of `first_block` blocks
    whose raw chained value is `prev`; also returns the raw value after the last full block.

    The raw value after j blocks is the polynomial sum_i x_i * P^(n-1-i) over the first n tokens
    (x_i a fixed mixing of token i): it does not depend on the block size.
    """
    keys, raw = chain_hashes_raw(token_ids, block_size, first_block, prev)
    return keys, int(raw[-1]) if len(raw) else prev


def chain_hashes_raw(
    token_ids: np.ndarray, block_size: int, first_block: int = 0, prev: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """`chain_hashes` with the raw chained value after every full block (to resume from any)."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
    pw = _POWERS.get(block_size)
    if pw is None:
        pw = _POWERS[block_size] = _Powers(block_size)
    pw.ensure(first_block + n_full + 1)
    x = _mixed_tokens(token_ids[: n_full * block_size])
    with np.errstate(over="ignore"):
        local = (x.reshape(n_full, block_size) * pw.within).sum(axis=1, dtype=np.uint64)
        raw = np.cumsum(local * pw.inv[:n_full], dtype=np.uint64) * pw.fwd[:n_full]
        if prev:
            raw += np.uint64(prev) * pw.fwd[1 : n_full + 1]
        keys = mix64(raw ^ pw.salt[first_block : first_block + n_full]) | np.uint64(1)
    return keys, raw


class PrefixHashes:
    """Block keys of prompts, reusing the keys of an earlier prompt that starts the same way.

    Why: a multi-turn conversation sends its whole context every turn, each turn extending the
    last, so hashing every prompt from its first token costs O(context) per request, most of a
    long simulation's hashing. Each entry remembers one prompt (its tokens, block keys and raw
    values) under the bytes of its first block; a new prompt with the same first block is
    compared with it, and only the blocks after the common prefix are hashed. A prompt that
    comes with a `PromptPrefix` naming a remembered base skips the comparison too (the client
    says how much it shares); its keys are remembered under its own `key` for the next one.
    The keys are those of `chain_hashes` exactly (the chain is resumed from the raw value where
    the prefixes part), whichever way the shared part was found. Entries are evicted least
    recently used first.

    `with_output` (the simulator's requests) goes further: a request that extends the last
    prompt written into a key buffer (`_Rows`) after that prompt's request finished writes its
    keys into the same buffer, after the blocks it shares, instead of copying them (an agent's
    next turn: the O(context) copy and a fresh allocation a request, not the hashing, were
    most of what remained). Entries say how many leading keys are still theirs (`_Known`).
    """

    def __init__(self, block_size: int, max_entries: int = 256) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self._memo: OrderedDict[bytes, tuple[np.ndarray, _Known]] = OrderedDict()
        self._by_key: OrderedDict[object, _Known] = OrderedDict()

    def hashes(
        self,
        prompt: np.ndarray,
        keep: np.ndarray | None = None,
        prefix: PromptPrefix | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(keys, raw values) of the prompt's full blocks, as `chain_hashes_raw(prompt, bs)`.

        `keep`: an array that starts with the prompt's tokens (its first whole blocks at
        least) and that the caller will not change (the scheduler's own token buffer, or a
        client's prompt); it is remembered instead of a copy, and later prompts are compared
        with the whole blocks it holds.
        `prefix`: the client's statement of what the prompt shares with an earlier one."""
        bs = self.block_size
        n_full = len(prompt) // bs
        if n_full == 0:
            return chain_hashes_raw(prompt, bs)
        tag = prompt[:bs].tobytes()
        same, base = self._shared_blocks(prompt, n_full, tag, prefix)
        keys = np.empty(n_full, dtype=np.uint64)
        raw = np.empty(n_full, dtype=np.uint64)
        prev = _ZERO
        if same:
            assert base is not None
            keys[:same] = base.keys[:same]
            raw[:same] = base.raws[:same]
            prev = raw[same - 1]
        loops_numba.chain_into(prompt, same, n_full, bs, prev, keys[same:], raw[same:])
        self._keep(tag, prompt, keep, prefix, _Known(keys, raw, n_full, None))
        return keys, raw

    def with_output(
        self,
        prompt: np.ndarray,
        out: np.ndarray,
        head: int,
        vocab_size: int,
        prefix: PromptPrefix | None = None,
        owner: Request | None = None,
    ) -> tuple[np.ndarray, int]:
        """The keys of every full block of the prompt followed by its synthetic output, and
        the raw value after the last one: `hashes`' keys, then those of the output's blocks.

        `out` (int64) receives positions head.. of prompt and output: the prompt's ids from
        `head` on, then the output's (`head`: whole blocks the caller keeps as the prompt's
        own array, which must not change afterwards). One compiled call hashes the blocks
        after the known ones, writes the output and hashes its blocks
        (hashing_numba.request_keys); the prompt's keys are remembered as by `hashes`.
        `owner`: the request that holds the keys returned; a later prompt writes its keys
        over the ones after the blocks it shares with this prompt once `owner` has finished
        (without an owner, never)."""
        bs = self.block_size
        n_full = len(prompt) // bs
        total = (head + len(out)) // bs
        same, base, tag = 0, None, b""
        if n_full:
            tag = prompt[:bs].tobytes()
            same, base = self._shared_blocks(prompt, n_full, tag, prefix)
        rows = base.rows if base is not None else None
        if base is not None and rows is not None and rows.writable(base, same, total):
            base.valid = min(base.valid, same)  # its keys after `same` are about to change
            rows.frozen = max(rows.frozen, base.valid)
        else:
            rows = _Rows(total + total // 2)
            if same:
                assert base is not None
                rows.keys[:same] = base.keys[:same]
                rows.raws[:same] = base.raws[:same]
        keys, raws = rows.keys[:total], rows.raws[:total]
        prev = raws[same - 1] if same else _ZERO
        last = hashing_numba.request_keys(prompt, same, prev, out, head, bs, vocab_size, keys, raws)
        if n_full:
            known = _Known(keys, raws, n_full, rows)
            rows.last, rows.owner = known, owner
            self._keep(tag, prompt, prompt[:head] if head else out, prefix, known)
        return keys, int(last)

    def _keep(
        self,
        tag: bytes,
        prompt: np.ndarray,
        keep: np.ndarray | None,
        prefix: PromptPrefix | None,
        known: _Known,
    ) -> None:
        """Remember the prompt's full blocks' keys under its tag (and its name, if told)."""
        n = known.valid * self.block_size
        # the caller's prompt may change after this call; `keep` will not
        tokens = keep[:n] if keep is not None else prompt[:n].copy()
        _remember(self._memo, tag, (tokens, known), self.max_entries)
        if prefix is not None:
            _remember(self._by_key, prefix.key, known, self.max_entries)

    def _shared_blocks(
        self, prompt: np.ndarray, n_full: int, tag: bytes, prefix: PromptPrefix | None
    ) -> tuple[int, _Known | None]:
        """(full blocks whose keys are known, the entry holding them)."""
        if prefix is not None and prefix.base is not None:
            known = self._by_key.get(prefix.base)
            if known is not None:  # the client's word: no comparison
                return min(prefix.shared_tokens // self.block_size, known.valid, n_full), known
        entry = self._memo.get(tag)
        if entry is None:
            return 0, None
        old_tokens, known = entry
        n = min(len(old_tokens) // self.block_size, known.valid, n_full) * self.block_size
        same = int(loops_numba.first_diff(old_tokens, prompt, n)) // self.block_size
        return same, known


class _Known:
    """A remembered prompt's block keys and raw values: the first `valid` are its own.

    `valid` starts at the prompt's full blocks and shrinks when a later prompt that shares
    only part of them writes its keys over the rest (in the same `_Rows`)."""

    __slots__ = ("keys", "raws", "rows", "valid")

    def __init__(self, keys: np.ndarray, raws: np.ndarray, valid: int, rows: _Rows | None):
        self.keys, self.raws, self.valid, self.rows = keys, raws, valid, rows


class _Rows:
    """A buffer of block keys and raw values that a chain of prompts extends in place.

    `last` is the prompt written last and `owner` its request, whose output keys follow that
    prompt's (kept alive while an entry of the memos holds the buffer: 2 * max_entries at
    most); `frozen`: how many leading keys an earlier prompt still reads as its own."""

    __slots__ = ("frozen", "keys", "last", "owner", "raws")

    def __init__(self, room: int) -> None:
        both = np.empty((2, room), dtype=np.uint64)
        self.keys, self.raws = both[0], both[1]
        self.frozen = 0
        self.last: _Known | None = None
        self.owner: Request | None = None

    def writable(self, base: _Known, same: int, total: int) -> bool:
        """Whether a prompt that shares `same` blocks with `base` may write the keys of its
        blocks same..total-1 here: `base` was written last and its request has finished
        (nothing reads the keys after `same` any more), no earlier prompt still reads them,
        and they fit."""
        owner = self.owner
        return (
            self.last is base
            and owner is not None
            and owner.status.is_finished
            and self.frozen <= same
            and total <= len(self.keys)
        )


def _remember(memo: OrderedDict, key: object, value: object, max_entries: int) -> None:
    memo[key] = value
    memo.move_to_end(key)
    if len(memo) > max_entries:
        memo.popitem(last=False)


def _mixed_tokens(token_ids: np.ndarray) -> np.ndarray:
    x = np.asarray(token_ids).astype(np.uint64)
    with np.errstate(over="ignore"):
        x += _TOK_ADD
        x *= _TOK_MUL
    return x


def prompt_seed(prompt_token_ids: np.ndarray, raw_full: int, n_full_tokens: int) -> int:
    """Seed of the synthetic output: the polynomial hash of the whole prompt and its length.

    `raw_full` is chain_hashes' raw value over the prompt's first `n_full_tokens` tokens."""
    tail = _mixed_tokens(prompt_token_ids[n_full_tokens:]).tolist()
    h = raw_full
    for x in tail:
        h = (h * _P + x) & _MASK
    n = len(prompt_token_ids)
    z = mix64(np.array([h ^ ((n * int(_GOLDEN)) & _MASK)], dtype=np.uint64))
    return int(z[0])


def output_ids_from_seed(seed: int, n: int, vocab_size: int = 32000) -> np.ndarray:
    """`n` int64 ids in [1, vocab_size) from a prompt seed (see synthetic_output_ids)."""
    pos = np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN
    with np.errstate(over="ignore"):
        z = mix64(pos + np.uint64(seed))
    return (z % np.uint64(vocab_size - 1)).astype(np.int64) + 1


def synthetic_output_ids(
    prompt_token_ids: np.ndarray, n: int, vocab_size: int = 32000
) -> np.ndarray:
    """The `n` int64 token ids the simulator 'generates' for this prompt, in [1, vocab_size).

    A pure function of the prompt's content (like greedy decoding), so a client that wants its
    next turn to continue this one exactly can append these ids to the prompt.
    """
    prompt = np.asarray(prompt_token_ids)
    n_full = len(prompt) // 16
    _, raw = chain_hashes(prompt, 16)
    return output_ids_from_seed(prompt_seed(prompt, raw, n_full * 16), n, vocab_size)

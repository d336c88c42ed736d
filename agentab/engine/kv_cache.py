"""Paged KV blocks with vLLM's prefix cache, kept in numpy arrays so whole requests move at once.

Semantics (vLLM V1 `BlockPool`): every block has a reference count; a block whose count drops to
zero goes to the tail of one free queue, keeping its hash; allocation takes blocks from the head
of that queue and only then forgets (evicts) their hashes. A hit "touches" blocks: they leave the
free queue. So freed hashed blocks form an LRU list, evicted only when reallocated.

Representation: the free queue is a deque of numpy chunks (one chunk per free call) plus, per
block, the generation number of its latest entry; an entry is live iff the block's count is
still zero and the generation matches. Touching a block therefore needs no queue surgery (its
entry just goes stale), and freeing a request's blocks is one numpy append. The hash -> block map
is a dict that is never deleted from on eviction: a lookup checks the block still holds that hash.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

import numpy as np


class BlockPool:
    """`num_blocks` KV blocks, their reference counts, hashes and the LRU free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.hash = np.zeros(num_blocks, dtype=np.uint64)  # 0 = holds no cached prefix
        self.gen = np.arange(num_blocks, dtype=np.int64)
        self._next_gen = num_blocks
        ids = np.arange(num_blocks, dtype=np.int64)
        self._queue: deque[tuple[np.ndarray, np.ndarray]] = deque([(ids, ids.copy())])
        self._head = 0  # entries of the first chunk already consumed
        self._entries = num_blocks
        self.num_free = num_blocks
        self.cache: dict[int, int] = {}
        self.evictions = 0

    # -- prefix cache ---------------------------------------------------------------------
    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """Block ids of the longest run of leading `hashes` that are cached (stops at a miss)."""
        n = len(hashes)
        if n == 0 or not self.cache:
            return np.zeros(0, dtype=np.int64)
        get = self.cache.get
        found: list[np.ndarray] = []
        start, step = 0, 64
        while start < n:
            chunk = hashes[start : start + step]
            ids = np.fromiter(
                map(get, chunk.tolist(), repeat(-1)), dtype=np.int64, count=len(chunk)
            )
            ok = (ids >= 0) & (self.hash[ids] == chunk)
            if not ok.all():
                found.append(ids[: int(np.argmin(ok))])
                break
            found.append(ids)
            start += step
            step *= 2
        return np.concatenate(found) if len(found) > 1 else found[0]

    def register(self, ids: np.ndarray, hashes: np.ndarray) -> None:
        """Mark full, computed blocks as holding these prefix hashes (cacheable from now on)."""
        if len(ids) == 0:
            return
        self.hash[ids] = hashes
        self.cache.update(zip(hashes.tolist(), ids.tolist(), strict=True))
        if len(self.cache) > 2 * self.num_blocks + 4096:
            held = np.flatnonzero(self.hash)
            self.cache = dict(zip(self.hash[held].tolist(), held.tolist(), strict=True))

    # -- reference counts -----------------------------------------------------------------
    def num_free_among(self, ids: np.ndarray) -> int:
        """How many of these (cached) blocks sit in the free queue (they count as free space)."""
        return int(np.count_nonzero(self.ref[ids] == 0)) if len(ids) else 0

    def touch(self, ids: np.ndarray) -> None:
        """Take a reference on hit blocks (those that were free leave the free queue)."""
        if len(ids) == 0:
            return
        self.num_free -= int(np.count_nonzero(self.ref[ids] == 0))
        self.ref[ids] += 1

    def allocate(self, n: int) -> np.ndarray:
        """Take `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        taken: list[np.ndarray] = []
        need = n
        while need:
            ids, gens = self._queue[0]
            window = max(4 * need, 1024)
            seg = ids[self._head : self._head + window]
            live = (self.ref[seg] == 0) & (self.gen[seg] == gens[self._head : self._head + window])
            pos = np.flatnonzero(live)
            if len(pos) >= need:
                pos = pos[:need]
                consumed = int(pos[-1]) + 1
            else:
                consumed = len(seg)
            taken.append(seg[pos])
            need -= len(pos)
            self._head += consumed
            self._entries -= consumed
            if self._head >= len(ids):
                self._queue.popleft()
                self._head = 0
        out = np.concatenate(taken) if len(taken) > 1 else taken[0]
        held = self.hash[out] != 0
        if held.any():
            self.evictions += int(np.count_nonzero(held))
            self.hash[out] = 0
        self.ref[out] = 1
        self.num_free -= n
        return out

    def free(self, ids: np.ndarray) -> None:
        """Drop one reference on each block, in the given order (callers pass a request's blocks
        tail first, as vLLM does, so its last blocks are evicted first)."""
        if len(ids) == 0:
            return
        self.ref[ids] -= 1
        zero = ids[self.ref[ids] == 0]
        if len(zero) == 0:
            return
        gens = np.arange(self._next_gen, self._next_gen + len(zero), dtype=np.int64)
        self._next_gen += len(zero)
        self.gen[zero] = gens
        self._queue.append((zero.astype(np.int64, copy=True), gens))
        self._entries += len(zero)
        self.num_free += len(zero)
        if self._entries > 2 * self.num_blocks + 4096:
            self._compact()

    def _compact(self) -> None:
        """Drop stale queue entries (amortized: the queue never exceeds ~2x the block count)."""
        ids = np.concatenate(
            [self._queue[0][0][self._head :]] + [c[0] for c in list(self._queue)[1:]]
        )
        gens = np.concatenate(
            [self._queue[0][1][self._head :]] + [c[1] for c in list(self._queue)[1:]]
        )
        live = (self.ref[ids] == 0) & (self.gen[ids] == gens)
        self._queue = deque([(ids[live], gens[live])])
        self._head = 0
        self._entries = int(np.count_nonzero(live))

    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc, as a fraction)."""
        return 1.0 - self.num_free / self.num_blocks

    def free_order(self) -> list[int]:
        """The live free queue from head to tail (for tests and debugging; O(queue))."""
        out: list[int] = []
        first = True
        for ids, gens in self._queue:
            lo = self._head if first else 0
            first = False
            seg, g = ids[lo:], gens[lo:]
            live = (self.ref[seg] == 0) & (self.gen[seg] == g)
            out.extend(seg[live].tolist())
        return out

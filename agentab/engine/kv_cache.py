"""Paged KV blocks with vLLM's prefix cache, kept in numpy arrays so whole requests move at once.

Semantics (vLLM V1 `BlockPool`): every block has a reference count; a block whose count drops to
zero goes to the tail of one free queue, keeping its hash; allocation takes blocks from the head
of that queue and only then forgets (evicts) their hashes. A hit "touches" blocks: they leave the
free queue. So freed hashed blocks form an LRU list, evicted only when reallocated.

Representation: the free queue is a deque of numpy chunks (one chunk per free call) plus, per
block, the generation number of its latest entry; an entry is live iff the block's count is
still zero and the generation matches. Touching a block therefore needs no queue surgery (its
entry just goes stale), and freeing a request's blocks is one numpy append. The hash -> block map
is an open-addressing table in numpy arrays (linear probing), so looking up a 256k-token prompt's
16k block keys is a few vectorized passes, not 16k dict lookups. Entries are never deleted on
eviction: an entry is live only while its block still holds its key, and dead slots are reused
by insertion; the table is rebuilt from the live blocks when a quarter of its slots have been
used (linear probing clusters: a sparse table keeps the longest probe chain, hence the number of
vectorized passes, short).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from agentab.engine import compiled


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
        self.evictions = 0
        self._table_size = 0
        self._reset_table(max(1024, 1 << (8 * num_blocks - 1).bit_length()))

    # -- prefix cache ---------------------------------------------------------------------
    def _reset_table(self, size: int) -> None:
        self._table_size = size
        self._mask = np.uint64(size - 1)
        self._tkey = np.zeros(size, dtype=np.uint64)  # 0 = never used
        self._tblk = np.full(size, -1, dtype=np.int64)
        self._used = 0

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """Block ids of the longest run of leading `hashes` that are cached (stops at a miss)."""
        n = len(hashes)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if compiled.ENABLED:
            keys = np.ascontiguousarray(hashes, dtype=np.uint64)
            out = np.empty(n, dtype=np.int64)
            hit = compiled.lookup_into(keys, out, self._tkey, self._tblk, self.hash, self._mask)
            return out[:hit]
        found = self._find(np.ascontiguousarray(hashes, dtype=np.uint64))
        ok = found >= 0
        if ok.all():
            return found
        return found[: int(np.argmin(ok))]

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Live block holding each key, or -1."""
        res = np.full(len(keys), -1, dtype=np.int64)
        idx = np.arange(len(keys))
        pos = (keys & self._mask).astype(np.int64)
        q = keys
        tkey, tblk, held, mask = self._tkey, self._tblk, self.hash, int(self._mask)
        while len(idx):
            k = tkey[pos]
            b = tblk[pos]
            empty = k == 0
            hit = (k == q) & (held[b] == q) & ~empty
            if hit.any():
                res[idx[hit]] = b[hit]
            go = ~(hit | empty)
            idx, q = idx[go], q[go]
            pos = (pos[go] + 1) & mask
        return res

    def register(self, ids: np.ndarray, hashes: np.ndarray) -> None:
        """Mark full, computed blocks as holding these prefix hashes (cacheable from now on)."""
        if len(ids) == 0:
            return
        self.hash[ids] = hashes
        if self._used + len(ids) > self._table_size // 4:
            self._rebuild(len(ids))
        self._insert(np.asarray(ids, dtype=np.int64), np.asarray(hashes, dtype=np.uint64))

    def _rebuild(self, incoming: int) -> None:
        """Drop dead entries (and grow if live ones alone would fill an eighth of the table)."""
        live = np.flatnonzero(self.hash)
        size = self._table_size
        while (len(live) + incoming) * 8 > size:
            size *= 2
        self._reset_table(size)
        if len(live):
            self._insert(live.astype(np.int64), self.hash[live])

    def _insert(self, ids: np.ndarray, keys: np.ndarray) -> None:
        """Vectorized linear-probing insert; contested slots are resolved by writing and
        reading back (numpy keeps the last write), the losers probe on."""
        if compiled.ENABLED:
            self._used += compiled.insert(ids, keys, self._tkey, self._tblk, self.hash, self._mask)
            return
        tkey, tblk, held, mask = self._tkey, self._tblk, self.hash, int(self._mask)
        pos = (keys & self._mask).astype(np.int64)
        while len(keys):
            k = tkey[pos]
            # a slot is free if never used, dead (its block no longer holds its key), or ours
            free = (k == 0) | (held[tblk[pos]] != k) | (k == keys)
            cp = pos[free]
            tkey[cp] = keys[free]
            tblk[cp] = ids[free]
            won = free & (tblk[pos] == ids)
            self._used += int(np.count_nonzero(won & (k == 0)))
            rest = ~won
            pos = (pos + ~free)[rest] & mask
            ids, keys = ids[rest], keys[rest]

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
        if compiled.ENABLED:
            out = np.empty(n, dtype=np.int64)
            got = 0
            while got < n:
                ids, gens = self._queue[0]
                k, head = compiled.take_live(
                    ids, gens, self._head, self.ref, self.gen, n - got, out, got
                )
                got += k
                self._entries -= head - self._head
                self._head = head
                if head >= len(ids):
                    self._queue.popleft()
                    self._head = 0
            return self._hand_out(out)
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
        return self._hand_out(np.concatenate(taken) if len(taken) > 1 else taken[0])

    def _hand_out(self, out: np.ndarray) -> np.ndarray:
        """Allocated blocks: their cached hashes evicted, one reference each."""
        n = len(out)
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

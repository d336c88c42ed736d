"""Paged KV blocks with vLLM's prefix cache, kept in numpy arrays so whole requests move at once.

Semantics (vLLM V1 `BlockPool`): every block has a reference count; a block whose count drops to
zero goes to the tail of one free queue, keeping its hash; allocation takes blocks from the head
of that queue and only then forgets (evicts) their hashes. A hit "touches" blocks: they leave the
free queue. So freed hashed blocks form an LRU list, evicted only when reallocated.

Representation: the free queue is one buffer of (block, generation) entries, consumed from
its head and appended at its tail, plus, per block, the generation number of its latest entry;
an entry is live iff the block's count is still zero and the generation matches. Touching a
block therefore needs no queue surgery (its entry just goes stale), and freeing a request's
blocks is one append. When the tail reaches the buffer's end the live entries are moved to its
front in order (stale entries are never taken, so when this happens changes nothing else);
the buffer holds 3x the block count, so that costs about one pass per entry appended.

The hash -> block map is an open-addressing table in numpy arrays (linear probing), probed by
one compiled loop (agentab.engine.loops_numba) that stops at a prompt's first miss, not 16k dict
lookups for a 256k-token prompt. A
slot's key and block id sit side by side in one (size, 2) array (`_tkey`, `_tblk` are its
columns): a probe of a table much larger than the CPU caches then costs one cache miss, not
two. Entries are never deleted on
eviction: an entry is live only while its block still holds its key, and dead slots are reused
by insertion; the table is rebuilt from the live blocks when a quarter of its slots have been
used (linear probing clusters: a sparse table keeps the longest probe chain short). A lookup
first checks guesses (the blocks the last row with the same first block held: a new turn of a
conversation finds nearly every block of its context there): a guessed block that holds the
key, and whose key no other block held at the same time (`shared`, marked by the insert), is
the block the probe would find, so the table, whose probes are cache misses, is probed only
for the rest. Each
operation's loop is a kernel in agentab.engine.loops_numba, the one implementation (plain Python
without numba; tests/engine/test_loops_numba.py checks the two give the same pool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentab.engine import loops_numba, pages, transitions_numba

if TYPE_CHECKING:
    from agentab.engine.slots import SlotState

_NO_GUESS = np.zeros(0, dtype=np.int64)  # a lookup without guessed blocks


class BlockPool:
    """`num_blocks` KV blocks, their reference counts, hashes and the LRU free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.hash = np.zeros(num_blocks, dtype=np.uint64)  # 0 = holds no cached prefix
        # 1: another block held this block's key at the same time (loops_numba.insert)
        self.shared = np.zeros(num_blocks, dtype=np.uint8)
        # the cached blocks a row held when it left its slot, by its first block's key: the
        # guesses for the next lookup of a prompt that starts the same (`lookup_free`)
        self._known: dict[int, np.ndarray] = {}
        self._known_ids = 0  # block ids held there, at most num_blocks (as much as `hash`)
        self.gen = np.arange(num_blocks, dtype=np.int64)
        self._next_gen = num_blocks
        size = 3 * num_blocks + 4096
        self._qids = pages.zeros(size, np.int64)  # the free queue's entries: block ids,
        self._qgens = pages.zeros(size, np.int64)  # and the generation of each entry
        self._qids[:num_blocks] = np.arange(num_blocks)
        self._qgens[:num_blocks] = np.arange(num_blocks)
        self._head = 0  # entries before it were consumed
        self._entries = num_blocks  # entries from the head on (live or stale)
        self.num_free = num_blocks
        self.evictions = 0
        self._scratch = np.empty(1024, dtype=np.int64)  # a lookup's hit blocks (`admit_head`)
        self._table_size = 0
        self._tkey: np.ndarray  # the prefix table's two columns (`_reset_table`)
        self._tblk: np.ndarray
        self._reset_table(max(1024, 1 << (8 * num_blocks - 1).bit_length()))

    # -- prefix cache ---------------------------------------------------------------------
    def _reset_table(self, size: int) -> None:
        """An empty table of `size` slots. A rebuild at the same size clears the table in place:
        a new one of that size (64 MB for 373k blocks) would have every page faulted in again
        (~0.03 s on base pages, agentab.engine.pages; 0.15-0.37 s on the huge pages numpy asks
        for), against a few ms to clear pages already mapped."""
        self._used = 0
        if size == self._table_size:
            self._tkey[:] = 0
            self._tblk[:] = -1
            return
        self._table_size = size
        self._mask = np.uint64(size - 1)
        table = pages.zeros((size, 2), np.uint64)
        self._tkey = table[:, 0]  # 0 = never used
        self._tblk = table[:, 1].view(np.int64)
        self._tblk[:] = -1

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """Block ids of the longest run of leading `hashes` that are cached (stops at a miss)."""
        return self.lookup_free(hashes)[0]

    def lookup_free(
        self, hashes: np.ndarray, known: np.ndarray | None = None
    ) -> tuple[np.ndarray, int]:
        """`lookup`, and how many of the hit blocks sit in the free queue (they count as free
        space for an admission: vLLM's rule), read in the same pass over the blocks.

        `known`: a guess of the blocks holding the leading hashes (-1: none); by default the
        blocks the last row whose prompt started with the same block held when it left its
        slot (`free_rows`), e.g. the previous turn of the same conversation. A right guess
        spares probing the table, a wrong one costs only its check, and the result is the
        same (loops_numba.lookup_known)."""
        n = len(hashes)
        if n == 0:
            return np.zeros(0, dtype=np.int64), 0
        keys = np.ascontiguousarray(hashes, dtype=np.uint64)
        out = np.empty(n, dtype=np.int64)
        if known is None:
            known = self._known.get(int(keys[0]))
        if known is not None and len(known):
            hit, free = loops_numba.lookup_known(
                keys, known, out, self._tkey, self._tblk, self.hash, self._mask, self.ref,
                self.shared,
            )  # fmt: skip
        else:
            hit, free = loops_numba.lookup_into(
                keys, out, self._tkey, self._tblk, self.hash, self._mask, self.ref
            )
        return out[:hit], int(free)

    def register(self, ids: np.ndarray, hashes: np.ndarray) -> None:
        """Mark full, computed blocks as holding these prefix hashes (cacheable from now on)."""
        if len(ids) == 0:
            return
        ids = np.asarray(ids, dtype=np.int64)
        hashes = np.asarray(hashes, dtype=np.uint64)
        if self._used + len(ids) > self._table_size // 4:
            self.hash[ids] = hashes  # (the rebuild re-inserts every live block, these too)
            self._rebuild(len(ids))
        self._insert(ids, hashes)

    def register_rows(
        self,
        block_table: np.ndarray,
        hash_table: np.ndarray,
        ncached: np.ndarray,
        slots: np.ndarray,
        full: np.ndarray,
    ) -> None:
        """`register` each row's blocks from ncached[s] up to full[i] (ids from `block_table`,
        keys from `hash_table`, rows `slots`), ncached raised to match: one kernel call for a
        step's rows unless the table must be rebuilt first."""
        room = self._table_size // 4 - self._used
        used = loops_numba.register_full(
            block_table, hash_table, ncached, slots, full,
            self._tkey, self._tblk, self.hash, self._mask, room, self.shared,
        )  # fmt: skip
        if used >= 0:
            self._used += used
            return
        ids, keys = loops_numba.newly_full(block_table, hash_table, ncached, slots, full)
        self.register(ids, keys)

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
        """The blocks' keys held (`hash`), then a linear-probing insert in rounds
        (loops_numba.insert): a slot is free if never used, dead (its block no longer holds its
        key) or holding the same key; of the keys that contest one slot in a round the last
        write stays, the others probe on."""
        self._used += loops_numba.insert(
            ids, keys, self._tkey, self._tblk, self.hash, self._mask, self.shared
        )

    # -- reference counts -----------------------------------------------------------------
    def touch(self, ids: np.ndarray) -> None:
        """Take a reference on hit blocks, which are distinct (those that were free leave the
        free queue)."""
        if len(ids) == 0:
            return
        self.num_free -= int(loops_numba.touch(ids, self.ref))

    def allocate(self, n: int) -> np.ndarray:
        """Take `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        tail = self._head + self._entries
        out = np.empty(n, dtype=np.int64)
        head, evicted = loops_numba.take_blocks(
            self._qids[:tail], self._qgens[:tail], self._head, self.ref, self.gen, self.hash, out
        )
        self._took(head, evicted, n)
        return out

    def allocate_rows(
        self,
        total: int,
        block_table: np.ndarray,
        nblocks: np.ndarray,
        slots: np.ndarray,
        need: np.ndarray,
    ) -> None:
        """`allocate(total)` appended to the rows' block tables: need[i] blocks to row
        slots[i], in order, nblocks raised to match."""
        if total > self.num_free:
            raise RuntimeError(f"allocate({total}) with only {self.num_free} free blocks")
        tail = self._head + self._entries
        head, evicted = loops_numba.take_into_rows(
            self._qids[:tail], self._qgens[:tail], self._head, self.ref, self.gen, self.hash,
            total, block_table, nblocks, slots, need,
        )  # fmt: skip
        self._took(head, evicted, total)

    def _took(self, head: int, evicted: int, n: int) -> None:
        """The queue's head after taking `n` blocks, `evicted` of which held a cached key."""
        self._entries -= head - self._head
        self._head = head
        self.evictions += evicted
        self.num_free -= n

    def free(self, ids: np.ndarray) -> None:
        """Drop one reference on each of these distinct blocks, in the given order (callers pass
        a request's blocks tail first, as vLLM does, so its last blocks are evicted first)."""
        if len(ids) == 0:
            return
        if self._head + self._entries + len(ids) > len(self._qids):
            self._compact()
        tail = self._head + self._entries
        added = int(
            loops_numba.release(
                ids, self.ref, self.gen, self._next_gen, self._qids, self._qgens, tail
            )
        )
        self._next_gen += added
        self._entries += added
        self.num_free += added

    def free_rows(
        self, st: SlotState, slots: np.ndarray, run: np.ndarray = _NO_GUESS
    ) -> tuple[np.ndarray, np.ndarray]:
        """`free` of each row's blocks, tail first, rows in order (one kernel call for a step's
        finishes); the rows then hold no blocks. Their cached blocks are remembered as the
        guesses for a later lookup (`lookup_free`). Returns the rows' (output, verify count)
        read as they leave, a (2, rows) array, and the slots `run` less these, in order (one
        call: transitions_numba.leave_rows)."""
        known = self._known
        for s in slots.tolist():
            n = int(st.ncached[s])
            if n:
                key = int(st.hash_table[s, 0])
                old = known.pop(key, None)
                self._known_ids += n - (0 if old is None else len(old))
                known[key] = st.block_table[s, :n].copy()
                while self._known_ids > self.num_blocks:  # the oldest rows go first
                    self._known_ids -= len(known.pop(next(iter(known))))
        progress = np.empty((2, len(slots)), dtype=np.int64)
        kept = np.empty(len(run), dtype=np.int64)
        args = (
            slots, run, st.output, st.spec_idx, progress, kept, st.block_table, st.nblocks,
            st.ncached, self.ref, self.gen,
        )  # fmt: skip
        added, nk = transitions_numba.leave_rows(
            *args, self._next_gen, self._qids, self._qgens, self._head + self._entries
        )
        if added < 0:  # (room for them all after it: the rows hold at most every block)
            self._compact()
            added, nk = transitions_numba.leave_rows(
                *args, self._next_gen, self._qids, self._qgens, self._head + self._entries
            )
        self._next_gen += added
        self._entries += added
        self.num_free += added
        return progress, kept[:nk]

    def admit_row(
        self,
        st: SlotState,
        slot: int,
        hits: np.ndarray,
        hashes: np.ndarray,
        request: tuple[int, int, int, int, np.uint64],
        fresh: int,
        full: int,
        bs: int,
    ) -> bool:
        """A request admitted into row `slot` in one kernel call: its hit blocks `hits`
        touched, the row written (`hashes`; `request`: tokens known, output so far,
        max_tokens, verify steps so far, key), `fresh` blocks appended and its blocks up to
        `full` registered. False: the prefix table must be rebuilt before they are
        registered, which the caller then does (`register_rows`)."""
        tail = self._head + self._entries
        touched, head, evicted, used = transitions_numba.admit_row(
            slot, hits, hashes, *request, fresh, full, bs,
            st.computed, st.ntokens, st.output, st.maxtok, st.spec_idx, st.keys, st.in_decode,
            st.nblocks, st.ncached, st.nhashed, st.block_table, st.hash_table,
            self._qids[:tail], self._qgens[:tail], self._head, self.num_free,
            self.ref, self.gen, self.hash, self._tkey, self._tblk, self._mask,
            self._table_size // 4 - self._used, self.shared,
        )  # fmt: skip
        return self._admitted(touched, head, evicted, fresh, used)

    def _admitted(self, touched: int, head: int, evicted: int, fresh: int, used: int) -> bool:
        """The pool's own counts after an admission kernel (`admit_row`'s results): the hit
        blocks taken out of the free queue, the `fresh` blocks taken, the table slots used.
        False: nothing was registered, the prefix table must be rebuilt first."""
        self.num_free -= touched
        if head < 0:
            raise RuntimeError(f"allocate({fresh}) with only {self.num_free} free blocks")
        if fresh:
            self._took(head, evicted, fresh)
        if used < 0:
            return False
        self._used += used
        return True

    def admit_head(
        self,
        st: SlotState,
        slot: int,
        hashes: np.ndarray,
        nlook: int,
        budget: int,
        k: int,
        nfull_max: int,
        request: tuple[int, int, int, int, np.uint64],
        bs: int,
    ) -> tuple[int, int, bool]:
        """`lookup_free` of the first `nlook` of a waiting request's `hashes`, its admission
        test and, if it fits, `admit_row` into row `slot` with min(rest of its prompt,
        `budget`) tokens scheduled, in one kernel call (transitions_numba.admit_head).

        Returns (hit blocks, tokens scheduled: -1 when it does not fit, registered: False when
        the prefix table must be rebuilt first, which the caller then does)."""
        if nlook:
            if hashes.dtype != np.uint64 or not hashes.flags.c_contiguous:
                hashes = np.ascontiguousarray(hashes, dtype=np.uint64)
            known = self._known.get(int(hashes[0]), _NO_GUESS)
        else:
            known = _NO_GUESS
        if len(self._scratch) < nlook:
            self._scratch = np.empty(max(nlook, 2 * len(self._scratch)), dtype=np.int64)
        tail = self._head + self._entries
        nhit, n, touched, head, evicted, used, fresh = transitions_numba.admit_head(
            slot, hashes, nlook, known, self._scratch, budget, k, nfull_max, *request, bs,
            st.computed, st.ntokens, st.output, st.maxtok, st.spec_idx, st.keys, st.in_decode,
            st.nblocks, st.ncached, st.nhashed, st.block_table, st.hash_table,
            self._qids[:tail], self._qgens[:tail], self._head, self.num_free,
            self.ref, self.gen, self.hash, self._tkey, self._tblk, self._mask,
            self._table_size // 4 - self._used, self.shared,
        )  # fmt: skip
        if n < 0:
            return nhit, -1, True
        return nhit, n, self._admitted(touched, head, evicted, fresh, used)

    def commit_rows(
        self,
        st: SlotState,
        slots: np.ndarray,
        window: tuple[np.ndarray, np.ndarray, np.ndarray],
        m: int,
        k: int,
        bs: int,
        synthetic: bool,
        log: tuple[np.ndarray, int],
        finished: np.ndarray,
    ) -> tuple[int, int]:
        """The first `m` steps of a window (`window`: its rows' computed tokens before it, the
        cumulative and the emitted tokens per step) applied to rows `slots` in one kernel call
        (transitions_numba.commit_rows): their new blocks, their full blocks registered, their
        progress (`log`: the emission log's counts and first row, -1: none). Returns (tokens
        emitted, how many rows finished: their slots in finished[:n])."""
        computed0, cum, emitted = window
        full = np.empty(len(slots), dtype=np.int64)
        tail = self._head + self._entries
        total, head, evicted, used, out, nfin = transitions_numba.commit_rows(
            slots, computed0, cum, emitted, m, 1 + k, k, bs, synthetic,
            st.computed, st.output, st.ntokens, st.maxtok, st.nblocks, st.ncached, st.nhashed,
            st.block_table, st.hash_table, self._qids[:tail], self._qgens[:tail], self._head,
            self.num_free, self.ref, self.gen, self.hash, self._tkey, self._tblk, self._mask,
            self._table_size // 4 - self._used, self.shared, *log, full, finished,
        )  # fmt: skip
        if head < 0:
            raise RuntimeError(f"allocate({total}) with only {self.num_free} free blocks")
        if total:
            self._took(head, evicted, total)
        if used >= 0:
            self._used += used
        else:  # the table is rebuilt first (`register_rows`'s path)
            ids, keys = loops_numba.newly_full(
                st.block_table, st.hash_table, st.ncached, slots, full
            )
            self.register(ids, keys)
        return out, nfin

    def schedule_rows(
        self,
        st: SlotState,
        run: np.ndarray,
        k: int,
        bs: int,
        budget: int,
        synthetic: bool,
        out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> tuple[int, int] | None:
        """The running rows' share of a step's `budget`, their new blocks and their full blocks
        registered, in one kernel call (transitions_numba.schedule_running; `out`: its sched,
        kept, kept_sched and full arrays, len(run) each). Returns (rows kept, their tokens), or
        None, with nothing changed, when their blocks do not fit (the scheduler preempts)."""
        sched, kept, kept_sched, full = out
        tail = self._head + self._entries
        total, head, evicted, n, used, slots_used = transitions_numba.schedule_running(
            run, k, bs, budget, synthetic, st.computed, st.ntokens, st.in_decode, st.nblocks,
            st.ncached, st.nhashed, st.block_table, st.hash_table, self._qids[:tail],
            self._qgens[:tail], self._head, self.num_free, self.ref, self.gen, self.hash,
            self._tkey, self._tblk, self._mask, self._table_size // 4 - self._used,
            self.shared, sched, kept, kept_sched, full,
        )  # fmt: skip
        if head < 0:
            return None
        if total:
            self._took(head, evicted, total)
        if slots_used >= 0:
            self._used += slots_used
        else:  # the table is rebuilt first (`register_rows`'s path)
            ids, keys = loops_numba.newly_full(
                st.block_table, st.hash_table, st.ncached, kept[:n], full[:n]
            )
            self.register(ids, keys)
        return n, used

    def _compact(self) -> None:
        """Move the live queue entries to the buffer's front, in order (stale ones dropped)."""
        lo, hi = self._head, self._head + self._entries
        kept = int(loops_numba.compact(self._qids, self._qgens, lo, hi, self.ref, self.gen))
        self._head = 0
        self._entries = kept

    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc, as a fraction)."""
        return 1.0 - self.num_free / self.num_blocks

    def free_order(self) -> list[int]:
        """The live free queue from head to tail (for tests and debugging; O(queue))."""
        lo, hi = self._head, self._head + self._entries
        seg, g = self._qids[lo:hi], self._qgens[lo:hi]
        live = (self.ref[seg] == 0) & (self.gen[seg] == g)
        return seg[live].tolist()

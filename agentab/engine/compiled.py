"""Optional compiled kernels (numba) for the simulator's inner loops; numpy does the same without.

Why: a simulated step is a few dozen small array operations, and at AgentX scale their
per-call overhead, not the arithmetic, is most of the time (a prefix-cache lookup probes every
block key of a long prompt in several vectorized passes, when a loop could stop at the first
miss). numba compiles such loops from plain Python to machine code at first use (cached on
disk), without a build step or a compiler on the user's machine, so it is an optional extra
(`pip install agentab[sim]`). Every kernel here has a numpy counterpart at its call site that
gives the same results bit for bit (tests/engine/test_compiled.py compares them, and a
simulation with AGENTAB_NUMBA=0 against one with numba); with numba missing the numpy code
runs.

`ENABLED` says which is used: numba importable and AGENTAB_NUMBA not "0".
"""

from __future__ import annotations

import numpy as np

from agentab import numba_jit
from agentab.numba_jit import jit

ENABLED = numba_jit.ENABLED  # this module's switch: a test may turn off its kernels alone


@jit
def lookup_into(
    keys: np.ndarray,
    out: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    held: np.ndarray,
    mask: np.uint64,
) -> int:
    """Block ids of the longest run of leading `keys` that are cached, written to `out`;
    returns its length. A key is found at the first slot of its probe chain that holds it
    while its block still does; an empty slot ends the chain (a miss)."""
    m = np.int64(mask)
    for i in range(len(keys)):
        q = keys[i]
        pos = np.int64(q & mask)
        found = -1
        while True:
            k = tkey[pos]
            if k == 0:
                break
            b = tblk[pos]
            if k == q and held[b] == q:
                found = b
                break
            pos = (pos + 1) & m
        if found < 0:
            return i
        out[i] = found
    return len(keys)


@jit
def insert(
    ids: np.ndarray,
    keys: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    held: np.ndarray,
    mask: np.uint64,
) -> int:
    """BlockPool._insert's rounds, element by element in the same order (so the table ends
    up the same); returns how many never-used slots were taken."""
    m = np.int64(mask)
    n = len(keys)
    pos = np.empty(n, dtype=np.int64)
    for i in range(n):
        pos[i] = np.int64(keys[i] & mask)
    cur = np.arange(n)
    k_seen = np.empty(n, dtype=np.uint64)
    free = np.empty(n, dtype=np.bool_)
    used = 0
    while n:
        for j in range(n):  # read every slot before any write of this round
            i = cur[j]
            k = tkey[pos[i]]
            k_seen[j] = k
            free[j] = k == 0 or held[tblk[pos[i]]] != k or k == keys[i]
        for j in range(n):  # writes in order: the last write to a slot stays
            if free[j]:
                i = cur[j]
                tkey[pos[i]] = keys[i]
                tblk[pos[i]] = ids[i]
        rest = 0
        for j in range(n):
            i = cur[j]
            if free[j] and tblk[pos[i]] == ids[i]:
                if k_seen[j] == 0:
                    used += 1
                continue
            if not free[j]:
                pos[i] = (pos[i] + 1) & m
            cur[rest] = i
            rest += 1
        n = rest
    return used


@jit
def fill_rows(
    block_table: np.ndarray,
    nblocks: np.ndarray,
    slots: np.ndarray,
    need: np.ndarray,
    ids: np.ndarray,
) -> None:
    """Append need[i] of `ids` (in order) to row slots[i]'s block table (Scheduler._alloc_rows)."""
    at = 0
    for i in range(len(slots)):
        s = slots[i]
        c = nblocks[s]
        for j in range(need[i]):
            block_table[s, c + j] = ids[at]
            at += 1
        nblocks[s] = c + need[i]


@jit
def newly_full(
    block_table: np.ndarray,
    hash_table: np.ndarray,
    ncached: np.ndarray,
    slots: np.ndarray,
    full: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(block ids, keys) of each row's blocks from ncached up to `full`, rows in order, and
    ncached raised to match (Scheduler._register_rows)."""
    total = 0
    for i in range(len(slots)):
        c = full[i] - ncached[slots[i]]
        if c > 0:
            total += c
    ids = np.empty(total, dtype=np.int64)
    keys = np.empty(total, dtype=np.uint64)
    at = 0
    for i in range(len(slots)):
        s = slots[i]
        for j in range(ncached[s], full[i]):
            ids[at] = block_table[s, j]
            keys[at] = hash_table[s, j]
            at += 1
        if full[i] > ncached[s]:
            ncached[s] = full[i]
    return ids, keys


@jit
def take_live(
    ids: np.ndarray,
    gens: np.ndarray,
    head: int,
    ref: np.ndarray,
    gen: np.ndarray,
    need: int,
    out: np.ndarray,
    at: int,
) -> tuple[int, int]:
    """Take up to `need` live entries of one free-queue chunk from `head` into out[at:], in
    order; returns (how many, the new head: just past the last one taken, or the chunk's end)."""
    n = len(ids)
    got = 0
    i = head
    while i < n and got < need:
        b = ids[i]
        if ref[b] == 0 and gen[b] == gens[i]:
            out[at + got] = b
            got += 1
        i += 1
    return got, i

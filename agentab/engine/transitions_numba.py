"""Compiled kernels (numba) for the scheduler's transitions and per-event steps: a waiting
request's lookup, admission test and admission (`admit_head`, `admit_row`), the running rows'
part of a step (`schedule_running`), a window's commit (`commit_rows`) and rows leaving their
slots (`leave_rows`, `release_rows`).

Why: at AgentX scale every request is admitted once and finishes once, and each of these was a
dozen Python-level operations around the block pool's kernels (scalar writes into the slot
arrays, one-element index arrays, several kernel calls with their wrappers): ~30 us an
admission, more than the work itself; a step's and a window's rows went through three or four
kernel calls each, with their result arrays allocated in between. Here each is one call that
composes the pool's kernels (agentab.engine.loops_numba: `lookup_known`, `touch`,
`take_into_rows`, `register_full`, `release`, the rows' loops) in the order the Python called
them, so the blocks, the free queue and the prefix table end up exactly as before. Like every
kernel they run as plain Python without numba; tests/engine compares the two
(test_loops_numba_scheduler.py runs a random stream of requests, steps, windows and aborts both
ways).
"""

from __future__ import annotations

import numpy as np

from agentab import numba_jit
from agentab.engine.loops_numba import (
    lookup_known,
    register_full,
    release,
    running_budget,
    scheduled_rows,
    take_into_rows,
    touch,
    window_blocks,
    window_commit,
)
from agentab.numba_jit import jit

ENABLED = numba_jit.ENABLED  # this module's switch: a test may turn off its kernels alone


@jit
def admit_row(
    slot: int,
    hits: np.ndarray,
    hashes: np.ndarray,
    ntok: int,
    num_output: int,
    max_tokens: int,
    spec_index: int,
    key: np.uint64,
    fresh: int,
    full: int,
    bs: int,
    computed: np.ndarray,
    ntokens: np.ndarray,
    output: np.ndarray,
    maxtok: np.ndarray,
    spec_idx: np.ndarray,
    keys: np.ndarray,
    in_decode: np.ndarray,
    nblocks: np.ndarray,
    ncached: np.ndarray,
    nhashed: np.ndarray,
    block_table: np.ndarray,
    hash_table: np.ndarray,
    qids: np.ndarray,
    qgens: np.ndarray,
    head: int,
    num_free: int,
    ref: np.ndarray,
    gen: np.ndarray,
    held: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    mask: np.uint64,
    room: int,
    shared: np.ndarray,
) -> tuple[int, int, int, int]:
    """A waiting request into row `slot` (Scheduler._admit_one): its prefix hit's blocks
    `hits` referenced, the row's state written, `fresh` blocks taken from the free queue
    (`qids`/`qgens` up to its tail, from `head`) and its blocks up to `full` registered.

    Returns (hit blocks that were free, the queue's new head, blocks evicted, table slots
    used); the slots used are -1 when registering needs a table rebuild first (nothing
    registered then: the caller registers). The head is -1, with only the hits touched, when
    the pool's `num_free` free blocks cannot hold `fresh` more (the admission rule rules it
    out)."""
    one = np.empty(1, dtype=np.int64)
    one[0] = slot
    touched = touch(hits, ref)
    nh = len(hashes)
    for j in range(nh):
        hash_table[slot, j] = hashes[j]
    nhit = len(hits)
    for j in range(nhit):
        block_table[slot, j] = hits[j]
    nblocks[slot] = nhit
    ncached[slot] = nhit
    nhashed[slot] = nh
    computed[slot] = nhit * bs
    ntokens[slot] = ntok
    output[slot] = num_output
    maxtok[slot] = max_tokens
    spec_idx[slot] = spec_index
    keys[slot] = key
    in_decode[slot] = False
    evicted = 0
    if fresh:
        if fresh > num_free - touched:
            return touched, -1, 0, 0
        need = np.empty(1, dtype=np.int64)
        need[0] = fresh
        head, evicted = take_into_rows(
            qids, qgens, head, ref, gen, held, fresh, block_table, nblocks, one, need
        )
    upto = np.empty(1, dtype=np.int64)
    upto[0] = full
    used = register_full(
        block_table, hash_table, ncached, one, upto, tkey, tblk, held, mask, room, shared
    )
    return touched, head, evicted, used


@jit
def admit_head(
    slot: int,
    hashes: np.ndarray,
    nlook: int,
    known: np.ndarray,
    hits: np.ndarray,
    budget: int,
    k: int,
    nfull_max: int,
    ntok: int,
    num_output: int,
    max_tokens: int,
    spec_index: int,
    key: np.uint64,
    bs: int,
    computed: np.ndarray,
    ntokens: np.ndarray,
    output: np.ndarray,
    maxtok: np.ndarray,
    spec_idx: np.ndarray,
    keys: np.ndarray,
    in_decode: np.ndarray,
    nblocks: np.ndarray,
    ncached: np.ndarray,
    nhashed: np.ndarray,
    block_table: np.ndarray,
    hash_table: np.ndarray,
    qids: np.ndarray,
    qgens: np.ndarray,
    head: int,
    num_free: int,
    ref: np.ndarray,
    gen: np.ndarray,
    held: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    mask: np.uint64,
    room: int,
    shared: np.ndarray,
) -> tuple[int, int, int, int, int, int, int]:
    """The waiting head's admission test and, if it passes, its admission into row `slot`
    (Scheduler._admit): the prefix lookup of its first `nlook` keys (`lookup_known` with the
    guesses `known`, written to `hits`), the rule that its whole prompt less the hit fit in the
    free blocks (hit blocks sitting in the free queue counting as taken), then `admit_row` with
    `min(rest of the prompt, budget)` tokens scheduled. The same calls in the same order as the
    Python made them one by one, so the pool ends up the same.

    Returns (hit blocks, tokens scheduled, then `admit_row`'s four results, and the fresh
    blocks taken); tokens scheduled is -1, with nothing changed, when the request does not fit.
    `nfull_max`: at most this many blocks are registered (its known keys; a larger number when
    all of them are, with a synthetic output)."""
    nhit, hits_free = lookup_known(hashes[:nlook], known, hits, tkey, tblk, held, mask, ref, shared)
    whole = (ntok + k + bs - 1) // bs - nhit
    if whole + hits_free > num_free:
        return nhit, -1, 0, 0, 0, 0, 0
    hit_tokens = nhit * bs
    n = min(ntok - hit_tokens, budget)
    fresh = (hit_tokens + n + k + bs - 1) // bs - nhit
    full = min(min(hit_tokens + n, ntok) // bs, nfull_max)
    touched, head, evicted, used = admit_row(
        slot, hits[:nhit], hashes, ntok, num_output, max_tokens, spec_index, key, fresh, full,
        bs, computed, ntokens, output, maxtok, spec_idx, keys, in_decode, nblocks, ncached,
        nhashed, block_table, hash_table, qids, qgens, head, num_free, ref, gen, held, tkey,
        tblk, mask, room, shared,
    )  # fmt: skip
    return nhit, n, touched, head, evicted, used, fresh


@jit
def release_rows(
    slots: np.ndarray,
    block_table: np.ndarray,
    nblocks: np.ndarray,
    ncached: np.ndarray,
    ref: np.ndarray,
    gen: np.ndarray,
    next_gen: int,
    qids: np.ndarray,
    qgens: np.ndarray,
    tail: int,
) -> int:
    """`BlockPool.free` of each row's blocks, tail first, rows in order (Scheduler.finish):
    the blocks whose count drops to zero join the free queue at `tail` with the generations
    from `next_gen` on; the rows then hold none. Returns how many joined, or -1, changing
    nothing, when the queue's buffer has no room for every block the rows hold (the caller
    compacts it first)."""
    total = 0
    for i in range(len(slots)):
        total += nblocks[slots[i]]
    if tail + total > len(qids):
        return -1
    added = 0
    for i in range(len(slots)):
        s = slots[i]
        n = nblocks[s]
        if n:
            ids = block_table[s, :n][::-1]
            added += release(ids, ref, gen, next_gen + added, qids, qgens, tail + added)
        nblocks[s] = 0
        ncached[s] = 0
    return added


@jit
def commit_rows(
    slots: np.ndarray,
    computed0: np.ndarray,
    cum: np.ndarray,
    emitted: np.ndarray,
    m: int,
    q: int,
    k: int,
    bs: int,
    synthetic: bool,
    computed: np.ndarray,
    output: np.ndarray,
    ntokens: np.ndarray,
    maxtok: np.ndarray,
    nblocks: np.ndarray,
    ncached: np.ndarray,
    nhashed: np.ndarray,
    block_table: np.ndarray,
    hash_table: np.ndarray,
    qids: np.ndarray,
    qgens: np.ndarray,
    head: int,
    num_free: int,
    ref: np.ndarray,
    gen: np.ndarray,
    held: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    mask: np.uint64,
    room: int,
    shared: np.ndarray,
    log_counts: np.ndarray,
    log_row: int,
    full: np.ndarray,
    finished: np.ndarray,
) -> tuple[int, int, int, int, int, int]:
    """The first `m` steps of a window applied to its rows (window.commit_window): the
    blocks the rows grew into taken from the free queue (`window_blocks`, `take_into_rows`),
    their full blocks registered (`register_full`; with a sampled output only those whose
    keys are known) and the rows advanced (`window_commit`, which writes each row's emitted
    tokens to its slot's row of the slot-major emission log, `log_counts[slot, log_row + j]`),
    the calls the Python made one by one, in their order.

    Returns (blocks taken, the queue's new head, blocks evicted, table slots used, tokens
    emitted, finished rows in finished[:n]). The head is -1, with nothing changed, when the
    free blocks cannot hold the blocks needed; the slots used are -1 when registering needs a
    table rebuild first: nothing registered then (the caller registers up to `full`, which
    reads nothing the rows' advance writes)."""
    n = len(slots)
    need = np.empty(n, dtype=np.int64)
    total = window_blocks(slots, computed0, cum, m, q, k, bs, nblocks, need, full)
    if total > num_free:
        return total, -1, 0, 0, 0, 0
    evicted = 0
    if total:
        head, evicted = take_into_rows(
            qids, qgens, head, ref, gen, held, total, block_table, nblocks, slots, need
        )
    if not synthetic:
        for i in range(n):
            full[i] = min(full[i], nhashed[slots[i]])
    used = register_full(
        block_table, hash_table, ncached, slots, full, tkey, tblk, held, mask, room, shared
    )
    out, nfin = window_commit(
        slots, computed0, cum, emitted, m, computed, output, ntokens, maxtok, log_counts,
        log_row, finished,
    )  # fmt: skip
    return total, head, evicted, used, out, nfin


@jit
def leave_rows(
    slots: np.ndarray,
    run: np.ndarray,
    output: np.ndarray,
    spec_idx: np.ndarray,
    progress: np.ndarray,
    kept: np.ndarray,
    block_table: np.ndarray,
    nblocks: np.ndarray,
    ncached: np.ndarray,
    ref: np.ndarray,
    gen: np.ndarray,
    next_gen: int,
    qids: np.ndarray,
    qgens: np.ndarray,
    tail: int,
) -> tuple[int, int]:
    """Rows leaving their slots (Scheduler._leave_slots): `release_rows`, then each row's
    output and verify count read into progress[0] and progress[1], and the running slots
    `run` less these written, in order, to `kept`. Returns (`release_rows`'s result, how many
    were kept); nothing is changed when that result is -1 (the caller compacts the queue)."""
    added = release_rows(
        slots, block_table, nblocks, ncached, ref, gen, next_gen, qids, qgens, tail
    )
    if added < 0:
        return -1, 0
    n = len(slots)
    for i in range(n):
        progress[0, i] = output[slots[i]]
        progress[1, i] = spec_idx[slots[i]]
    nk = 0
    for j in range(len(run)):
        r = run[j]
        keep = True
        for i in range(n):
            if slots[i] == r:
                keep = False
                break
        if keep:
            kept[nk] = r
            nk += 1
    return added, nk


@jit
def schedule_running(
    run: np.ndarray,
    k: int,
    bs: int,
    budget: int,
    synthetic: bool,
    computed: np.ndarray,
    ntokens: np.ndarray,
    in_decode: np.ndarray,
    nblocks: np.ndarray,
    ncached: np.ndarray,
    nhashed: np.ndarray,
    block_table: np.ndarray,
    hash_table: np.ndarray,
    qids: np.ndarray,
    qgens: np.ndarray,
    head: int,
    num_free: int,
    ref: np.ndarray,
    gen: np.ndarray,
    held: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    mask: np.uint64,
    room: int,
    shared: np.ndarray,
    sched: np.ndarray,
    kept: np.ndarray,
    kept_sched: np.ndarray,
    full: np.ndarray,
) -> tuple[int, int, int, int, int, int]:
    """The running rows' part of a step (Scheduler.schedule) when their blocks fit: their
    share of the budget (`running_budget`), the blocks they lack taken from the free queue
    (`take_into_rows`), the rows given tokens (`scheduled_rows`: kept[:n], kept_sched[:n])
    and their full blocks registered (`register_full`; with a sampled output only those
    whose keys are known), the calls the Python made one by one, in their order.

    Returns (blocks taken, the queue's new head, blocks evicted, rows kept, their tokens,
    table slots used). The head is -1, with nothing changed but `sched`, when the blocks do
    not fit (the caller's path under pressure); the slots used are -1 when registering needs
    a table rebuild first: nothing registered then (the caller registers up to `full`)."""
    B = len(run)
    need = np.empty(B, dtype=np.int64)
    total = running_budget(run, computed, ntokens, in_decode, nblocks, k, bs, budget, sched, need)
    if total > num_free:
        return total, -1, 0, 0, 0, 0
    evicted = 0
    if total:
        head, evicted = take_into_rows(
            qids, qgens, head, ref, gen, held, total, block_table, nblocks, run, need
        )
    n, used = scheduled_rows(run, sched, computed, ntokens, bs, kept, kept_sched, full)
    slots_used = 0
    if n:
        if not synthetic:
            for i in range(n):
                full[i] = min(full[i], nhashed[kept[i]])
        slots_used = register_full(
            block_table, hash_table, ncached, kept[:n], full[:n], tkey, tblk, held, mask, room,
            shared,
        )  # fmt: skip
    return total, head, evicted, n, used, slots_used

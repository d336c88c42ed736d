"""Compiled kernels (numba) for the simulator's inner loops: the one implementation of each.

Why: a simulated step is a few dozen small array operations, and at AgentX scale their
per-call overhead, not the arithmetic, is most of the time (a prefix-cache lookup probed every
block key of a long prompt in several vectorized passes, when a loop can stop at the first
miss). numba compiles such loops from plain Python to machine code at first use (cached on
disk), without a build step or a compiler on the user's machine, so it is a default
dependency. The scheduler, the block pool and the prefix hashes call these kernels and have no
second implementation: without numba (or with AGENTAB_NUMBA=0) the same functions run as plain
Python, slowly, with the same results (tests/engine/test_loops_numba.py and
test_loops_numba_scheduler.py run both ways and compare; the chained hash is also checked against
hashing.py's numpy formula).

`ENABLED` says whether numba compiles them: numba importable and AGENTAB_NUMBA not "0".
"""

from __future__ import annotations

import numpy as np

from agentab import numba_jit
from agentab.numba_jit import jit, splitmix64

ENABLED = numba_jit.ENABLED  # this module's switch: a test may turn off its kernels alone


@jit
def lookup_into(
    keys: np.ndarray,
    out: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    held: np.ndarray,
    mask: np.uint64,
    ref: np.ndarray,
) -> tuple[int, int]:
    """Block ids of the longest run of leading `keys` that are cached, written to `out`;
    returns (its length, how many of those blocks have no reference: they sit in the free
    queue). A key is found at the first slot of its probe chain that holds it while its block
    still does; an empty slot ends the chain (a miss). The free count is read in the same pass
    (an admission needs both), while each block's line is being fetched anyway."""
    free = 0
    for i in range(len(keys)):
        found = probe(keys[i], tkey, tblk, held, mask)
        if found < 0:
            return i, free
        out[i] = found
        free += int(ref[found] == 0)  # (no branch: a mispredicted one stalls the probes)
    return len(keys), free


@jit
def probe(
    q: np.uint64, tkey: np.ndarray, tblk: np.ndarray, held: np.ndarray, mask: np.uint64
) -> int:
    """The block holding key `q` (-1: none): the first slot of its probe chain that holds it
    while its block still does; an empty slot ends the chain."""
    m = np.int64(mask)
    pos = np.int64(q & mask)
    while True:
        k = tkey[pos]
        if k == 0:
            return -1
        b = tblk[pos]
        if k == q and held[b] == q:
            return b
        pos = (pos + 1) & m


@jit
def insert(
    ids: np.ndarray,
    keys: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    held: np.ndarray,
    mask: np.uint64,
    shared: np.ndarray,
) -> int:
    """Mark blocks `ids` as holding `keys` (`held`), then BlockPool._insert's rounds, element by
    element in the same order (so the table ends up the same); returns how many never-used
    slots were taken.

    `shared` (per block) marks the blocks whose key another block held at the same time: an
    inserted block starts unmarked; a block whose live entry an insert of its key overwrites
    is marked with the inserted one, and so is every other live holder of an inserted key
    found on its probe chain after the rounds, with the inserted one. So an unmarked block
    that holds a key is the one a lookup of that key finds (`lookup_known` relies on it)."""
    m = np.int64(mask)
    n = len(keys)
    for i in range(n):
        held[ids[i]] = keys[i]
        shared[ids[i]] = 0
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
                p = pos[i]
                old = tblk[p]
                if tkey[p] == keys[i] and old != ids[i] and old >= 0 and held[old] == keys[i]:
                    shared[old] = 1  # a live holder of the same key loses its entry
                    shared[ids[i]] = 1
                tkey[p] = keys[i]
                tblk[p] = ids[i]
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
    for i in range(len(keys)):  # other live holders of an inserted key on its chain
        q = keys[i]
        p = np.int64(q & mask)
        while tkey[p] != 0:
            b = tblk[p]
            if tkey[p] == q and b != ids[i] and held[b] == q:
                shared[b] = 1
                shared[ids[i]] = 1
            p = (p + 1) & m
    return used


@jit
def lookup_known(
    keys: np.ndarray,
    known: np.ndarray,
    out: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    held: np.ndarray,
    mask: np.uint64,
    ref: np.ndarray,
    shared: np.ndarray,
) -> tuple[int, int]:
    """`lookup_into`, with a candidate block for each leading key: known[i] (-1: none) is a
    block that may hold keys[i], such as the block at the same position of the prompt this
    one extends.
    A guess that holds the key and is not marked `shared` (see `insert`) is the block the
    table's probe would find, so it is taken without probing the table (a cache miss a key
    in a table much larger than the CPU's caches); any other key is probed as usual. The
    results are `lookup_into`'s exactly."""
    free = 0
    nk = len(known)
    for i in range(len(keys)):
        q = keys[i]
        c = known[i] if i < nk else -1
        if c >= 0 and held[c] == q and shared[c] == 0:
            found = c
        else:
            found = probe(q, tkey, tblk, held, mask)
        if found < 0:
            return i, free
        out[i] = found
        free += int(ref[found] == 0)
    return len(keys), free


@jit
def fill_rows(
    block_table: np.ndarray,
    nblocks: np.ndarray,
    slots: np.ndarray,
    need: np.ndarray,
    ids: np.ndarray,
) -> None:
    """Append need[i] of `ids` (in order) to row slots[i]'s block table (Scheduler.alloc_rows)."""
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
    ncached raised to match (Scheduler.register_rows)."""
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
def take_blocks(
    ids: np.ndarray,
    gens: np.ndarray,
    head: int,
    ref: np.ndarray,
    gen: np.ndarray,
    held: np.ndarray,
    out: np.ndarray,
) -> tuple[int, int]:
    """Take len(out) live entries of the free queue `ids[head:]`, in order, into `out`, each
    with one reference and its cached key evicted (BlockPool.allocate); returns (the new head:
    just past the last one taken, how many held a key). A block has one live entry at most
    (its latest), so taking it during the scan cannot make a later entry of it live."""
    n = len(ids)
    need = len(out)
    got = 0
    evicted = 0
    i = head
    while i < n and got < need:
        b = ids[i]
        if ref[b] == 0 and gen[b] == gens[i]:
            out[got] = b
            got += 1
            ref[b] = 1
            if held[b] != 0:
                evicted += 1
                held[b] = 0
        i += 1
    return i, evicted


@jit
def take_into_rows(
    ids: np.ndarray,
    gens: np.ndarray,
    head: int,
    ref: np.ndarray,
    gen: np.ndarray,
    held: np.ndarray,
    total: int,
    block_table: np.ndarray,
    nblocks: np.ndarray,
    slots: np.ndarray,
    need: np.ndarray,
) -> tuple[int, int]:
    """`take_blocks` of `total` blocks appended to the rows' block tables, need[i] to row
    slots[i] in order (BlockPool.allocate_rows): one call for a step's or a window's rows."""
    out = np.empty(total, dtype=np.int64)
    head, evicted = take_blocks(ids, gens, head, ref, gen, held, out)
    fill_rows(block_table, nblocks, slots, need, out)
    return head, evicted


@jit
def register_full(
    block_table: np.ndarray,
    hash_table: np.ndarray,
    ncached: np.ndarray,
    slots: np.ndarray,
    full: np.ndarray,
    tkey: np.ndarray,
    tblk: np.ndarray,
    held: np.ndarray,
    mask: np.uint64,
    room: int,
    shared: np.ndarray,
) -> int:
    """`newly_full` then `insert` (BlockPool.register_rows): the rows' blocks from ncached up
    to `full` registered; returns the never-used table slots taken, or -1, changing nothing,
    if more than `room` blocks are newly full (the table is rebuilt first then)."""
    total = 0
    for i in range(len(slots)):
        c = full[i] - ncached[slots[i]]
        if c > 0:
            total += c
    if total > room:
        return -1
    if total == 0:
        return 0
    ids, keys = newly_full(block_table, hash_table, ncached, slots, full)
    return insert(ids, keys, tkey, tblk, held, mask, shared)


# -- block hashes and synthetic output (agentab.engine.hashing) ---------------------------------
# The hash's constants, which hashing.py's numpy code uses too: the odd base of the within-block
# polynomial, the token mixing and the per-block salt.
HASH_BASE = np.uint64(0x9FB21C651E98DF25)
TOK_ADD = np.uint64(0x2545F4914F6CDD1D)
TOK_MUL = np.uint64(0xD6E8FEB86659FD93)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@jit
def first_diff(a: np.ndarray, b: np.ndarray, n: int) -> int:
    """Index of the first of the leading `n` positions where a and b differ, or n."""
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@jit
def chain_into(
    tokens: np.ndarray,
    lo: int,
    hi: int,
    bs: int,
    prev: np.uint64,
    keys: np.ndarray,
    raws: np.ndarray,
) -> np.uint64:
    """hashing.chain_hashes_raw over blocks lo..hi-1 of `tokens`, continuing the raw value
    `prev` of the blocks before: keys and raw values written to keys[:hi-lo], raws[:hi-lo];
    returns the raw value after block hi-1 (`prev` if none). The raw value is the Horner sum
    of the mixed tokens, which is what the numpy code's per-block powers compute."""
    r = prev
    for j in range(lo, hi):
        base = j * bs
        for i in range(bs):
            x = (np.uint64(tokens[base + i]) + TOK_ADD) * TOK_MUL
            r = r * HASH_BASE + x
        raws[j - lo] = r
        keys[j - lo] = splitmix64(r ^ (np.uint64(j + 1) * GOLDEN)) | np.uint64(1)
    return r


@jit
def synthetic_output(
    tokens: np.ndarray, prompt_len: int, n_full_tokens: int, raw_full: np.uint64, vocab_size: int
) -> None:
    """Write the synthetic output ids into tokens[prompt_len:] (hashing.prompt_seed of the
    prompt tokens[:prompt_len], then hashing.output_ids_from_seed)."""
    h = raw_full
    for p in range(n_full_tokens, prompt_len):
        h = h * HASH_BASE + (np.uint64(tokens[p]) + TOK_ADD) * TOK_MUL
    seed = splitmix64(h ^ (np.uint64(prompt_len) * GOLDEN))
    m = np.uint64(vocab_size - 1)
    for i in range(len(tokens) - prompt_len):
        z = splitmix64(np.uint64(i + 1) * GOLDEN + seed)
        tokens[prompt_len + i] = np.int64(z % m) + 1


# -- decode windows (Scheduler.plan_window / commit_window) --------------------------------------
@jit
def window_horizon(
    run: np.ndarray,
    in_decode: np.ndarray,
    ntokens: np.ndarray,
    computed: np.ndarray,
    maxtok: np.ndarray,
    output: np.ndarray,
    remaining: np.ndarray,
    computed0: np.ndarray,
) -> int:
    """The smallest remaining output of the running rows if every one is decoding with only
    its last sampled token to compute; 0 if a row is not (no window). Each row's remaining
    output and computed tokens are written to remaining[i] and computed0[i] on the way (the
    window's plan reads both; a gather each in numpy), valid only when the result is > 0."""
    h = np.int64(-1)
    for i in range(len(run)):
        s = run[i]
        if not in_decode[s] or ntokens[s] - computed[s] != 1:
            return 0
        r = maxtok[s] - output[s]
        remaining[i] = r
        computed0[i] = computed[s]
        if h < 0 or r < h:
            h = r
    if h < 0:  # no rows
        return 0
    return int(h)


@jit
def window_steps(
    run: np.ndarray,
    computed: np.ndarray,
    remaining: np.ndarray,
    nblocks: np.ndarray,
    acc: np.ndarray,
    keys: np.ndarray,
    spec_idx: np.ndarray,
    seed: np.uint64,
    cond: np.ndarray,
    whole: int,
    k: int,
    bs: int,
    num_free: int,
    cum: np.ndarray,
    emitted: np.ndarray,
    context: np.ndarray,
) -> int:
    """Plan a window's steps, rows in `run` order (Scheduler.plan_window's arrays): fills
    cum (inclusive cumulative tokens, uncapped), emitted (capped at each row's remaining
    output) and context per step, up to the first step in which a row finishes, or the last
    step whose blocks fit in `num_free`; returns the step count, or -1 if fewer than two steps
    fit. `acc` is empty without drafts (none accepted); with drafts it is the (steps, rows)
    buffer the steps' accepted drafts are written to, each step's row drawn only when the step
    is reached (SpecConfig.accepted's draws: `verify_run` of the slot's key and verify index
    spec_idx + step, under `seed` and `cond`; `whole` >= 0 when the rates decide every draw,
    then every row accepts `whole`). The window's horizon is the smallest remaining output,
    while with drafts it mostly ends several times sooner, so drawing up front would draw
    mostly rows no step reaches."""
    horizon, B = cum.shape
    q = 1 + k
    drafts = acc.shape[0] > 0
    for j in range(horizon):
        grow = 0
        ctx = 0
        for i in range(B):
            s = run[i]
            prev = cum[j - 1, i] if j else 0
            c = computed[s] + prev  # computed before step j
            need = c + q + k  # tokens its blocks must hold after step j
            if need > nblocks[s] * bs:  # (a division only when the row grows: rarely)
                grow += -(-need // bs) - nblocks[s]
            ctx += c + q
        if grow > num_free:
            return j if j >= 2 else -1
        context[j] = ctx
        if drafts:
            for i in range(B):
                if whole >= 0:
                    acc[j, i] = min(whole, k)
                else:
                    s = run[i]
                    acc[j, i] = min(verify_run(keys[s], np.uint64(spec_idx[s] + j), seed, cond), k)
        finish = False
        for i in range(B):
            prev = cum[j - 1, i] if j else 0
            c = prev + 1 + (acc[j, i] if drafts else 0)
            cum[j, i] = c
            rem = remaining[i]
            emitted[j, i] = min(c, rem) - min(prev, rem)
            if c >= rem:
                finish = True
        if finish:
            return j + 1
    return horizon


@jit
def window_verified(
    slots: np.ndarray, spec_idx: np.ndarray, acc: np.ndarray, m: int, per_pos: np.ndarray
) -> int:
    """The verify counters of a window's first `m` steps (each a verify step of every row):
    the rows' verify indices advanced by m, vLLM's per-position counter (a row that accepted
    a drafts counts one at positions 0..a-1) from acc[:m]; returns the drafts accepted."""
    total = 0
    for j in range(m):
        for i in range(len(slots)):
            a = acc[j, i]
            total += a
            for p in range(a):
                per_pos[p] += 1
    for i in range(len(slots)):
        spec_idx[slots[i]] += m
    return total


@jit
def window_blocks(
    slots: np.ndarray,
    computed0: np.ndarray,
    cum: np.ndarray,
    m: int,
    q: int,
    k: int,
    bs: int,
    nblocks: np.ndarray,
    need: np.ndarray,
    full: np.ndarray,
) -> int:
    """For the first `m` steps of a window: the blocks each row still lacks for its last step
    (need) and its blocks full of scheduled tokens (full); returns the total need."""
    total = 0
    for i in range(len(slots)):
        last = computed0[i] + (cum[m - 2, i] if m >= 2 else 0)  # computed before step m-1
        g = -(-(last + q + k) // bs) - nblocks[slots[i]]
        if g < 0:
            g = 0
        need[i] = g
        total += g
        full[i] = (last + 1) // bs
    return total


@jit
def window_commit(
    slots: np.ndarray,
    computed0: np.ndarray,
    cum: np.ndarray,
    emitted: np.ndarray,
    m: int,
    computed: np.ndarray,
    output: np.ndarray,
    ntokens: np.ndarray,
    maxtok: np.ndarray,
    log_counts: np.ndarray,
    log_row: int,
    finished: np.ndarray,
) -> tuple[int, int]:
    """Advance the rows by the first `m` steps of a window (Scheduler.commit_window): their
    computed, output and token counts, and the steps' emitted tokens in the emission log
    (from row `log_row`; log_row < 0: no log). The slots that finished go to finished[:n];
    returns (tokens emitted, n)."""
    total = 0
    nfin = 0
    for i in range(len(slots)):
        s = slots[i]
        computed[s] = computed0[i] + cum[m - 1, i]
        e = 0
        for j in range(m):
            e += emitted[j, i]
            if log_row >= 0:
                log_counts[s, log_row + j] = emitted[j, i]
        output[s] += e
        ntokens[s] += e
        total += e
        if output[s] >= maxtok[s]:
            finished[nfin] = s
            nfin += 1
    return total, nfin


@jit
def release(
    ids: np.ndarray,
    ref: np.ndarray,
    gen: np.ndarray,
    next_gen: int,
    qids: np.ndarray,
    qgens: np.ndarray,
    tail: int,
) -> int:
    """BlockPool.free over distinct blocks (a request's): one reference less on each; those
    whose count drops to zero get the next generations and entries at the queue's tail, in
    the given order. Returns how many."""
    n = len(ids)
    for i in range(n):
        ref[ids[i]] -= 1
    added = 0
    for i in range(n):
        b = ids[i]
        if ref[b] == 0:
            g = next_gen + added
            gen[b] = g
            qids[tail + added] = b
            qgens[tail + added] = g
            added += 1
    return added


@jit
def compact(
    qids: np.ndarray, qgens: np.ndarray, lo: int, hi: int, ref: np.ndarray, gen: np.ndarray
) -> int:
    """Move the live entries of qids/qgens[lo:hi] to the front, in order; returns how many."""
    kept = 0
    for i in range(lo, hi):
        b = qids[i]
        if ref[b] == 0 and gen[b] == qgens[i]:
            qids[kept] = b
            qgens[kept] = qgens[i]
            kept += 1
    return kept


# -- one step (Scheduler.schedule / update) ------------------------------------------------------
@jit
def advance_rows(
    s: np.ndarray,
    num_sched: np.ndarray,
    computed_before: np.ndarray,
    is_decode: np.ndarray,
    drafts: np.ndarray,
    accepted: np.ndarray,
    computed: np.ndarray,
    ntokens: np.ndarray,
    output: np.ndarray,
    maxtok: np.ndarray,
    in_decode: np.ndarray,
    spec_idx: np.ndarray,
    per_pos: np.ndarray,
    log_counts: np.ndarray,
    log_row: int,
    rows: np.ndarray,
    counts: np.ndarray,
    starts: np.ndarray,
    finished: np.ndarray,
) -> tuple[int, int, int, int, int, int]:
    """Apply one executed step to its rows (Scheduler._advance): accepted drafts (`accepted`
    per row, empty: none accepted), computed and emitted tokens, prompts completed, each row's
    emitted tokens in the emission log row `log_row` (< 0: no log), and vLLM's per-position
    counter (`per_pos`: a verify row that accepted a drafts counts one at positions 0..a-1).
    The emitting rows go to rows/counts/starts[:n] (row index, tokens, where they go in its
    token buffer), the slots that finished to finished[:f]. Returns (n, f, tokens emitted,
    verify rows, drafts of the decoding rows, drafts accepted by the verify rows)."""
    n = 0
    nfin = 0
    total = 0
    verified = 0
    draft_sum = 0
    acc_sum = 0
    has_acc = len(accepted) > 0
    for i in range(len(s)):
        slot = s[i]
        comp = computed_before[i] + num_sched[i]
        e = 0
        if is_decode[i]:
            d = drafts[i]
            a = 0
            if has_acc:
                a = min(accepted[i], d)
            comp -= d - a
            e = a + 1
            draft_sum += d
            if d > 0:
                spec_idx[slot] += 1
                verified += 1
                acc_sum += a
                for p in range(a):
                    per_pos[p] += 1
        elif comp >= ntokens[slot]:
            e = 1
            in_decode[slot] = True
        computed[slot] = comp
        e = min(e, maxtok[slot] - output[slot])
        if e != 0:
            if log_row >= 0:
                log_counts[slot, log_row] = e
            rows[n] = i
            counts[n] = e
            starts[n] = ntokens[slot]
            n += 1
        output[slot] += e
        ntokens[slot] += e
        total += e
        if output[slot] >= maxtok[slot]:
            finished[nfin] = slot
            nfin += 1
    return n, nfin, total, verified, draft_sum, acc_sum


@jit
def running_budget(
    run: np.ndarray,
    computed: np.ndarray,
    ntokens: np.ndarray,
    in_decode: np.ndarray,
    nblocks: np.ndarray,
    k: int,
    bs: int,
    budget: int,
    sched: np.ndarray,
    need: np.ndarray,
) -> int:
    """The running rows' share of the token budget, in order (sched: min(remaining, what is
    left), a decoding row's remaining work being 1 + k), and the blocks each scheduled row
    still lacks (need); returns the total need (Scheduler.schedule)."""
    start = 0
    total = 0
    for i in range(len(run)):
        s = run[i]
        c = computed[s]
        rem = ntokens[s] - c + (k if in_decode[s] else 0)
        x = min(max(budget - start, 0), rem)
        start += rem
        sched[i] = x
        g = 0
        if x > 0:
            g = max(-(-(c + x + k) // bs) - nblocks[s], 0)
        need[i] = g
        total += g
    return total


@jit
def scheduled_rows(
    rows: np.ndarray,
    row_sched: np.ndarray,
    computed: np.ndarray,
    ntokens: np.ndarray,
    bs: int,
    out_rows: np.ndarray,
    out_sched: np.ndarray,
    full: np.ndarray,
) -> tuple[int, int]:
    """The rows given tokens, in order, with their tokens and their blocks then full of
    scheduled prompt or output tokens; returns (how many rows, their tokens)."""
    n = 0
    total = 0
    for i in range(len(rows)):
        x = row_sched[i]
        total += x
        if x > 0:
            s = rows[i]
            out_rows[n] = s
            out_sched[n] = x
            full[n] = min(computed[s] + x, ntokens[s]) // bs
            n += 1
    return n, total


@jit
def step_rows(
    rows: np.ndarray,
    row_sched: np.ndarray,
    computed: np.ndarray,
    ntokens: np.ndarray,
    in_decode: np.ndarray,
    keys: np.ndarray,
    spec_idx: np.ndarray,
    comp: np.ndarray,
    is_decode: np.ndarray,
    drafts: np.ndarray,
    row_keys: np.ndarray,
    row_spec: np.ndarray,
) -> tuple[int, bool]:
    """A scheduled step's per-row arrays (StepPlan): computed tokens before it, decoding or
    not, drafts verified (the tokens scheduled past the known ones), request keys and verify
    counters; returns (total tokens, every row decoding)."""
    total = 0
    all_decode = True
    for i in range(len(rows)):
        s = rows[i]
        c = computed[s]
        x = row_sched[i]
        comp[i] = c
        d = in_decode[s]
        is_decode[i] = d
        drafts[i] = max(c + x - ntokens[s], 0) if d else 0
        row_keys[i] = keys[s]
        row_spec[i] = spec_idx[s]
        total += x
        all_decode = all_decode and d
    return total, all_decode


@jit
def touch(ids: np.ndarray, ref: np.ndarray) -> int:
    """One reference more on each of these distinct blocks; returns how many had none."""
    n = 0
    for i in range(len(ids)):
        b = ids[i]
        if ref[b] == 0:
            n += 1
        ref[b] += 1
    return n


@jit
def log_span(
    times: np.ndarray, counts: np.ndarray, lo: int, hi: int, slot: int
) -> tuple[np.ndarray, np.ndarray]:
    """(times[r], counts[slot, r]) of the steps lo <= r < hi in which `slot` emitted
    (EmissionLog.span): one pass along the slot's row instead of a strided copy and two
    gathers."""
    n = 0
    for r in range(lo, hi):
        if counts[slot, r] != 0:
            n += 1
    t = np.empty(n, dtype=times.dtype)
    c = np.empty(n, dtype=counts.dtype)
    at = 0
    for r in range(lo, hi):
        if counts[slot, r] != 0:
            t[at] = times[r]
            c[at] = counts[slot, r]
            at += 1
    return t, c


# -- speculative decoding (SpecConfig.accepted) ---------------------------------------------------
POSITION = np.uint64(0xD6E8FEB86659FD93)  # spec_decode's per-draft-position constant


@jit
def accepted_drafts(
    keys: np.ndarray,
    index: np.ndarray,
    drafts: np.ndarray,
    seed: np.uint64,
    cond: np.ndarray,
    out: np.ndarray,
) -> None:
    """SpecConfig.accepted's synthetic verify loop for verify steps j (flat arrays): the
    leading run of draft positions i whose uniform (spec_decode.position_uniforms of
    (seed, keys[j], index[j], i)) is below cond[i], at most drafts[j], written to out[j].
    The loop stops at the first rejection, where numpy draws every position."""
    for j in range(len(out)):
        out[j] = min(verify_run(keys[j], index[j], seed, cond), drafts[j])


@jit
def verify_run(key: np.uint64, index: np.uint64, seed: np.uint64, cond: np.ndarray) -> int:
    """The leading run of accepted draft positions of one verify step (`accepted_drafts`'s
    loop for one step, before the cap at its drafts)."""
    scale = 1.0 / 9007199254740992.0  # 2**-53
    a = splitmix64(splitmix64(key ^ seed) + (index + np.uint64(1)) * GOLDEN)
    run = 0
    for i in range(len(cond)):
        z = splitmix64(a + np.uint64(i + 1) * POSITION)
        if np.float64(z >> np.uint64(11)) * scale < cond[i]:
            run += 1
        else:
            break
    return run

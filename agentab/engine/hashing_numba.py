"""The compiled kernel of a simulated request's block keys: one call per request.

Why: a request that extends an earlier prompt needs its new blocks hashed, its synthetic
output written and that output's blocks hashed, a few thousand tokens in all; as separate
calls with their own arrays (the prompt's new blocks, then the output and its blocks) the
Python around them, the allocations and the copies of the keys cost several times the
arithmetic. This kernel does all of it in one pass over arrays the caller allocates once. It
computes what hashing.chain_hashes_raw, prompt_seed and output_ids_from_seed define (the same
recurrence as loops_numba.chain_into and synthetic_output), which
tests/engine/test_prompt_prefix.py checks compiled and as plain Python; without numba, or with
AGENTAB_NUMBA=0, it runs as plain Python.
"""

from __future__ import annotations

import numpy as np

from agentab import numba_jit
from agentab.engine.loops_numba import GOLDEN, HASH_BASE, TOK_ADD, TOK_MUL
from agentab.numba_jit import jit, splitmix64

ENABLED = numba_jit.ENABLED


@jit
def request_keys(
    prompt: np.ndarray,
    same: int,
    prev: np.uint64,
    out: np.ndarray,
    head: int,
    bs: int,
    vocab_size: int,
    keys: np.ndarray,
    raws: np.ndarray,
) -> np.uint64:
    """Keys and raw values of every full block of a prompt followed by its synthetic output.

    `out` holds positions head.. of prompt and output (`head` <= the prompt's full blocks):
    the prompt's ids from `head` on are copied into it and the output written after them.
    Blocks before `same` are known (keys[:same], raws[:same]; `prev` is raws[same - 1], or 0);
    blocks same.. are hashed here, into keys and raws (one entry per full block of the
    prompt and output). Returns the raw value after the last full block."""
    p = len(prompt)
    n_full = p // bs
    for i in range(head, p):
        out[i - head] = prompt[i]
    r = prev
    for j in range(same, n_full):  # the prompt's new blocks, read from the client's array
        base = j * bs
        for i in range(bs):
            r = r * HASH_BASE + (np.uint64(prompt[base + i]) + TOK_ADD) * TOK_MUL
        raws[j] = r
        keys[j] = splitmix64(r ^ (np.uint64(j + 1) * GOLDEN)) | np.uint64(1)
    h = r  # the output's seed: the hash of the whole prompt and its length
    for q in range(n_full * bs, p):
        h = h * HASH_BASE + (np.uint64(out[q - head]) + TOK_ADD) * TOK_MUL
    seed = splitmix64(h ^ (np.uint64(p) * GOLDEN))
    m = np.uint64(vocab_size - 1)
    for i in range(head + len(out) - p):
        z = splitmix64(np.uint64(i + 1) * GOLDEN + seed)
        out[p - head + i] = np.int64(z % m) + 1
    for j in range(n_full, (head + len(out)) // bs):  # the blocks after the prompt's full ones
        base = j * bs - head
        for i in range(bs):
            r = r * HASH_BASE + (np.uint64(out[base + i]) + TOK_ADD) * TOK_MUL
        raws[j] = r
        keys[j] = splitmix64(r ^ (np.uint64(j + 1) * GOLDEN)) | np.uint64(1)
    return r

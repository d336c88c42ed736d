"""The numba kernel of prompt token content: one call per prompt.

Why: a replayed prompt extends its agent's previous one by a few blocks, so building it costs a
few dozen numpy calls on small arrays (block seeds, the mix, the reduction, the tail), ~25 us a
request, not the arithmetic. One numba-compiled loop does it in a couple of microseconds, as the
simulator's kernels do (agentab.engine.loops_numba); without numba, or with AGENTAB_NUMBA=0,
`tokens._fill_from`, the numpy code it stands in for, runs instead; the two give the same ids
bit for bit (tests/workloads/test_tokens.py compares them).

`ENABLED` says which is used: numba importable and AGENTAB_NUMBA not "0".
"""

from __future__ import annotations

import numpy as np

from agentab import numba_jit
from agentab.numba_jit import jit, splitmix64

ENABLED = numba_jit.ENABLED  # this module's switch: a test may turn off its kernels alone


@jit
def fill_from(
    out: np.ndarray,
    lo: int,
    ids: np.ndarray,
    n_blocks: int,
    bs: int,
    key: np.uint64,
    last: np.uint64,
    vocab_size: int,
    salted: np.ndarray,
) -> None:
    """`tokens._fill_from`: blocks lo..n_blocks-1 (hash ids `ids`) and the tail after them,
    then the salt's ids `salted` over the first ones; `last` is the last full block's hash
    id (or tokens._NO_BLOCK when there is none)."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    m = np.uint64(vocab_size - 1)
    for b in range(n_blocks - lo):
        seed = splitmix64(splitmix64(ids[b] + np.uint64(0x632BE59BD9B4E019)) ^ key)
        base = (lo + b) * bs
        for j in range(bs):
            out[base + j] = np.int32(splitmix64(seed + np.uint64(j + 1) * golden) % m) + 1
    seed = splitmix64(last ^ np.uint64(0x8CB92BA72F3D8DD7)) ^ key
    for p in range(n_blocks * bs, len(out)):
        out[p] = np.int32(splitmix64(seed + np.uint64(p + 1) * golden) % m) + 1
    for i in range(min(len(salted), len(out))):
        out[i] = salted[i]

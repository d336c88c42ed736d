"""The per-row sums a step's price needs, in one compiled pass (`SimExecutor.step_seconds`).

Why: pricing a scheduled step read its rows through about a dozen small numpy calls (masks of
the decoding and prefilling rows, their context, the prefill pairs, the draft counts), each a
microsecond or two at 64 rows, once per scheduled step; one pass over the rows gives them all.
The sums are integers, and the price uses them exactly where the numpy code summed the same
integers in float64 (exact below 2**53), so the prices are the same to the bit. Like every
kernel it runs as plain Python without numba; tests/engine/test_paths_and_costs.py compares
the compiled pass, its Python function and the numpy sums.
"""

from __future__ import annotations

import numpy as np

from agentab import numba_jit
from agentab.numba_jit import jit

ENABLED = numba_jit.ENABLED  # this module's switch: a test may turn off its kernels alone


@jit
def step_sums(
    num_sched: np.ndarray, computed_before: np.ndarray, is_decode: np.ndarray, drafts: np.ndarray
) -> tuple[int, int, int, int, int, int, int, int]:
    """(decoding rows, their context tokens (computed before + scheduled), rows with drafts,
    the verify rows' drafts x context, prefill tokens, prefill pairs (sum of n * c0 +
    n * (n + 1) / 2), prefill rows' computed-before tokens, prefilling rows) of a step."""
    dec_rows = 0
    ctx = 0
    drafted = 0
    verify = 0
    pre_tokens = 0
    pairs = 0
    pre_c0 = 0
    pre_rows = 0
    for i in range(len(num_sched)):
        n = num_sched[i]
        c0 = computed_before[i]
        d = drafts[i]
        if d != 0:
            drafted += 1
        if is_decode[i]:
            dec_rows += 1
            ctx += c0 + n
            if d > 0:
                verify += d * (c0 + n)
        else:
            pre_rows += 1
            pre_tokens += n
            pairs += n * c0 + n * (n + 1) // 2
            pre_c0 += c0
    return dec_rows, ctx, drafted, verify, pre_tokens, pairs, pre_c0, pre_rows

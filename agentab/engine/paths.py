"""Which decode path runs a step (vLLM's Kimi K3 `latency_specialized` rules, 0.33 source).

With `decode_backend = "latency_specialized"`, the specialized path serves a step only if every
row has the same query length q = 1 + k (pure decode when k = 0, a uniform verify of all k drafts
otherwise), the padded token count is at most 64 and the number of requests is within the per-q
limit. Every other step (prefill, mixed, partial drafts, larger batches) runs the standard
forward. With `auto` every step runs standard. The backends themselves are
`agentab.engine.options.DecodeBackend`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def padded_tokens(tokens: int, graph_max: int) -> int:
    """CUDA-graph padding as vLLM captures by default: 1, 2, 4, then multiples of 8."""
    if tokens <= 0:
        return 0
    if tokens > graph_max:
        return tokens
    if tokens <= 2:
        return tokens
    if tokens <= 4:
        return 4
    return -(-tokens // 8) * 8


def graph_size(tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending: token counts graphs were captured at, such as the
    local engine's piecewise prefill graphs) that holds a step of `tokens` tokens; None past
    the largest (such a step runs eagerly)."""
    i = bisect.bisect_left(sizes, tokens)
    return sizes[i] if i < len(sizes) else None


def graph_padding(tokens: int, sizes: Sequence[int]) -> int:
    """Tokens a step of `tokens` tokens is padded by to run in graphs captured at `sizes`
    (`graph_size`); 0 for a step past the largest, an empty step, or without sizes."""
    size = graph_size(tokens, sizes) if tokens > 0 else None
    return 0 if size is None else size - tokens


def specialized_ok(
    q: np.ndarray,
    num_draft_tokens: int,
    max_padded: int,
    max_requests_by_q: tuple[int, ...],
    graph_max: int,
) -> bool:
    """True if a step with these per-row query lengths may run the specialized path."""
    n = len(q)
    if n == 0:
        return False
    want = 1 + num_draft_tokens
    if want > len(max_requests_by_q):
        return False
    if int(q.min()) != want or int(q.max()) != want:
        return False
    if n > max_requests_by_q[want - 1]:
        return False
    return padded_tokens(n * want, graph_max) <= max_padded

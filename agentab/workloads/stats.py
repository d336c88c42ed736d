"""`inspect`'s figures: what a workload looks like, with exact, documented definitions.

- Distributions (`input_tokens`, `output_tokens`, `turns_per_session`, `pause_s`) give `mean`,
  `p50`, `p90`, `p99` (linear interpolation between order statistics, numpy's default) and `max`;
  all null when there is no value.
- `turns_per_session`: parent requests per session (subagent requests not counted).
- `pause_s`: end-to-start idle gaps between consecutive requests of the same agent (the parent's
  own list, each subagent's own list): `max(0, t_k - t_{k-1} - api_time_{k-1})`, `api_time`
  counted as 0 when not recorded (docs/replay.md: AgentX's inter-turn delay).
- `theoretical_cache_hit_ratio`: for each request in start-time order (ties in recorded tree
  order, depth first), the number of its leading hash ids already seen in earlier requests of the
  same id namespace, times `block_size`, summed over requests and divided by the summed `in`.
  A namespace is one session tree (AgentX's `hash_id_scope: "local"`), or every session of one
  global scope (Mooncake, where ids are shared between lines), in arrival order
  (`arrival_s + t`; ties in file order).
- `suffix_growth_ratio`: of the requests that follow another request of the same agent, the share
  whose hash ids start with all of the previous request's ids (pure suffix growth).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentab.workloads.model import Request, Session, Subagent, Workload

STAT_KEYS = ("mean", "p50", "p90", "p99", "max")


def distribution(values: list[float] | list[int]) -> dict[str, float | int | None]:
    if not values:
        return dict.fromkeys(STAT_KEYS)
    a = np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99]).tolist()
    top = a.max().item()
    return {"mean": float(a.mean()), "p50": p50, "p90": p90, "p99": p99, "max": top}


def _agent_lists(items: tuple[Request | Subagent, ...]) -> list[list[Request]]:
    """Each agent's own requests in order: this list's, then every subagent's, depth first."""
    own = [i for i in items if isinstance(i, Request)]
    lists = [own] if own else []
    for i in items:
        if isinstance(i, Subagent):
            lists.extend(_agent_lists(i.items))
    return lists


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix, by slice comparisons (C speed, O(n log n) worst case)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def cache_hit_blocks(sessions: list[Session]) -> int:
    """Summed leading already-seen blocks over the requests of sessions that share one id
    namespace (a local-scope session alone, or all sessions of a global scope), in start order.

    Every request's ids are added to `seen` once processed; the last processed request of the
    same agent is entirely in `seen`, so its common prefix counts without a set lookup per id.
    """
    order: list[tuple[float, int, int, tuple[int, int], Request]] = []
    for k, session in enumerate(sessions):
        tree_index = {id(r): i for i, r in enumerate(session.all_requests())}
        for agent, requests in enumerate(_agent_lists(session.items)):
            order.extend(
                (session.arrival_s + r.t, k, tree_index[id(r)], (k, agent), r) for r in requests
            )
    order.sort(key=lambda x: (x[0], x[1], x[2]))
    seen: set[int] = set()
    last_by_agent: dict[tuple[int, int], tuple[int, ...]] = {}
    hits = 0
    for _, _, _, agent_key, r in order:
        ids = r.hash_ids
        prev = last_by_agent.get(agent_key)
        known = 0 if prev is None else _common_prefix(ids, prev)
        lead = known
        while lead < len(ids) and ids[lead] in seen:
            lead += 1
        hits += lead
        seen.update(ids[known:])
        last_by_agent[agent_key] = ids
    return hits


def summarize(workload: Workload) -> dict[str, Any]:
    """The `inspect --json` object."""
    ins: list[int] = []
    outs: list[int] = []
    turns: list[int] = []
    pauses: list[float] = []
    parent = subagent = 0
    hit_tokens = 0
    growth = follows = 0
    subagents = background = 0
    scopes: dict[tuple[str, int], list[Session]] = {}  # sessions sharing a global id namespace
    for s in workload.sessions:
        for requests in _agent_lists(s.items):
            prev: Request | None = None
            for r in requests:
                ins.append(r.in_tokens)
                outs.append(r.out_tokens)
                if prev is not None:
                    pauses.append(max(0.0, r.t - prev.t - (prev.api_time or 0.0)))
                    follows += 1
                    n = len(prev.hash_ids)
                    growth += r.hash_ids[:n] == prev.hash_ids
                prev = r
        count = sum(1 for _ in s.all_requests())
        parent_own = sum(1 for _ in s.requests())
        parent += parent_own
        subagent += count - parent_own
        turns.append(parent_own)
        for a in s.subagents():
            subagents += 1
            background += a.background
        if s.hash_scope is None:
            hit_tokens += cache_hit_blocks([s]) * s.block_size
        else:
            scopes.setdefault((s.hash_scope, s.block_size), []).append(s)
    for (_, block_size), members in scopes.items():
        hit_tokens += cache_hit_blocks(members) * block_size
    total_in = sum(ins)
    return {
        "sessions": len(workload.sessions),
        "requests": parent + subagent,
        "parent_requests": parent,
        "subagent_requests": subagent,
        "subagents": subagents,
        "background_subagents": background,
        "input_tokens": distribution(ins),
        "output_tokens": distribution(outs),
        "turns_per_session": distribution(turns),
        "pause_s": distribution(pauses),
        "theoretical_cache_hit_ratio": hit_tokens / total_in if total_in else None,
        "suffix_growth_ratio": growth / follows if follows else None,
        "content_hash": workload.content_hash,
    }

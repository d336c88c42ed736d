"""The trace model: immutable sessions holding an ordered tree of requests.

A session is what one coding agent did: its parent turns in order, and subagents it spawned
(each with its own requests, possibly nested subagents). Every importer produces this model and
every exporter and the replay planner consume it, so nothing downstream knows file formats.

Times: `Request.t` and `Subagent.t` are seconds from the *session* start, also inside subagents
(importers convert relative inner offsets to absolute ones).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import orjson

RequestType = Literal["n", "s"]
RequestKind = Literal["parent", "subagent"]
PARENT_AGENT_ID = "main"


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM call as recorded: when it started, how big it was, which prefix blocks it had."""

    t: float
    in_tokens: int
    out_tokens: int
    hash_ids: tuple[int, ...] = ()
    kind: RequestKind = "parent"
    agent_id: str = PARENT_AGENT_ID
    type: RequestType = "n"
    input_types: tuple[str, ...] = ()
    output_types: tuple[str, ...] = ()
    stop: str = ""
    api_time: float | None = None
    think_time: float | None = None
    ttft: float | None = None
    model: str = ""


@dataclass(frozen=True, slots=True)
class Subagent:
    """A subagent spawned at `t`; it runs beside its parent until `t + duration_s`.

    `duration_s` is None for a subagent launched in the background (`async_launched`), which no
    parent turn waits for.
    """

    agent_id: str
    t: float
    duration_s: float | None
    items: tuple[Request | Subagent, ...]
    subagent_type: str = ""
    status: str = ""
    system_tokens: int = 0
    tool_tokens: int = 0
    total_tokens: int | None = None
    tool_use_count: int | None = None
    models: tuple[str, ...] = ()

    @property
    def end(self) -> float | None:
        return None if self.duration_s is None else self.t + self.duration_s

    @property
    def background(self) -> bool:
        return self.duration_s is None or self.status == "async_launched"

    def requests(self) -> Iterator[Request]:
        """This subagent's own requests in order (not those of nested subagents)."""
        return (item for item in self.items if isinstance(item, Request))


@dataclass(frozen=True, slots=True)
class Session:
    """One agent session: its parent items in recorded order and its prefix sizes."""

    id: str
    block_size: int
    items: tuple[Request | Subagent, ...]
    system_tokens: int = 0
    tool_tokens: int = 0
    models: tuple[str, ...] = ()
    arrival_s: float = 0.0  # arrival offset in the workload (open-loop replay, Mooncake)
    # None: hash ids are local to this session tree (AgentX "local"), so equal ids in two
    # sessions are different blocks. "global": one namespace shared by every session whose scope
    # is "global" (AgentX "global", Mooncake), so equal ids are the same block everywhere.
    hash_scope: str | None = None

    def requests(self) -> Iterator[Request]:
        """The parent's own requests in order."""
        return (item for item in self.items if isinstance(item, Request))

    def all_requests(self) -> Iterator[Request]:
        """Every request of the tree, depth first in recorded order."""
        return _walk(self.items)

    def subagents(self) -> Iterator[Subagent]:
        """Every subagent of the tree, depth first."""
        return _walk_subagents(self.items)


def _walk(items: tuple[Request | Subagent, ...]) -> Iterator[Request]:
    for item in items:
        if isinstance(item, Request):
            yield item
        else:
            yield from _walk(item.items)


def _walk_subagents(items: tuple[Request | Subagent, ...]) -> Iterator[Subagent]:
    for item in items:
        if isinstance(item, Subagent):
            yield item
            yield from _walk_subagents(item.items)


@dataclass(frozen=True)
class Workload:
    """A set of sessions. `content_hash` identifies it across processes and machines."""

    sessions: tuple[Session, ...]
    source: str = field(default="", compare=False)

    def __len__(self) -> int:
        return len(self.sessions)

    @cached_property
    def content_hash(self) -> str:
        """sha256 of a canonical encoding of every field of every session (source excluded)."""
        digest = hashlib.sha256()
        for session in self.sessions:
            digest.update(orjson.dumps(canonical_session(session)))
            digest.update(b"\n")
        return digest.hexdigest()

    def num_requests(self) -> int:
        return sum(1 for s in self.sessions for _ in s.all_requests())


def _opt_float(x: float | None) -> float | None:
    # 5 and 5.0 are the same time; encode both as 5.0 so the hash does not depend on the type.
    return None if x is None else float(x)


def _hash_delta(hash_ids: tuple[int, ...], prev: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(n, rest): the first n ids equal `prev`'s first n; `rest` follows them.

    Agent prompts grow by suffix, so a request's ids are mostly its predecessor's: storing only
    the new ones keeps files and the content hash's input small (tens of MB instead of GB).
    `rest` is a tuple slice (orjson writes a tuple as the list it would write for it).
    """
    n = len(prev)
    if len(hash_ids) >= n and hash_ids[:n] == prev:
        return n, hash_ids[n:]
    n = min(n, len(hash_ids))
    lo = 0
    while lo < n and hash_ids[lo] == prev[lo]:
        lo += 1
    return lo, hash_ids[lo:]


def canonical_request(r: Request, prev_hash_ids: tuple[int, ...] = ()) -> dict[str, object]:
    """Every field of a request; hash ids as a delta against the previous request of its list.

    Tuple fields stay tuples (orjson writes a tuple as the list it would write for it) and the
    optional times are converted inline: the content hash builds one of these per request."""
    shared, new = _hash_delta(r.hash_ids, prev_hash_ids)
    api, think, ttft = r.api_time, r.think_time, r.ttft
    return {
        "t": float(r.t),
        "in": r.in_tokens,
        "out": r.out_tokens,
        "hash_prefix": shared,
        "hash_new": new,
        "kind": r.kind,
        "agent_id": r.agent_id,
        "type": r.type,
        "input_types": r.input_types,
        "output_types": r.output_types,
        "stop": r.stop,
        "api_time": None if api is None else float(api),
        "think_time": None if think is None else float(think),
        "ttft": None if ttft is None else float(ttft),
        "model": r.model,
    }


def canonical_items(items: tuple[Request | Subagent, ...]) -> list[dict[str, object]]:
    """The items of one agent in order; each request's hash ids are relative to the previous
    request of the same list (subagent entries in between do not reset the chain)."""
    out: list[dict[str, object]] = []
    prev: tuple[int, ...] = ()
    for item in items:
        if isinstance(item, Request):
            out.append(canonical_request(item, prev))
            prev = item.hash_ids
        else:
            out.append(canonical_subagent(item))
    return out


def canonical_subagent(a: Subagent) -> dict[str, object]:
    return {
        "type": "subagent",
        "agent_id": a.agent_id,
        "t": float(a.t),
        "duration_s": _opt_float(a.duration_s),
        "subagent_type": a.subagent_type,
        "status": a.status,
        "system_tokens": a.system_tokens,
        "tool_tokens": a.tool_tokens,
        "total_tokens": a.total_tokens,
        "tool_use_count": a.tool_use_count,
        "models": a.models,
        "items": canonical_items(a.items),
    }


def canonical_session(s: Session) -> dict[str, object]:
    """A plain, ordered structure holding every field: the content hash's input and, one per
    line, agentab's native JSONL format."""
    return {
        "id": s.id,
        "block_size": s.block_size,
        "system_tokens": s.system_tokens,
        "tool_tokens": s.tool_tokens,
        "models": s.models,
        "arrival_s": float(s.arrival_s),
        "hash_scope": s.hash_scope,
        "items": canonical_items(s.items),
    }

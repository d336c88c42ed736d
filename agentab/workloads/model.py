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


def canonical_request(r: Request) -> list[object]:
    return [
        r.t,
        r.in_tokens,
        r.out_tokens,
        list(r.hash_ids),
        r.kind,
        r.agent_id,
        r.type,
        list(r.input_types),
        list(r.output_types),
        r.stop,
        r.api_time,
        r.think_time,
        r.ttft,
        r.model,
    ]


def canonical_item(item: Request | Subagent) -> list[object]:
    if isinstance(item, Request):
        return ["r", *canonical_request(item)]
    return [
        "a",
        item.agent_id,
        item.t,
        item.duration_s,
        item.subagent_type,
        item.status,
        item.system_tokens,
        item.tool_tokens,
        item.total_tokens,
        item.tool_use_count,
        list(item.models),
        [canonical_item(i) for i in item.items],
    ]


def canonical_session(s: Session) -> list[object]:
    """A plain, ordered structure holding every field: the input of the content hash."""
    return [
        s.id,
        s.block_size,
        s.system_tokens,
        s.tool_tokens,
        list(s.models),
        s.arrival_s,
        [canonical_item(i) for i in s.items],
    ]

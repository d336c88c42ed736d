"""The fast reader of AgentX sessions: msgspec structs, hash ids compared as raw JSON bytes.

Why a second reader: a 100k-request trace holds ~44M hash ids, but an agent's prompt grows by
suffix, so each request repeats all of its predecessor's ids and adds a few (~1.6M new ones in
the generated corpus). The validating reader (`agentx.parse_session`) turns every id into a
Python int before it can compare lists; this one has msgspec keep each `hash_ids` array as its
raw bytes, and when the bytes start with the previous request's ids (the same bytes followed by
`,` or `]`) it parses only what follows. The other fields are decoded into typed structs in C.

This reader only accepts what it can vouch for: a session whose every field has the expected
JSON type and range, no unknown field, no other irregularity the validating reader would warn
or fail on. For anything else `decode_session` returns None and the caller runs the validating
reader, which gives the same result for valid input (tests compare the two) and the one-line
error or warning otherwise. Nothing here warns or raises for bad input.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import orjson

from agentab.workloads.checks import (
    MAX_COUNT,
    MAX_STRING_CHARS,
    MAX_STRINGS,
    MAX_SUBAGENT_DEPTH,
    MAX_TOKENS,
    RELATIVE_TOLERANCE_S,
    intern_str_tuple,
)
from agentab.workloads.model import PARENT_AGENT_ID, Request, Session, Subagent

_U64_MAX = 2**64 - 1  # orjson (the validating reader's parser) reads larger integers as floats
_COMMA, _CLOSE = ord(","), ord("]")
_NULL = msgspec.Raw(b"null")
Number = int | float
# Strings and lists of strings past the validating reader's bounds: left to it, which names them
Str = Annotated[str, msgspec.Meta(max_length=MAX_STRING_CHARS)]
Strs = Annotated[list[Str], msgspec.Meta(max_length=MAX_STRINGS)]


class _Unsure(Exception):
    """The input is not plainly valid: leave it to the validating reader."""


class _Request(msgspec.Struct, tag_field="type", tag="n", forbid_unknown_fields=True, gc=False):
    t: Number
    in_: int = msgspec.field(name="in")
    out: int
    hash_ids: msgspec.Raw = _NULL
    model: Str | None = None
    input_types: Strs | None = None
    output_types: Strs | None = None
    stop: Str | None = None
    api_time: Number | None = None
    think_time: Number | None = None
    ttft: Number | None = None


class _StreamingRequest(_Request, tag="s"):
    pass


class _Subagent(
    msgspec.Struct, tag_field="type", tag="subagent", forbid_unknown_fields=True, gc=False
):
    t: Number
    agent_id: Str
    requests: list[_Item]
    subagent_type: Str | None = None
    duration_ms: Number | None = None
    total_tokens: int | None = None
    tool_use_count: int | None = None
    status: Str | None = None
    models: Strs | None = None
    tool_tokens: int | None = None
    system_tokens: int | None = None


_Item = _Request | _StreamingRequest | _Subagent


class _Session(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: Str
    block_size: int
    requests: list[_Item]
    hash_id_scope: Str = "local"
    models: Strs | None = None
    tool_tokens: int | None = None
    system_tokens: int | None = None
    totals: msgspec.Raw = _NULL  # read by no one: kept unparsed


_DECODER = msgspec.json.Decoder(_Session)


def decode_session(data: bytes | memoryview) -> Session | None:
    """One AgentX session object -> Session, or None when the validating reader must decide.

    The result equals `agentx.parse_session(orjson.loads(data), ...)` for every input this
    function accepts."""
    try:
        raw = _DECODER.decode(data)
        return _session(raw)
    except (_Unsure, msgspec.MsgspecError, orjson.JSONDecodeError, RecursionError):
        return None


def _session(d: _Session) -> Session:
    if not d.id or not 1 <= d.block_size <= MAX_COUNT or not d.requests:
        raise _Unsure
    if d.hash_id_scope not in ("local", "global"):
        raise _Unsure
    items = _items(d.requests, PARENT_AGENT_ID, 0.0, d.block_size, 1)
    return Session(
        id=d.id,
        block_size=d.block_size,
        items=items,
        system_tokens=_count(d.system_tokens),
        tool_tokens=_count(d.tool_tokens),
        models=_strings(d.models),
        arrival_s=0.0,
        hash_scope=None if d.hash_id_scope == "local" else "global",
    )


def _items(
    entries: list[_Item], agent_id: str, offset: float, block_size: int, depth: int
) -> tuple[Request | Subagent, ...]:
    """The items of one agent's list; `depth` is the nesting level of subagents found here."""
    parent = depth == 1
    kind: Literal["parent", "subagent"] = "parent" if parent else "subagent"
    items: list[Request | Subagent] = []
    ids = HashIdChain()
    last_t = -1.0
    for d in entries:
        if isinstance(d, _Subagent):
            items.append(_subagent(d, offset, block_size, depth))
            continue
        t = _time(d.t) + offset
        if parent:
            if t < last_t:
                raise _Unsure
            last_t = t
        in_tokens, out_tokens = d.in_, d.out
        if not (0 <= in_tokens <= MAX_TOKENS and 0 <= out_tokens <= MAX_TOKENS):
            raise _Unsure
        items.append(
            Request(
                t=t,
                in_tokens=in_tokens,
                out_tokens=out_tokens,
                hash_ids=ids.next(bytes(d.hash_ids), in_tokens, block_size),
                kind=kind,
                agent_id=agent_id,
                type="s" if type(d) is _StreamingRequest else "n",
                input_types=_strings(d.input_types),
                output_types=_strings(d.output_types),
                stop=d.stop or "",
                api_time=_opt_time(d.api_time),
                think_time=_opt_time(d.think_time),
                ttft=_opt_time(d.ttft),
                model=d.model or "",
            )
        )
    return tuple(items)


def _subagent(d: _Subagent, offset: float, block_size: int, depth: int) -> Subagent:
    if depth > MAX_SUBAGENT_DEPTH:
        raise _Unsure
    spawn = _time(d.t) + offset
    duration_ms = _opt_time(d.duration_ms)
    inner_ts = [_plain(x.t) for x in d.requests]
    relative = bool(inner_ts) and min(inner_ts) < spawn - RELATIVE_TOLERANCE_S
    items = _items(d.requests, d.agent_id, spawn if relative else 0.0, block_size, depth + 1)
    return Subagent(
        agent_id=d.agent_id,
        t=spawn,
        duration_s=None if duration_ms is None else duration_ms / 1000.0,
        items=items,
        subagent_type=d.subagent_type or "",
        status=d.status or "",
        system_tokens=_count(d.system_tokens),
        tool_tokens=_count(d.tool_tokens),
        total_tokens=None if d.total_tokens is None else _count(d.total_tokens),
        tool_use_count=None if d.tool_use_count is None else _count(d.tool_use_count),
        models=_strings(d.models),
    )


class HashIdChain:
    """Hash ids of one agent's successive requests, parsed from raw JSON arrays.

    Keeps the previous request's ids and the bytes that spell them (`prefix`: the array up to,
    not including, the separator after its last full-block id). A request whose array starts
    with those bytes followed by `,` or `]` holds the same leading ids, so only the rest is
    parsed, and its tuple extends the previous one (sharing its int objects). Equal bytes spell
    equal ids; any other array is parsed whole, so the ids are exact either way.
    """

    __slots__ = ("ids", "prefix")

    def __init__(self) -> None:
        self.ids: tuple[int, ...] = ()
        self.prefix: bytes | None = None

    def next(self, raw: bytes, in_tokens: int, block_size: int) -> tuple[int, ...]:
        """The ids of the prompt's full blocks (as `checks.full_block_ids` keeps them)."""
        full = in_tokens // block_size
        prefix = self.prefix
        shared: tuple[int, ...] = ()
        n = len(prefix) if prefix is not None else 0
        if prefix and raw.startswith(prefix) and len(raw) > n and raw[n] in (_COMMA, _CLOSE):
            shared = self.ids
            tail = _ids(b"[" + raw[n + 1 :]) if raw[n] == _COMMA else []
        elif raw == b"null":
            tail = []
        else:
            tail = _ids(raw)
        total = len(shared) + len(tail)
        keep = total
        if total > full:  # the last id may name the prompt's partial last block: dropped
            if total > -(-in_tokens // block_size):
                raise _Unsure
            keep = full
        if keep <= len(shared):
            ids = shared if keep == len(shared) else shared[:keep]
        else:
            ids = shared + tuple(tail[: keep - len(shared)])
        if not keep:
            self.prefix = None
        elif keep == total:
            self.prefix = raw[:-1]
        else:  # one id (the partial block's) follows the kept ones
            self.prefix = raw[: raw.rindex(b",")]
        self.ids = ids
        return ids


def _ids(array: bytes) -> list[int]:
    """A JSON array of integers >= 0 (orjson, as the validating reader parses them)."""
    ids = orjson.loads(array)
    if type(ids) is not list:
        raise _Unsure
    if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0):
        raise _Unsure
    return ids


def _plain(v: int | float) -> int | float:
    """A number as orjson gives it: integers beyond 64 bits are floats there (not accepted)."""
    if type(v) is int and v > _U64_MAX:
        raise _Unsure
    return v


def _time(v: int | float) -> float:
    """A time: a finite number >= 0 (msgspec refuses out-of-range floats)."""
    f = float(_plain(v))
    if not f >= 0:
        raise _Unsure
    return f


def _opt_time(v: int | float | None) -> float | None:
    return None if v is None else _time(v)


def _count(v: int | None) -> int:
    """An optional count in [0, MAX_COUNT]; absent or null is 0."""
    if v is None:
        return 0
    if not 0 <= v <= MAX_COUNT:
        raise _Unsure
    return v


def _strings(v: list[str] | None) -> tuple[str, ...]:
    return () if v is None else intern_str_tuple(tuple(v))

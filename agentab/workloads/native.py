"""agentab's native JSONL: a lossless, compact encoding of the trace model.

Line 1 is a header `{"agentab_workload": 1, "sessions": N}`; each further line is one session
exactly as `model.canonical_session` encodes it (the content hash's input), so a file's sessions
hash the same after any number of round trips. Hash ids are stored as a delta against the
previous request of the same agent (`hash_prefix` shared ids, then `hash_new`): agent prompts
grow by suffix, so this is tens of times smaller than listing every id.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson

from agentab.errors import AgentabError
from agentab.workloads.checks import (
    MAX_STRING_CHARS,
    Ctx,
    Path_,
    check_blocks,
    check_depth,
    check_ids,
    need_int,
    need_list,
    need_num,
    need_str,
    need_tokens,
    opt_int,
    opt_num,
    opt_str,
    session_header,
    shown,
    str_tuple,
    too_long,
)
from agentab.workloads.model import (
    PARENT_AGENT_ID,
    Request,
    Session,
    Subagent,
    Workload,
    canonical_session,
)
from agentab.workloads.source import NATIVE_HEADER_KEY, parse_json, read_bytes, session_lines

VERSION = 1
SESSION_FIELDS = frozenset(
    {
        "id",
        "block_size",
        "system_tokens",
        "tool_tokens",
        "models",
        "arrival_s",
        "hash_scope",
        "items",
    }
)
REQUEST_FIELDS = frozenset(
    {
        "t",
        "in",
        "out",
        "hash_prefix",
        "hash_new",
        "kind",
        "agent_id",
        "type",
        "input_types",
        "output_types",
        "stop",
        "api_time",
        "think_time",
        "ttft",
        "model",
    }
)
SUBAGENT_FIELDS = frozenset(
    {
        "type",
        "agent_id",
        "t",
        "duration_s",
        "subagent_type",
        "status",
        "system_tokens",
        "tool_tokens",
        "total_tokens",
        "tool_use_count",
        "models",
        "items",
    }
)


def dump_native(workload: Workload, out: Path) -> None:
    """Write the workload as native JSONL (gzip when the name ends in `.gz`)."""
    opener = gzip.open if out.name.endswith(".gz") else open
    try:
        with opener(out, "wb") as fh:
            fh.write(orjson.dumps({NATIVE_HEADER_KEY: VERSION, "sessions": len(workload)}))
            fh.write(b"\n")
            for s in workload.sessions:
                fh.write(orjson.dumps(canonical_session(s)))
                fh.write(b"\n")
    except OSError as exc:
        raise AgentabError(f"{out}: cannot write ({exc.strerror or exc})") from None


def load_native(path: Path) -> Workload:
    ctx = Ctx(str(path))
    data = read_bytes(path)
    lines = session_lines(data)
    first = next(lines, None)
    if first is None:
        raise AgentabError(f"{path}: file is empty")
    lineno, line = first
    header = parse_json(line, str(path), lineno)
    if type(header) is not dict or NATIVE_HEADER_KEY not in header:
        raise AgentabError(f"{path}:{lineno}: not an agentab workload (no header line)")
    if header[NATIVE_HEADER_KEY] != VERSION:
        raise AgentabError(
            f"{path}:{lineno}: native format version {shown(header[NATIVE_HEADER_KEY])} is not "
            f"supported (this agentab reads version {VERSION})"
        )
    sessions: list[Session] = []
    seen: set[str] = set()
    for lineno, line in lines:
        ctx.line = lineno
        ctx.session = None
        s = _parse_session(ctx, parse_json(line, str(path), lineno))
        if s.id in seen:
            ctx.fail("session id appears twice")
        seen.add(s.id)
        sessions.append(s)
    expected = header.get("sessions")
    if expected is not None and expected != len(sessions):
        raise AgentabError(
            f"{path}: header says {expected} sessions but the file has {len(sessions)} (truncated?)"
        )
    return Workload(tuple(sessions), source=str(path))


def _parse_session(ctx: Ctx, obj: object) -> Session:
    d, sid, block_size = session_header(ctx, obj, SESSION_FIELDS)
    scope = d.get("hash_scope")
    if scope is not None and type(scope) is not str:
        ctx.fail("field 'hash_scope' must be a string or null")
    if scope is not None and len(scope) > MAX_STRING_CHARS:
        too_long(ctx, "hash_scope", len(scope), None)
    items = _parse_items(ctx, need_list(ctx, d, "items", None), (), block_size, parent=True)
    if not items:
        ctx.fail("session has no requests")
    return Session(
        id=sid,
        block_size=block_size,
        items=items,
        system_tokens=need_int(ctx, d, "system_tokens", None),
        tool_tokens=need_int(ctx, d, "tool_tokens", None),
        models=str_tuple(ctx, d, "models", None),
        arrival_s=need_num(ctx, d, "arrival_s", None),
        hash_scope=scope,
    )


def _parse_items(
    ctx: Ctx, entries: list[Any], base: Path_, block_size: int, *, parent: bool
) -> tuple[Request | Subagent, ...]:
    items: list[Request | Subagent] = []
    prev: tuple[int, ...] = ()
    last_t = -1.0
    for i, d in enumerate(entries):
        path = (*base, i)
        if type(d) is not dict:
            ctx.fail(f"must be a JSON object, got {type(d).__name__}", path)
        typ = d.get("type")
        if typ == "subagent":
            items.append(_parse_subagent(ctx, d, path, block_size))
            continue
        if typ not in ("n", "s"):
            ctx.fail(f"unknown request type {shown(typ)} (expected 'n', 's' or 'subagent')", path)
        if not d.keys() <= REQUEST_FIELDS:
            ctx.unknown(d.keys(), REQUEST_FIELDS, path)
        t = need_num(ctx, d, "t", path)
        if parent:
            if t < last_t:
                ctx.fail(f"'t' goes backwards ({t:g} after {last_t:g})", path)
            last_t = t
        shared = need_int(ctx, d, "hash_prefix", path)
        if shared > len(prev):
            ctx.fail(
                f"'hash_prefix' is {shared} but the previous request has {len(prev)} hash ids",
                path,
            )
        new = need_list(ctx, d, "hash_new", path)
        check_ids(ctx, new, "hash_new", path)
        ids = prev[:shared] + tuple(new) if shared else tuple(new)
        in_tokens = need_tokens(ctx, d, "in", path)
        check_blocks(ctx, len(ids), block_size, in_tokens, path, "hash ids")
        kind = need_str(ctx, d, "kind", path)
        if kind not in ("parent", "subagent"):
            ctx.fail(f"field 'kind' must be 'parent' or 'subagent', got {shown(kind)}", path)
        prev = ids
        items.append(
            Request(
                t=t,
                in_tokens=in_tokens,
                out_tokens=need_tokens(ctx, d, "out", path),
                hash_ids=ids,
                kind=kind,  # type: ignore[arg-type]
                agent_id=opt_str(ctx, d, "agent_id", path, PARENT_AGENT_ID),
                type=typ,
                input_types=str_tuple(ctx, d, "input_types", path),
                output_types=str_tuple(ctx, d, "output_types", path),
                stop=opt_str(ctx, d, "stop", path),
                api_time=opt_num(ctx, d, "api_time", path),
                think_time=opt_num(ctx, d, "think_time", path),
                ttft=opt_num(ctx, d, "ttft", path),
                model=opt_str(ctx, d, "model", path),
            )
        )
    return tuple(items)


def _parse_subagent(ctx: Ctx, d: dict[str, Any], path: Path_, block_size: int) -> Subagent:
    check_depth(ctx, path)
    if not d.keys() <= SUBAGENT_FIELDS:
        ctx.unknown(d.keys(), SUBAGENT_FIELDS, path)
    return Subagent(
        agent_id=need_str(ctx, d, "agent_id", path),
        t=need_num(ctx, d, "t", path),
        duration_s=opt_num(ctx, d, "duration_s", path),
        items=_parse_items(ctx, need_list(ctx, d, "items", path), path, block_size, parent=False),
        subagent_type=opt_str(ctx, d, "subagent_type", path),
        status=opt_str(ctx, d, "status", path),
        system_tokens=need_int(ctx, d, "system_tokens", path),
        tool_tokens=need_int(ctx, d, "tool_tokens", path),
        total_tokens=opt_int(ctx, d, "total_tokens", path),
        tool_use_count=opt_int(ctx, d, "tool_use_count", path),
        models=str_tuple(ctx, d, "models", path),
    )

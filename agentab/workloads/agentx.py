"""AgentX / Weka ("kv-cache-tester") traces: import and export.

One JSON object per session (docs/workloads.md): a file holding one session, a directory of
such files, or JSONL with one session per line; `.gz` accepted. Subagent entries carry their own
nested requests; their inner `t` is absolute in current captures and relative to the spawn in old
ones (told apart per subagent: see `RELATIVE_TOLERANCE_S`). The export writes what AIPerf's Weka
loader accepts (it forbids unknown fields), so AgentX/AIPerf can replay what agentab generates.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import orjson

from agentab.errors import AgentabError
from agentab.workloads.agentx_decode import decode_session
from agentab.workloads.checks import (
    RELATIVE_TOLERANCE_S,
    Ctx,
    Path_,
    WorkloadWarning,
    chained_ids,
    check_depth,
    full_block_ids,
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
)
from agentab.workloads.model import PARENT_AGENT_ID, Request, Session, Subagent, Workload
from agentab.workloads.source import (
    TRACE_SUFFIXES,
    first_non_space,
    parse_json,
    read_bytes,
    session_lines,
    trace_files,
)

SESSION_FIELDS = frozenset(
    {
        "id",
        "models",
        "block_size",
        "hash_id_scope",
        "tool_tokens",
        "system_tokens",
        "requests",
        "totals",
    }
)
REQUEST_FIELDS = frozenset(
    {
        "t",
        "type",
        "model",
        "in",
        "out",
        "hash_ids",
        "input_types",
        "output_types",
        "stop",
        "api_time",
        "think_time",
        "ttft",
    }
)
SUBAGENT_FIELDS = frozenset(
    {
        "t",
        "type",
        "agent_id",
        "subagent_type",
        "duration_ms",
        "total_tokens",
        "tool_use_count",
        "status",
        "requests",
        "models",
        "tool_tokens",
        "system_tokens",
    }
)


def load_agentx(path: Path) -> Workload:
    """Every session of a file, a JSONL file or a directory of files, in file/line order."""
    ctx = Ctx(str(path))
    sessions: list[Session] = []
    files = trace_files(path) if path.is_dir() else [path]
    for file in files:
        ctx.file = str(file)
        data = read_bytes(file)
        if first_non_space(data) == -1:
            raise AgentabError(f"{file}: file is empty")
        sessions.extend(_parse_file(data, ctx))
    _check_unique_ids(sessions, str(path))
    return Workload(tuple(sessions), source=str(path))


def _parse_file(data: bytes, ctx: Ctx) -> list[Session]:
    start = first_non_space(data)
    if data[start : start + 1] != b"{":
        lineno = data.count(b"\n", 0, start) + 1
        raise AgentabError(f"{ctx.file}:{lineno}: not a JSON object (an AgentX session is one)")
    first_line_end = data.find(b"\n", start)
    # One compact session per line (JSONL), or one (possibly pretty-printed) document.
    is_jsonl = False
    if first_line_end != -1 and first_non_space(data, first_line_end) != -1:
        try:
            orjson.loads(data[:first_line_end])
            is_jsonl = True
        except orjson.JSONDecodeError:
            is_jsonl = False
    if not is_jsonl:
        ctx.line = None
        return [_read_session(data, ctx)]
    sessions = []
    for lineno, line in session_lines(data):
        ctx.line = lineno
        sessions.append(_read_session(line, ctx))
    ctx.line = None
    return sessions


def _read_session(data: bytes | memoryview, ctx: Ctx) -> Session:
    """The fast reader's session, or (when it is unsure) the validating reader's verdict."""
    session = decode_session(data)
    if session is not None:
        return session
    ctx.session = None
    return parse_session(parse_json(data, ctx.file, ctx.line), ctx)


def _check_unique_ids(sessions: list[Session], source: str) -> None:
    seen: set[str] = set()
    for s in sessions:
        if s.id in seen:
            raise AgentabError(f"{source}: session id {s.id!r} appears twice")
        seen.add(s.id)


def parse_session(obj: object, ctx: Ctx) -> Session:
    """One AgentX session object -> Session (raises AgentabError naming where it is wrong)."""
    ctx.session = None
    d, sid, block_size = session_header(ctx, obj, SESSION_FIELDS)
    scope = d.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        ctx.fail(f"field 'hash_id_scope' must be 'local' or 'global', got {shown(scope)}")
    requests = need_list(ctx, d, "requests", None)
    if not requests:
        ctx.fail("session has no requests")
    items = _parse_items(ctx, requests, (), PARENT_AGENT_ID, 0.0, block_size, parent=True)
    return Session(
        id=sid,
        block_size=block_size,
        items=items,
        system_tokens=opt_int(ctx, d, "system_tokens", None, 0) or 0,
        tool_tokens=opt_int(ctx, d, "tool_tokens", None, 0) or 0,
        models=str_tuple(ctx, d, "models", None),
        arrival_s=0.0,
        hash_scope=None if scope == "local" else "global",
    )


def _parse_items(
    ctx: Ctx,
    entries: list[Any],
    base: Path_,
    agent_id: str,
    offset: float,
    block_size: int,
    *,
    parent: bool,
) -> tuple[Request | Subagent, ...]:
    kind: Literal["parent", "subagent"] = "parent" if parent else "subagent"
    items: list[Request | Subagent] = []
    prev_raw: list[Any] | None = None
    prev_ids: tuple[int, ...] = ()
    last_t = -1.0
    for i, d in enumerate(entries):
        path = (*base, i)
        if type(d) is not dict:
            ctx.fail(f"must be a JSON object, got {type(d).__name__}", path)
        typ = d.get("type")
        if typ == "n" or typ == "s":
            if not d.keys() <= REQUEST_FIELDS:
                ctx.unknown(d.keys(), REQUEST_FIELDS, path)
            t = need_num(ctx, d, "t", path) + offset
            if parent:
                if t < last_t:
                    ctx.fail(
                        f"'t' goes backwards ({t:g} after {last_t:g}); parent request times "
                        "must be non-decreasing",
                        path,
                    )
                last_t = t
            in_tokens = need_tokens(ctx, d, "in", path)
            out_tokens = need_tokens(ctx, d, "out", path)
            raw = d.get("hash_ids")
            if raw is None:
                raw = []
            elif type(raw) is not list:
                ctx.fail("field 'hash_ids' must be an array of integers", path)
            raw = full_block_ids(ctx, raw, block_size, in_tokens, path, "hash_ids")
            ids = chained_ids(ctx, raw, prev_raw, prev_ids, "hash_ids", path)
            prev_raw, prev_ids = raw, ids
            items.append(
                Request(
                    t=t,
                    in_tokens=in_tokens,
                    out_tokens=out_tokens,
                    hash_ids=ids,
                    kind=kind,
                    agent_id=agent_id,
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
        elif typ == "subagent":
            items.append(_parse_subagent(ctx, d, path, offset, block_size))
        elif typ is None and "type" not in d:
            ctx.fail("missing field 'type'", path)
        else:
            ctx.fail(f"unknown request type {shown(typ)} (expected 'n', 's' or 'subagent')", path)
    return tuple(items)


def _parse_subagent(
    ctx: Ctx, d: dict[str, Any], path: Path_, offset: float, block_size: int
) -> Subagent:
    check_depth(ctx, path)
    if not d.keys() <= SUBAGENT_FIELDS:
        ctx.unknown(d.keys(), SUBAGENT_FIELDS, path)
    agent_id = need_str(ctx, d, "agent_id", path)
    spawn = need_num(ctx, d, "t", path) + offset
    duration_ms = opt_num(ctx, d, "duration_ms", path)
    inner = need_list(ctx, d, "requests", path)
    inner_ts = [x["t"] for x in inner if type(x) is dict and type(x.get("t")) in (int, float)]
    relative = bool(inner_ts) and min(inner_ts) < spawn - RELATIVE_TOLERANCE_S
    items = _parse_items(
        ctx, inner, path, agent_id, spawn if relative else 0.0, block_size, parent=False
    )
    return Subagent(
        agent_id=agent_id,
        t=spawn,
        duration_s=None if duration_ms is None else duration_ms / 1000.0,
        items=items,
        subagent_type=opt_str(ctx, d, "subagent_type", path),
        status=opt_str(ctx, d, "status", path),
        system_tokens=opt_int(ctx, d, "system_tokens", path, 0) or 0,
        tool_tokens=opt_int(ctx, d, "tool_tokens", path, 0) or 0,
        total_tokens=opt_int(ctx, d, "total_tokens", path),
        tool_use_count=opt_int(ctx, d, "tool_use_count", path),
        models=str_tuple(ctx, d, "models", path),
    )


# ---------------------------------------------------------------------------------------- export


class PartialBlockIds:
    """Fresh hash ids for prompts' trailing partial blocks, unique in the whole export.

    Captures hash every block of a prompt, the last partial one included (ceil(in / block_size)
    ids), and AIPerf's Weka loader relies on it: a turn-0 prompt must have ids for all of its
    system + tools prefix, ceil((system + tools) / block_size) blocks, or the loader aborts. The
    model keeps full blocks only, so the export adds one id per partial block. A partial block
    is never a prefix-cache hit, so each gets an id of its own, above every id the workload uses.
    """

    def __init__(self, workload: Workload) -> None:
        top = max(
            (max(r.hash_ids, default=-1) for s in workload.sessions for r in s.all_requests()),
            default=-1,
        )
        self._next = top + 1

    def ids_for(self, r: Request, block_size: int) -> list[int]:
        """`r`'s hash ids as a capture writes them: every block, a partial last one included."""
        ids = list(r.hash_ids)
        if len(ids) == r.in_tokens // block_size and r.in_tokens % block_size:
            ids.append(self._next)
            self._next += 1
        return ids


def session_to_agentx(s: Session, partial: PartialBlockIds) -> dict[str, Any]:
    """A session as an AgentX/Weka object (inner times absolute, as current captures write)."""
    return {
        "id": s.id,
        "models": list(s.models),
        "block_size": s.block_size,
        "hash_id_scope": "global" if s.hash_scope == "global" else "local",
        "tool_tokens": s.tool_tokens,
        "system_tokens": s.system_tokens,
        "requests": [_item_to_agentx(i, s.block_size, partial) for i in s.items],
    }


def _item_to_agentx(
    item: Request | Subagent, block_size: int, partial: PartialBlockIds
) -> dict[str, Any]:
    if isinstance(item, Request):
        d: dict[str, Any] = {
            "t": item.t,
            "type": item.type,
            "model": item.model,
            "in": item.in_tokens,
            "out": item.out_tokens,
            "hash_ids": partial.ids_for(item, block_size),
            "input_types": item.input_types,
            "output_types": item.output_types,
            "stop": item.stop,
        }
        if item.api_time is not None:
            d["api_time"] = item.api_time
        if item.think_time is not None:
            d["think_time"] = item.think_time
        if item.ttft is not None and item.type == "s":
            d["ttft"] = item.ttft
        return d
    duration_ms = None if item.duration_s is None else round(item.duration_s * 1000.0)
    return {
        "t": item.t,
        "type": "subagent",
        "agent_id": item.agent_id,
        "subagent_type": item.subagent_type,
        "duration_ms": duration_ms,
        "total_tokens": item.total_tokens,
        "tool_use_count": item.tool_use_count,
        "status": item.status,
        "requests": [_item_to_agentx(i, block_size, partial) for i in item.items],
        "models": list(item.models),
        "tool_tokens": item.tool_tokens,
        "system_tokens": item.system_tokens,
    }


def lossy_fields(workload: Workload) -> list[str]:
    """What AgentX JSON cannot hold for this workload (the export warns about each)."""
    lost: set[str] = set()
    for s in workload.sessions:
        if s.arrival_s:
            lost.add("session arrival_s (open-loop arrival offsets)")
        if s.hash_scope not in (None, "global"):
            lost.add(f"hash scope {s.hash_scope!r}")
        for r in s.all_requests():
            if r.ttft is not None and r.type == "n":
                lost.add("ttft of non-streaming ('n') requests")
        for a in s.subagents():
            if a.duration_s is not None and round(a.duration_s * 1000.0) / 1000.0 != a.duration_s:
                lost.add("sub-millisecond subagent durations")
    return sorted(lost)


def dump_agentx(workload: Workload, out: Path) -> None:
    """Write AgentX JSON: `.jsonl[.gz]` one session per line, `.json[.gz]` a single session,
    anything else a directory of `<index>_<id>.json` files (what AIPerf's loader reads)."""
    import gzip

    for what in lossy_fields(workload):
        warnings.warn(
            WorkloadWarning(f"{out}: AgentX JSON cannot hold {what}; dropped"), stacklevel=2
        )
    name = out.name
    partial = PartialBlockIds(workload)
    opener = gzip.open if name.endswith(".gz") else open
    if name.endswith((".jsonl", ".jsonl.gz")):
        with opener(out, "wb") as fh:
            for s in workload.sessions:
                fh.write(orjson.dumps(session_to_agentx(s, partial)))
                fh.write(b"\n")
        return
    if name.endswith((".json", ".json.gz")):
        if len(workload.sessions) != 1:
            raise AgentabError(
                f"{out}: a .json file holds one AgentX session and this workload has "
                f"{len(workload.sessions)}; write .jsonl or a directory"
            )
        with opener(out, "wb") as fh:
            fh.write(orjson.dumps(session_to_agentx(workload.sessions[0], partial)))
        return
    if out.is_dir() and any(p.name.endswith(TRACE_SUFFIXES) for p in out.iterdir()):
        raise AgentabError(f"{out}: directory already holds trace files; use an empty one")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AgentabError(f"{out}: cannot create directory ({exc.strerror or exc})") from None
    width = max(4, len(str(len(workload.sessions))))
    for index, s in enumerate(workload.sessions):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in s.id)[:80]
        (out / f"{index:0{width}d}_{safe}.json").write_bytes(
            orjson.dumps(session_to_agentx(s, partial))
        )

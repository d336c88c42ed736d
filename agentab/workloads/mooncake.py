"""Mooncake traces: JSONL, one request per line, each a one-request session at its arrival time.

Fields: `timestamp` (ms since trace start), `input_length`, `output_length`, optional `hash_ids`
(blocks of 512 tokens unless told otherwise). Mooncake ids are global (shared between requests:
that is the trace's prefix reuse), so sessions get `hash_scope="global"`. Mooncake lists an id
for a trailing partial block too; the model holds full blocks only, so that id is dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentab.errors import AgentabError
from agentab.workloads.checks import Ctx, check_ids, need_num, need_tokens
from agentab.workloads.model import Request, Session, Workload
from agentab.workloads.source import jsonl_lines, parse_json, read_bytes

DEFAULT_BLOCK_SIZE = 512
FIELDS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})


def load_mooncake(path: Path, block_size: int | None = None) -> Workload:
    bs = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if bs <= 0:
        raise AgentabError(f"{path}: block size must be > 0 (got {bs})")
    ctx = Ctx(str(path))
    data = read_bytes(path)
    sessions: list[Session] = []
    for lineno, line in jsonl_lines(data):
        ctx.line = lineno
        d = parse_json(line, str(path), lineno)
        if type(d) is not dict:
            ctx.fail(f"a Mooncake line must be a JSON object, got {type(d).__name__}")
        sessions.append(_parse_line(ctx, d, lineno, bs))
    if not sessions:
        raise AgentabError(f"{path}: file is empty")
    return Workload(tuple(sessions), source=str(path))


def _parse_line(ctx: Ctx, d: dict[str, Any], lineno: int, bs: int) -> Session:
    if not d.keys() <= FIELDS:
        ctx.unknown(d.keys(), FIELDS, None)
    arrival_ms = need_num(ctx, d, "timestamp", None)
    in_tokens = need_tokens(ctx, d, "input_length", None)
    out_tokens = need_tokens(ctx, d, "output_length", None)
    raw = d.get("hash_ids")
    if raw is None:
        raw = []
    elif type(raw) is not list:
        ctx.fail("field 'hash_ids' must be an array of integers")
    check_ids(ctx, raw, "hash_ids", None)
    if len(raw) > -(-in_tokens // bs):
        ctx.fail(
            f"'hash_ids' has {len(raw)} blocks of {bs} tokens ({len(raw) * bs}) but "
            f"'input_length' is {in_tokens}"
        )
    full = in_tokens // bs
    request = Request(t=0.0, in_tokens=in_tokens, out_tokens=out_tokens, hash_ids=tuple(raw[:full]))
    return Session(
        id=f"line-{lineno}",
        block_size=bs,
        items=(request,),
        arrival_s=arrival_ms / 1000.0,
        hash_scope="global",
    )

"""Field checks shared by the importers: one-line errors that say where, one warning per field.

Every importer validates what it reads with these helpers, so every malformed input ends in the
same kind of message: `<file>[:<line>]: session '<id>': request <i>[.<j>]: <what is wrong>`
(`AgentabError`, exit status 2 through the CLI). Errors are formatted only when raised, so the
helpers cost a few attribute loads per field on the fast path (importing 100k requests is a
benchmarked goal).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, NoReturn

from agentab.errors import AgentabError, AgentabWarning

Path_ = tuple[int, ...]  # index path of a request inside the session tree (0-based per list)

MAX_COUNT = 2**31 - 1
"""Largest integer any count field may hold: every record and table column can store it."""
MAX_TOKENS = 10_000_000
"""Largest prompt or output length of one request. Today's longest context windows are a few
million tokens; a value beyond this is a corrupt field, and replaying it would cost hours."""
MAX_STRING_CHARS = 1024
"""Longest string field (session id, agent id, model, stop reason, subagent type, status, a
content type). Ids and names run to tens of characters; each is copied into every record of its
requests, so a megabyte-long one would multiply into gigabytes of records."""
MAX_STRINGS = 1024
"""Most elements of a list of strings (models, input_types, output_types)."""
MAX_SUBAGENT_DEPTH = 32
"""Deepest nesting of subagents inside subagents (real traces nest one or two levels)."""
RELATIVE_TOLERANCE_S = 1.0
"""AgentX subagents: inner times earlier than the spawn by more than this are relative to the
spawn (old captures); absolute inner times never precede the spawn except by clock granularity."""


class WorkloadWarning(AgentabWarning):
    """Something in a trace was ignored (an unknown field): the import still succeeds."""


class Ctx:
    """Where the importer is: file, line (JSONL), session id. Also remembers warned fields."""

    __slots__ = ("file", "line", "session", "warned")

    def __init__(self, file: str) -> None:
        self.file = file
        self.line: int | None = None
        self.session: str | None = None
        self.warned: set[str] = set()

    def where(self, path: Path_ | None = None) -> str:
        parts = [self.file if self.line is None else f"{self.file}:{self.line}"]
        if self.session is not None:
            parts.append(f"session {self.session!r}")
        if path is not None:
            parts.append("request " + ".".join(str(i) for i in path))
        return ": ".join(parts)

    def fail(self, message: str, path: Path_ | None = None) -> NoReturn:
        raise AgentabError(f"{self.where(path)}: {message}")

    def unknown(self, keys: Iterable[str], known: frozenset[str], path: Path_ | None) -> None:
        """Warn once per unknown field name (per load), naming where it first appeared."""
        for key in keys:
            if key in known or key in self.warned:
                continue
            self.warned.add(key)
            warnings.warn(
                WorkloadWarning(f"{self.where(path)}: ignoring unknown field {shown(key)}"),
                stacklevel=2,
            )


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)` for an error line, cut to about `limit` characters: a bad field may be
    megabytes long, and the message must stay one readable line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def _typename(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def need_int(
    ctx: Ctx,
    d: dict[str, Any],
    key: str,
    path: Path_ | None,
    minimum: int = 0,
    maximum: int = MAX_COUNT,
) -> int:
    """A required integer field in [minimum, maximum] (bool is not an integer here)."""
    v = d.get(key)
    if type(v) is int:
        if v < minimum:
            if v < 0 <= minimum:
                ctx.fail(f"field {key!r} is negative ({v})", path)
            ctx.fail(f"field {key!r} must be >= {minimum} (got {v})", path)
        if v > maximum:
            ctx.fail(f"field {key!r} is out of range ({v} > {maximum:,})", path)
        return v
    if v is None and key not in d:
        ctx.fail(f"missing field {key!r}", path)
    if type(v) is float and v.is_integer():
        if abs(v) > maximum:
            ctx.fail(f"field {key!r} is out of range ({v:g} > {maximum:,})", path)
        return need_int(ctx, {key: int(v)}, key, path, minimum, maximum)
    ctx.fail(f"field {key!r} must be an integer, got {_typename(v)}", path)


def need_tokens(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None) -> int:
    """A token count of one request: an integer in [0, MAX_TOKENS]."""
    return need_int(ctx, d, key, path, 0, MAX_TOKENS)


def check_depth(ctx: Ctx, path: Path_) -> None:
    """Refuse subagents nested deeper than MAX_SUBAGENT_DEPTH (each level adds one index)."""
    if len(path) > MAX_SUBAGENT_DEPTH:
        ctx.fail(f"subagents nested more than {MAX_SUBAGENT_DEPTH} levels deep", path)


def opt_int(
    ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None, default: int | None = None
) -> int | None:
    """An optional integer >= 0: absent or null gives `default`."""
    if d.get(key) is None:
        return default
    return need_int(ctx, d, key, path)


def need_num(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None) -> float:
    """A required finite number >= 0, returned as float."""
    v = d.get(key)
    number = isinstance(v, int | float) and not isinstance(v, bool)
    if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 and math.isfinite(v):
        return float(v)
    if v is None and key not in d:
        ctx.fail(f"missing field {key!r}", path)
    if number:
        ctx.fail(f"field {key!r} must be a finite number >= 0 (got {v})", path)
    ctx.fail(f"field {key!r} must be a number, got {_typename(v)}", path)


def opt_num(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None) -> float | None:
    """An optional finite number >= 0 (absent or null: None)."""
    if d.get(key) is None:
        return None
    return need_num(ctx, d, key, path)


def need_str(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None) -> str:
    """A required string of at most MAX_STRING_CHARS characters."""
    v = d.get(key)
    if type(v) is str:
        if len(v) > MAX_STRING_CHARS:
            too_long(ctx, key, len(v), path)
        return v
    if v is None and key not in d:
        ctx.fail(f"missing field {key!r}", path)
    ctx.fail(f"field {key!r} must be a string, got {_typename(v)}", path)


def too_long(ctx: Ctx, key: str, length: int, path: Path_ | None) -> NoReturn:
    """A string field past MAX_STRING_CHARS: named, its length given, its value not echoed."""
    ctx.fail(
        f"field {key!r} is {length:,} characters long; at most {MAX_STRING_CHARS:,} are "
        "accepted (an id or a name; is the field corrupt?)",
        path,
    )


def opt_str(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None, default: str = "") -> str:
    if d.get(key) is None:
        return default
    return need_str(ctx, d, key, path)


_STR_TUPLES: dict[tuple[str, ...], tuple[str, ...]] = {}


def str_tuple(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None) -> tuple[str, ...]:
    """An optional list of strings (absent or null: empty), interned (`intern_str_tuple`)."""
    v = d.get(key)
    if v is None:
        return ()
    if type(v) is not list:
        ctx.fail(f"field {key!r} must be an array of strings, got {_typename(v)}", path)
    if len(v) > MAX_STRINGS:
        ctx.fail(
            f"field {key!r} holds {len(v):,} strings; at most {MAX_STRINGS:,} are accepted", path
        )
    try:
        known = _STR_TUPLES.get(tuple(v))
    except TypeError:  # an unhashable element: not a string
        known = None
    if known is not None:
        return known
    for x in v:
        if type(x) is not str:
            ctx.fail(f"field {key!r} must hold strings, found {_typename(x)}", path)
        if len(x) > MAX_STRING_CHARS:
            too_long(ctx, key, len(x), path)
    return intern_str_tuple(tuple(v))


def intern_str_tuple(t: tuple[str, ...]) -> tuple[str, ...]:
    """One shared object per distinct tuple of strings (validated by the caller).

    The same few lists (`["text"]`, `["thinking", "tool_use"]`) repeat on every request, so
    100k requests hold a handful of tuples instead of 200k."""
    known = _STR_TUPLES.get(t)
    if known is not None:
        return known
    if len(_STR_TUPLES) < 4096:
        _STR_TUPLES[t] = t
    return t


def session_header(
    ctx: Ctx, obj: object, fields: frozenset[str]
) -> tuple[dict[str, Any], str, int]:
    """A session object's checked header: the dict, its id (also set on `ctx`) and block size.

    Shared by the AgentX and native readers, so both name a bad session the same way.
    """
    if type(obj) is not dict:
        ctx.fail(f"a session must be a JSON object, got {type(obj).__name__}")
    d: dict[str, Any] = obj
    sid = d.get("id")
    if type(sid) is not str or not sid:
        ctx.fail("session field 'id' must be a non-empty string")
    if len(sid) > MAX_STRING_CHARS:  # checked before the id names the session in errors
        too_long(ctx, "id", len(sid), None)
    ctx.session = sid
    if not d.keys() <= fields:
        ctx.unknown(d.keys(), fields, None)
    return d, sid, need_int(ctx, d, "block_size", None, minimum=1)


def need_list(ctx: Ctx, d: dict[str, Any], key: str, path: Path_ | None) -> list[Any]:
    v = d.get(key)
    if type(v) is list:
        return v
    if v is None and key not in d:
        ctx.fail(f"missing field {key!r}", path)
    ctx.fail(f"field {key!r} must be an array, got {_typename(v)}", path)


def check_ids(ctx: Ctx, ids: list[Any], key: str, path: Path_ | None) -> None:
    """Every element a non-negative integer (the caller checks only ids it has not seen)."""
    for x in ids:
        if type(x) is not int or x < 0:
            ctx.fail(f"field {key!r} must hold integers >= 0, found {shown(x)}", path)


def chained_ids(
    ctx: Ctx,
    raw: list[Any],
    prev_raw: list[Any] | None,
    prev_ids: tuple[int, ...],
    key: str,
    path: Path_ | None,
) -> tuple[int, ...]:
    """`raw` as a tuple of ids, validating only what the previous request did not already have.

    Agent prompts grow by suffix, so a request's ids usually start with all of its predecessor's:
    comparing the two lists runs in C and the shared prefix reuses the predecessor's tuple (and
    its int objects), which keeps 100k-request imports fast and small in memory.
    """
    if prev_raw is not None:
        n = len(prev_raw)
        if n and len(raw) >= n and raw[:n] == prev_raw:
            tail = raw[n:]
            check_ids(ctx, tail, key, path)
            return prev_ids + tuple(tail)
    check_ids(ctx, raw, key, path)
    return tuple(raw)


def full_block_ids(
    ctx: Ctx, raw: list[Any], block_size: int, in_tokens: int, path: Path_ | None, key: str
) -> list[Any]:
    """The ids of a prompt's full blocks, from a list that may also name its partial last block.

    Captures (and AIPerf, and `convert --to agentx`) hash every block of a prompt, the partial
    last one included: ceil(in / block_size) ids. The model keeps full blocks only, so that id
    is checked and dropped; more ids than the prompt has blocks is an error.
    """
    full = in_tokens // block_size
    if len(raw) <= full:
        return raw
    if len(raw) > -(-in_tokens // block_size):
        ctx.fail(
            f"{key!r} has {len(raw)} blocks of {block_size} tokens but 'in' is {in_tokens} "
            f"(at most {-(-in_tokens // block_size)} blocks, a partial last one included)",
            path,
        )
    check_ids(ctx, raw[full:], key, path)
    return raw[:full]


def check_blocks(
    ctx: Ctx, n_ids: int, block_size: int, in_tokens: int, path: Path_ | None, key: str
) -> None:
    """Hash ids name full blocks of the prompt only: they may not cover more than `in` tokens."""
    if n_ids * block_size > in_tokens:
        ctx.fail(
            f"{key!r} has {n_ids} blocks of {block_size} tokens ({n_ids * block_size}) "
            f"but 'in' is {in_tokens}",
            path,
        )

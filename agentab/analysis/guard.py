"""The manifest guard: two sides of a comparison may differ only in the decode backend.

A speedup measured with 16 GPUs in one arm and 8 in the other measures the GPU count as much as
the decode path. This guard makes that mistake impossible by default: it flattens every
run's manifest to dotted fields, and any field whose values differ between side A and side B
(or among one side's own runs) refuses the comparison, naming each field in one line, the most
consequential first (GPU count, GPU type, TP, model, dtypes, KV cache dtype, spec config,
workload, replay options, engine and profile versions). `allow` accepts named fields (a prefix
accepts its sub-fields: `replay` accepts `replay.concurrency`), and the report then says in its
first line that the comparison is confounded by them.

Fields that differ between runs by design are never compared (EXCLUDED_FIELDS and
EXCLUDED_LEAVES below; docs/analysis.md lists them with the reason for each). The decode
backend itself is the tested variable: every field named `decode_backend` is skipped, and string
values are compared with any `"decode_backend": "<value>"` or `decode_backend=<value>` fragment
(and any `--port N`) masked, so a vLLM command line that differs only in its
`--additional-config` (or its port) is not a difference.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from agentab.errors import AgentabError

# Identity and outcome of one run, not the system under test.
EXCLUDED_FIELDS: frozenset[str] = frozenset(
    {
        "arm",  # the arm's name: differs by definition
        "arm_index",
        "repeat",  # which repeat of an experiment this run was
        "run_index",
        "run_id",
        "run_dir",
        "experiment",  # the experiment's name (same-config runs of two experiments may compare)
        "started_at",
        "finished_at",
        "ended_at",
        "wall_s",
        "elapsed_s",
        "gpu_ids",  # which physical devices (count and type are compared)
        "url",  # where the arm's server listened (attach mode: necessarily two URLs)
        "server_url",
        "targets",  # the URLs of the server's replicas (their count, `replicas`, is compared)
        "pid",
        "hostname",
        "status",  # outcome of the run, not its configuration
        "stats",  # the run's counters (requests finished, errors, ...)
        "writer",  # the process that wrote the run dir (pid, host)
        "placement",  # where an experiment's run executed (pool worker, Ray node)
        "clients",  # the replay client processes' load and lag (checked on their own)
        "clock_t0",  # the loop time at which the run started
        "workload.source",  # where the workload was read from; its content hash is compared
    }
)
# Any field whose last dotted component is one of these, or ends in `_seed` (`replay.seed`,
# `engine_seed`).
EXCLUDED_LEAVES: frozenset[str] = frozenset(
    {
        "seed",  # sampling seeds: repeats use seed + repeat; A/A runs vary it on purpose
        "decode_backend",  # the tested variable
        "prompt_salt",  # per-run cache-bust salt: runs differ in it unless one is reproduced
    }
)
# Shown in the report when they differ, although they never refuse a comparison.
NOTED_FIELDS: tuple[str, ...] = (
    "seed",
    "replay.seed",
    "replay.prompt_salt",
    "engine_seed",
    "gpu_ids",
    "url",
)

# Order of the error message: the first match of a field's name decides its rank.
_PRIORITY: tuple[tuple[str, ...], ...] = (
    ("gpu_count",),
    ("gpu_name", "gpu_type", "gpu"),
    ("tp", "tensor_parallel_size", "pp", "pipeline_parallel_size"),
    ("model",),
    ("dtype",),
    ("kv_cache_dtype", "kv_dtype"),
    ("spec", "speculative", "num_draft_tokens", "acceptance"),
    ("workload", "workload_hash"),
    ("replay",),
    ("engine", "profile", "version", "vllm", "agentab_version"),
)

_BACKEND_JSON = re.compile(r'("decode_backend"\s*:\s*)"[^"]*"')
_BACKEND_ARG = re.compile(r"(decode_backend\s*=\s*)[^\s,}'\"]+")
# The port a launched server listened on is where it ran, not what it was.
_PORT_ARG = re.compile(r"(--port[ =])\d+")
ABSENT = "<absent>"


@dataclass(frozen=True)
class Difference:
    """One manifest field whose values are not the same for every run of both sides."""

    field: str
    a: tuple[str, ...]
    b: tuple[str, ...]
    allowed: bool = False

    def describe(self) -> str:
        return f"{self.field} (A: {_show(self.a)}, B: {_show(self.b)})"

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "a": list(self.a), "b": list(self.b), "allowed": self.allowed}


def _show(values: tuple[str, ...]) -> str:
    return values[0] if len(values) == 1 else "{" + ", ".join(values) + "}"


def flatten(manifest: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become dotted fields; lists and scalars are leaf values."""
    out: dict[str, Any] = {}
    for key, value in manifest.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _excluded(field: str) -> bool:
    parts = field.split(".")
    prefixes = (".".join(parts[: i + 1]) for i in range(len(parts)))
    leaf = parts[-1]
    return (
        leaf in EXCLUDED_LEAVES
        or leaf.endswith("_seed")
        or any(p in EXCLUDED_FIELDS for p in prefixes)
    )


def _canonical(value: Any) -> str:
    """One comparable string per value, with the decode backend masked out of strings."""
    text = value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    if isinstance(text, bytes):
        text = text.decode()
    text = _BACKEND_JSON.sub(r'\1"*"', text)
    text = _PORT_ARG.sub(r"\1*", text)
    return _BACKEND_ARG.sub(r"\1*", text)


def _rank(field: str) -> tuple[int, str]:
    parts = field.split(".")
    for rank, names in enumerate(_PRIORITY):
        if any(p in names for p in parts):
            return rank, field
        if names == ("dtype",) and any(
            p.endswith("dtype") and p not in _PRIORITY[rank + 1] for p in parts
        ):
            return rank, field
    return len(_PRIORITY), field


def _values(manifests: Sequence[Mapping[str, Any]], field: str) -> tuple[str, ...]:
    return tuple(sorted({_canonical(m[field]) if field in m else ABSENT for m in manifests}))


def _is_allowed(field: str, allow: Iterable[str]) -> bool:
    return any(field == a or field.startswith(f"{a}.") for a in allow)


def manifest_differences(
    a: Sequence[Mapping[str, Any]],
    b: Sequence[Mapping[str, Any]],
    allow: Iterable[str] = (),
) -> list[Difference]:
    """Every compared field whose values differ across the runs of both sides, ranked."""
    allow = tuple(allow)
    flat_a = [flatten(m) for m in a]
    flat_b = [flatten(m) for m in b]
    fields = {f for m in (*flat_a, *flat_b) for f in m if not _excluded(f)}
    diffs = []
    for field in sorted(fields, key=_rank):
        va, vb = _values(flat_a, field), _values(flat_b, field)
        if va != vb or len(va) > 1:
            diffs.append(Difference(field, va, vb, _is_allowed(field, allow)))
    return diffs


def noted_differences(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]
) -> list[Difference]:
    """Differences in fields the guard skips by design, for the report's header."""
    flat_a = [flatten(m) for m in a]
    flat_b = [flatten(m) for m in b]
    out = []
    for field in NOTED_FIELDS:
        va, vb = _values(flat_a, field), _values(flat_b, field)
        if va != vb:
            out.append(Difference(field, va, vb, allowed=True))
    return out


def check(differences: Sequence[Difference], allow: Iterable[str] = ()) -> list[str]:
    """Raise on any difference not allowed; return the allowed (confounding) fields.

    An `allow` entry that matches no difference is an error too: a typo must not look like a
    clean comparison.
    """
    allow = tuple(allow)
    refused = [d for d in differences if not d.allowed]
    if refused:
        listed = "; ".join(d.describe() for d in refused)
        raise AgentabError(
            f"refusing to compare: the runs differ in more than decode_backend: {listed} "
            f"(hold these fixed, or pass --allow-diff FIELD to accept a confounded comparison)"
        )
    unused = [a for a in allow if not any(_is_allowed(d.field, [a]) for d in differences)]
    if unused:
        raise AgentabError(
            f"--allow-diff {', '.join(unused)}: no such difference between the runs "
            f"(differing fields: {', '.join(d.field for d in differences) or 'none'})"
        )
    return [d.field for d in differences]

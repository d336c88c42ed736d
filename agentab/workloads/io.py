"""`load` and `save`: the one entry point from a path to a Workload and back."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agentab.errors import AgentabError
from agentab.workloads.model import Workload
from agentab.workloads.source import FORMATS, detect, read_bytes

EXPORT_FORMATS = ("native", "agentx")


def load(
    path: str | Path,
    format: str | None = None,
    *,
    block_size: int | None = None,
    freeze: bool = False,
) -> Workload:
    """Read a workload; `format` is agentx|mooncake|native, detected from the content when None.

    `block_size` applies to Mooncake traces only (default 512). `.gz` files are accepted.
    Malformed input raises `AgentabError` naming the file and line or session and request.
    `freeze`: for a command whose workload lives as long as its process (see `_gc_paused`).
    """
    p = Path(path)
    if format is not None and format not in FORMATS:
        raise AgentabError(f"unknown workload format {format!r} (expected {'|'.join(FORMATS)})")
    if not p.exists():
        raise AgentabError(f"{p}: no such file or directory")
    if format is None:
        format = detect(p, None if p.is_dir() else read_bytes(p))
    if p.is_dir() and format != "agentx":
        raise AgentabError(f"{p}: a directory holds AgentX sessions, not {format}")
    with _gc_paused(freeze):
        return _load(p, format, block_size)


@contextmanager
def _gc_paused(freeze: bool = False) -> Iterator[None]:
    """Pause the cyclic garbage collector while a workload is parsed.

    Parsing allocates millions of containers (each request's hash-id tuple) that form no
    cycles; the collector's passes over them cost about a tenth of a 100k-request AgentX
    import (2.55 s -> 2.3 s measured). Each parsed line's JSON objects are still freed by
    reference counting as soon as the line is converted.

    Pausing only defers the first pass: once the collector runs again, it traverses every
    new container and each hash id in them (~0.5 s at 100k requests), and each later full
    collection traverses the workload again. With `freeze` the parsed objects go to the
    collector's permanent generation instead (`gc.freeze`, as vLLM freezes what its start-up
    built), where no collection traverses them; reference counting still frees them. Freezing
    covers every object alive at that moment, so the garbage already pending is collected
    first; an object alive then that later dies in a reference cycle is not reclaimed, which
    is why only commands whose workload lives as long as the process ask for it."""
    enabled = gc.isenabled()
    if freeze:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def _load(p: Path, format: str, block_size: int | None) -> Workload:
    if format == "agentx":
        from agentab.workloads.agentx import load_agentx

        return load_agentx(p)
    if format == "mooncake":
        from agentab.workloads.mooncake import load_mooncake

        return load_mooncake(p, block_size)
    from agentab.workloads.native import load_native

    return load_native(p)


def save(workload: Workload, path: str | Path, format: str = "native") -> None:
    """Write native JSONL, or AgentX JSON (`.jsonl`, a one-session `.json`, or a directory)."""
    p = Path(path)
    if format == "native":
        from agentab.workloads.native import dump_native

        dump_native(workload, p)
    elif format == "agentx":
        from agentab.workloads.agentx import dump_agentx

        dump_agentx(workload, p)
    else:
        raise AgentabError(f"cannot write format {format!r} (expected {'|'.join(EXPORT_FORMATS)})")

"""A digest of the code that defines the engine under test (agentab's own engines).

For a vLLM server the manifest records vLLM's version; for the simulator and the local engine
the engine *is* this package's code, and a version string does not change when that code does.
An A/B that spans several invocations (resumed runs, one device call per run) must not mix
engines: recording the digest in every run's manifest lets the comparison guard refuse runs
whose engine code differs, within an arm as between arms, naming the field `engine_source`.

The digest covers what decides a step's result and its time: the engine package (scheduler,
executors, local model, profiles) and the kernel package (layers, kernel sources, tile
configs), every `.py`, `.toml` and `.json` file under them, by relative path and content.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from agentab.digest import files_digest

_PACKAGE = Path(__file__).resolve().parents[1]
_TREES = ("engine", "kernels")
_SUFFIXES = (".py", ".toml", ".json")


@lru_cache(maxsize=1)
def engine_source_digest() -> str:
    """The digest of this install's engine and kernel sources (computed once per process)."""
    return source_digest(_PACKAGE)


def source_digest(package: Path) -> str:
    """The digest (agentab.digest) over `package`/engine and `package`/kernels."""
    paths = (
        path
        for tree in _TREES
        for path in sorted(
            p for p in (package / tree).rglob("*") if p.suffix in _SUFFIXES and p.is_file()
        )
    )
    return files_digest(package, paths)

"""The on-disk cache of compiled CuTe DSL kernels, shared by every process on a machine.

`cute.compile` traces the kernel's Python, lowers it and assembles the cubin on every call:
about a second per shape, for the dozens of shapes a local-engine server compiles at startup.
CuTe DSL's own file cache does not apply (`cute.compile` turns it off, and its key is the traced
IR, so tracing would still run), so a compiled kernel is kept here as the object file that
`export_to_c` writes (host launcher + embedded cubin, loaded again with
`cutlass.cute.runtime.load_module(..., enable_tvm_ffi=True)` through JITLink: no linker, no
tracing).

The key (sha256) covers everything the object depends on:
- the caller's key (the kernel's spec dataclasses) and the host function's module and name;
- each argument's compile-time signature (dtype, address space, alignment, shape, stride of a
  fake tensor; the type of a scalar);
- the source of every module of this package and of the host function's module;
- the compile options, CuTe DSL's compile-affecting settings (arch, debug, line info, ...),
  the nvidia-cutlass-dsl and apache-tvm-ffi versions and the machine (x86_64, aarch64).
Python's version and install paths are not part of it: an entry written by one interpreter
loads in another.

Entries are `<dir>/<key[:2]>/<key>.o` with `<key>.json` beside it (the object's sha256 and
the key's parts); both are written to temporary files and renamed into place, so a reader
never sees half an entry. An entry that is missing its sidecar, does not match its digest or
fails to load is compiled again (with a warning) and overwritten.

Where: `$AGENTAB_CACHE_DIR/cute`, by default `~/.cache/agentab/cute`. `AGENTAB_CUTE_CACHE=0`
turns it off. It is also bypassed while CuTe DSL keeps PTX / cubin / SASS (`CUTE_DSL_KEEP`):
those artifacts exist only on a freshly compiled function. Clearing it is deleting the folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT = 2  # the entry layout (2: one exported name per key); part of the key


def function_name(key: str) -> str:
    """The exported function's name in an entry: unique per key, so no two loaded kernels
    share a symbol (or anything the runtime names after it)."""
    return f"agentab_cute_{key[:32]}"


@dataclass
class CompileStats:
    """What this process's kernel compiles cost: `compiled` fresh (and stored when the cache
    is on), `from_cache` loaded from disk, `seconds` spent in both, `rejected` entries that were
    corrupt or would not load (compiled again)."""

    compiled: int = 0
    from_cache: int = 0
    seconds: float = 0.0
    rejected: int = 0

    def since(self, before: CompileStats) -> CompileStats:
        return CompileStats(
            self.compiled - before.compiled,
            self.from_cache - before.from_cache,
            self.seconds - before.seconds,
            self.rejected - before.rejected,
        )

    @property
    def kernels(self) -> int:
        return self.compiled + self.from_cache

    def describe(self) -> str:
        """One line: 'compiled N CuTe DSL kernels in X s (M from cache ...)'."""
        where = cache_dir()
        cache = f"{self.from_cache} from cache {where}" if where else "cache off"
        line = f"compiled {self.kernels} CuTe DSL kernels in {self.seconds:.1f} s ({cache}"
        if self.rejected:
            line += f", {self.rejected} unusable entries recompiled"
        return line + ")"


STATS = CompileStats()


def stats() -> CompileStats:
    """A copy of this process's counters (subtract two with `since`)."""
    return CompileStats(**asdict(STATS))


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is off."""
    if os.environ.get("AGENTAB_CUTE_CACHE", "1").strip().lower() in {"0", "false", "no", "off"}:
        return None
    root = os.environ.get("AGENTAB_CACHE_DIR") or str(Path.home() / ".cache" / "agentab")
    return Path(root) / "cute"


def _dsl_envar() -> Any:
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar


def _keeps_artifacts() -> bool:
    env = _dsl_envar()
    return bool(env.keep_ptx or env.keep_cubin or env.keep_sass)


def _dsl_settings() -> str:
    """CuTe DSL's compile-affecting settings, its runtime library named by its place in the
    wheel (cu12/lib/...) rather than by the install path."""
    parts = []
    for item in _dsl_envar().cache_key_str().split(";"):
        if item.startswith("shared_libs="):
            item = "shared_libs=" + item.split("nvidia_cutlass_dsl/")[-1]
        parts.append(item)
    return ";".join(parts)


@functools.cache
def source_digest(paths: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).name.encode())
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def _sources(host: Callable[..., Any]) -> tuple[str, ...]:
    files = {str(p) for p in Path(__file__).resolve().parent.glob("*.py")}
    module = sys.modules.get(getattr(host, "__module__", ""), None)
    if module is not None and getattr(module, "__file__", None):
        files.add(str(Path(module.__file__).resolve()))  # type: ignore[arg-type]
    return tuple(sorted(files))


@functools.cache
def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            out.append(f"{dist}={version(dist)}")
        except PackageNotFoundError:
            out.append(f"{dist}=?")
    return ";".join(out)


def _signature(arg: Any) -> str:
    """An argument's compile-time signature: a fake tensor's dtype, address space, alignment,
    shape and stride; a scalar's type (its value is a runtime argument)."""
    key = getattr(arg, "__cache_key__", None)
    if key is not None:
        return repr(key)
    return type(arg).__qualname__


def key_parts(host: Callable[..., Any], args: tuple[Any, ...], key: Any, options: str) -> dict:
    """Every part of an entry's key, by name (the sidecar records them)."""
    return {
        "format": FORMAT,
        "key": repr(key),
        "host": f"{getattr(host, '__module__', '?')}.{getattr(host, '__qualname__', '?')}",
        "args": [_signature(a) for a in args],
        "source": source_digest(_sources(host)),
        "options": options,
        "dsl": _dsl_settings(),
        "versions": _versions(),
        "machine": platform.machine(),
    }


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(obj: Path, meta: Path) -> Any:
    """The entry's function, or None when there is no entry; raises when it is unusable."""
    if not obj.exists() and not meta.exists():
        return None
    info = json.loads(meta.read_text())
    data = obj.read_bytes()
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise ValueError("the object does not match its recorded sha256")
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(obj), enable_tvm_ffi=True), function_name(obj.stem))


def _store(fn: Any, obj: Path, meta: Path, parts: dict) -> None:
    obj.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=obj.parent, prefix=f".{obj.stem}.", suffix=".o")
    os.close(fd)
    try:
        fn.export_to_c(tmp, function_name=function_name(obj.stem))
        data = Path(tmp).read_bytes()
        os.replace(tmp, obj)
    finally:
        Path(tmp).unlink(missing_ok=True)
    info = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "parts": parts}
    _write_atomic(meta, json.dumps(info, indent=1).encode())


def compile_cached(
    compile_fn: Callable[[], Any],
    host: Callable[..., Any],
    args: tuple[Any, ...],
    key: Any,
    options: str,
) -> Any:
    """`compile_fn()` (which compiles `host` for `args`), through the disk cache when `key` is
    given and the cache is on. Returns the compiled function, or the one loaded from the
    cache (a `tvm_ffi.Function` taking the same positional arguments)."""
    start = time.perf_counter()
    where = cache_dir()
    if key is None or where is None or _keeps_artifacts():
        fn = compile_fn()
        STATS.compiled += 1
        STATS.seconds += time.perf_counter() - start
        return fn
    parts = key_parts(host, args, key, options)
    name = digest(parts)
    obj = where / name[:2] / f"{name}.o"
    meta = obj.with_suffix(".json")
    try:
        loaded = _load(obj, meta)
    except Exception as e:  # a corrupt or incompatible entry: compile again, overwrite it
        warnings.warn(f"CuTe DSL kernel cache: entry {obj} unusable ({e}); compiling again",
                      stacklevel=3)  # fmt: skip
        STATS.rejected += 1
        loaded = None
    if loaded is not None:
        STATS.from_cache += 1
        STATS.seconds += time.perf_counter() - start
        return loaded
    fn = compile_fn()
    STATS.compiled += 1
    try:
        _store(fn, obj, meta, parts)
    except Exception as e:  # a full disk or a read-only folder costs the next start, no more
        warnings.warn(f"CuTe DSL kernel cache: could not store {obj} ({e})", stacklevel=3)
    STATS.seconds += time.perf_counter() - start
    return fn

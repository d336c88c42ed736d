"""The optional numba compiler, shared by the modules that carry compiled kernels.

numba is a default dependency; without it, or with AGENTAB_NUMBA=0, `jit` returns the
function unchanged, so every kernel runs as the plain Python its numpy counterpart is tested
against. `ENABLED` says which is in use; each kernel module re-exports it, so a test can switch
one module's kernels off without touching the others. `splitmix64` is the mixing step both the
engine's block hashes and the workloads' prompt tokens are built from.

The machine code is cached on disk, in a folder named by a digest of every kernel module's
source (`KERNEL_SOURCES`), not in numba's default place beside each module: numba checks a
cached function only against its own file, while a kernel here inlines kernels from other
modules (transitions_numba calls loops_numba's), so after an edit to one module the other's
cache would go on running the old code, silently or with a crash. A new digest is a new folder,
and the folders of older sources in the package's own `__pycache__` are removed.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from agentab.digest import files_digest


def _numba() -> ModuleType | None:
    """numba, unless it is missing or turned off."""
    if os.environ.get("AGENTAB_NUMBA", "1") == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    _skip_blas_probe()
    return numba


def _skip_blas_probe() -> None:
    """Load numba's array math without its BLAS probe, which imports scipy.linalg (~0.25 s,
    a quarter of numba's set-up before the first kernel runs, paid by every process).

    numba imports `numba.np.arraymath` when it sets up its compiler (the first kernel call,
    even one loaded from the disk cache), and that module's import tries `import
    scipy.linalg.cython_blas` once, only to decide whether `np.correlate` / `np.convolve` of
    floats inside compiled code go through BLAS. No kernel here calls either, nor any other
    BLAS function (np.dot and np.linalg check for scipy again when they are compiled, and
    still find it). The module is imported here with the probe's import refused; skipped when
    it is already loaded or scipy.linalg already imported (then the probe costs nothing)."""
    probe = "scipy.linalg.cython_blas"
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    sys.modules[probe] = None  # type: ignore[assignment]  # an import of it raises ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if sys.modules.get(probe, 0) is None:
            del sys.modules[probe]


_NUMBA = _numba()
ENABLED = _NUMBA is not None

_PACKAGE = Path(__file__).resolve().parent
# Every module with a `jit` kernel, and every module such a kernel reads (a called kernel or a
# global constant, which numba freezes into the machine code), with the digest that names the
# folder: tests/engine/test_numba_cache.py checks that the list is complete.
KERNEL_SOURCES = (
    "numba_jit.py",
    "digest.py",
    "engine/hashing_numba.py",
    "engine/loops_numba.py",
    "engine/price_numba.py",
    "engine/transitions_numba.py",
    "workloads/tokens_numba.py",
)
_CACHE_PREFIX = "numba-"


def kernel_source_digest(package: Path = _PACKAGE) -> str:
    """The digest (agentab.digest) over the kernel modules."""
    return files_digest(package, (Path(name) for name in KERNEL_SOURCES))


def cache_dir(package: Path = _PACKAGE) -> Path:
    """Where this install's compiled kernels live: under `$NUMBA_CACHE_DIR` when the user set
    it, else the package's `__pycache__` (beside the code, as numba's default), else, where
    that is not writable, `~/.cache/agentab`; always in a folder named by the digest."""
    folder = _CACHE_PREFIX + kernel_source_digest(package)
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / "agentab" / folder
    in_tree = package / "__pycache__"
    if os.access(in_tree if in_tree.exists() else package, os.W_OK):
        return in_tree / folder
    return Path.home() / ".cache" / "agentab" / folder


def _prepare_cache_dir() -> str:
    """The cache folder, created, with the package's folders of older sources removed (only
    this checkout's kernels were ever cached there); "" when it cannot be created, said once
    (the kernels then compile in every process: correct, only slower to start)."""
    where = cache_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(
            f"agentab: compiled kernels are not cached on disk ({where}: {err.strerror}); "
            "set NUMBA_CACHE_DIR to a writable folder",
            stacklevel=2,
        )
        return ""
    if where.parent == _PACKAGE / "__pycache__":
        for stale in where.parent.glob(_CACHE_PREFIX + "*"):
            if stale != where:
                shutil.rmtree(stale, ignore_errors=True)
    return str(where)


_CACHE_DIR = _prepare_cache_dir() if _NUMBA is not None else ""


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled to machine code (cached on disk in `cache_dir()`, GIL released), or `fn`
    itself.

    numba picks a function's cache folder when it is decorated, from `numba.config.CACHE_DIR`;
    setting it only around the decoration keeps the user's own numba functions where numba
    would put them."""
    if _NUMBA is None:
        return fn
    config = _NUMBA.config
    previous = config.CACHE_DIR
    config.CACHE_DIR = _CACHE_DIR
    try:
        compiled: Callable[..., Any] = _NUMBA.njit(cache=bool(_CACHE_DIR), nogil=True)(fn)
    finally:
        config.CACHE_DIR = previous
    return compiled


@jit
def splitmix64(z: np.uint64) -> np.uint64:
    """splitmix64's finalizer (wrapping uint64 arithmetic), as the numpy code computes it."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))

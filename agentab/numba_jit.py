"""The optional numba compiler, shared by the modules that carry compiled kernels.

numba is a default dependency; without it, or with AGENTAB_NUMBA=0, `jit` returns the
function unchanged, so every kernel runs as the plain Python its numpy counterpart is tested
against. `ENABLED` says which is in use; each kernel module re-exports it, so a test can switch
one module's kernels off without touching the others. `splitmix64` is the mixing step both the
engine's block hashes and the workloads' prompt tokens are built from.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np


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


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled to machine code (cached on disk, GIL released), or `fn` itself."""
    if _NUMBA is None:
        return fn
    compiled: Callable[..., Any] = _NUMBA.njit(cache=True, nogil=True)(fn)
    return compiled


@jit
def splitmix64(z: np.uint64) -> np.uint64:
    """splitmix64's finalizer (wrapping uint64 arithmetic), as the numpy code computes it."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))

"""Zero-filled arrays for the engine's large, long-lived buffers, on the system's base pages.

Why: numpy asks the kernel for transparent huge pages (madvise MADV_HUGEPAGE) on every array of
4 MB or more. Where the kernel honours that request with direct compaction (THP `defrag` set to
`madvise`, a common default), the first touch of each 2 MB page waits for the kernel to assemble
it: measured here, a 64 MB prefix table took 0.15-0.37 s to fill, against ~0.03 s on 4 KB pages,
and a simulation's fresh buffers (the prefix table, the free queue, the slot arrays and the
emission log as they grow) cost up to ~1 s of a 9 s run, depending on the machine's memory at
the time (benchmarks/NOTES.md, 2026-12-06). Their
accesses are scattered (hash probes) or once per step, so huge pages save them little. An
anonymous private mapping, without that advice, gets zeroed pages of the base size, faulted in
as they are first touched, and is unmapped when the array is freed. Elsewhere (or for small
arrays) this is `np.zeros`.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

# numpy's own threshold for its huge page advice (smaller arrays come from malloc's heap)
_LARGE = 4 << 20
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)


def zeros(shape: int | tuple[int, ...], dtype: type[np.generic] | np.dtype) -> np.ndarray:
    """`np.zeros(shape, dtype)`, writable and C-contiguous; from its own anonymous mapping
    when it is large (see the module's docstring)."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes < _LARGE or _PRIVATE is None or _ANONYMOUS is None:
        return np.zeros(dims, dtype=dt)
    buf = mmap.mmap(-1, nbytes, flags=_PRIVATE | _ANONYMOUS)
    return np.frombuffer(buf, dtype=dt).reshape(dims)

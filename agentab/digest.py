"""One digest of source files, for the keys that must change when code changes (the engine
source recorded in manifests, the folder of the compiled numba kernels)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path


def files_digest(root: Path, paths: Iterable[Path]) -> str:
    """sha256 (first 16 hex digits) over each file's path relative to `root` and its content,
    in the order given."""
    h = hashlib.sha256()
    for path in paths:
        h.update((root / path).relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update((root / path).read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]

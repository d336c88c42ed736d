"""The compiled kernels' disk cache follows every kernel module's source, not only its own file.

numba checks a cached function against its own source file; a kernel that inlines another
module's kernel or constant would go on running the old code after that module changed. The
cache folder is named by a digest of all kernel modules (agentab.numba_jit.KERNEL_SOURCES).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import agentab
from agentab import numba_jit

numba = pytest.importorskip("numba")  # a core dependency; absent only where it was removed

PACKAGE = Path(agentab.__file__).resolve().parent

# request_keys (hashing_numba) reads GOLDEN, a constant of loops_numba, which numba freezes
# into the machine code
KEYS = """
import json, numpy as np
from agentab.engine import hashing_numba
prompt = np.arange(1, 33, dtype=np.int64)
out = np.zeros(48, dtype=np.int64)
keys, raws = np.zeros(6, dtype=np.uint64), np.zeros(6, dtype=np.uint64)
hashing_numba.request_keys(prompt, 0, np.uint64(0), out, 0, 8, 32000, keys, raws)
print(json.dumps([hashing_numba.ENABLED, [int(k) for k in keys]]))
"""
GOLDEN = "GOLDEN = np.uint64(0x9E3779B97F4A7C15)"


def _module_file(module: str) -> str:
    """'agentab.engine.loops_numba' -> 'engine/loops_numba.py'."""
    return module.removeprefix("agentab.").replace(".", "/") + ".py"


def _agentab_imports(path: Path) -> set[str]:
    """The agentab modules a file imports (`from agentab import x` counts as agentab.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agentab"):
            if node.module == "agentab":
                found.update(f"agentab.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
    return found


def test_kernel_sources_name_every_jit_module_and_everything_its_kernels_read() -> None:
    users = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "agentab.numba_jit" in _agentab_imports(path)
    }
    assert users <= set(numba_jit.KERNEL_SOURCES)
    for name in numba_jit.KERNEL_SOURCES:
        read = {_module_file(m) for m in _agentab_imports(PACKAGE / name)}
        assert read <= set(numba_jit.KERNEL_SOURCES), name


def test_the_cache_folder_is_named_by_the_digest_and_honours_numba_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    digest = numba_jit.kernel_source_digest()
    assert len(digest) == 16
    assert numba_jit.cache_dir() == PACKAGE / "__pycache__" / f"numba-{digest}"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert numba_jit.cache_dir() == tmp_path / "agentab" / f"numba-{digest}"


def test_decorating_a_kernel_leaves_numbas_own_cache_setting_alone() -> None:
    before = numba.config.CACHE_DIR
    numba_jit.jit(lambda x: x + 1)
    assert before == numba.config.CACHE_DIR


def _run_keys(copy: Path, compiled: bool, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(copy), AGENTAB_NUMBA="1" if compiled else "0", **extra)
    return subprocess.run(
        [sys.executable, "-c", KEYS],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _keys(copy: Path, compiled: bool) -> tuple[bool, list[int]]:
    done = _run_keys(copy, compiled)
    assert done.returncode == 0, done.stderr
    enabled, keys = json.loads(done.stdout)
    return enabled, keys


def test_a_change_to_a_kernel_module_recompiles_the_kernels_that_inline_it(
    tmp_path: Path,
) -> None:
    copy = tmp_path / "site"
    shutil.copytree(PACKAGE, copy / "agentab", ignore=shutil.ignore_patterns("__pycache__"))
    first = _keys(copy, compiled=True)
    assert first[0] is True
    assert _keys(copy, compiled=True) == first  # loaded from the cache
    (old_folder,) = (copy / "agentab" / "__pycache__").glob("numba-*")
    assert list(old_folder.rglob("hashing_numba.request_keys-*.nbi"))

    loops = copy / "agentab" / "engine" / "loops_numba.py"
    assert loops.read_text().count(GOLDEN) == 1
    loops.write_text(loops.read_text().replace(GOLDEN, "GOLDEN = np.uint64(0x9E3779B97F4A7C17)"))
    changed = _keys(copy, compiled=True)
    assert changed[1] != first[1]  # a cache of hashing_numba's own file would give first's
    assert _keys(copy, compiled=False) == (False, changed[1])
    (folder,) = (copy / "agentab" / "__pycache__").glob("numba-*")
    assert folder != old_folder  # the older sources' folder is gone


def test_an_unwritable_cache_folder_is_named_and_the_kernels_still_run(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    done = _run_keys(PACKAGE.parent, compiled=True, NUMBA_CACHE_DIR=str(blocker))
    assert done.returncode == 0, done.stderr
    assert "compiled kernels are not cached on disk" in done.stderr
    assert str(blocker / "agentab") in done.stderr
    assert "set NUMBA_CACHE_DIR to a writable folder" in done.stderr
    enabled, keys = json.loads(done.stdout)
    assert enabled is True
    assert _run_keys(PACKAGE.parent, compiled=False).stdout == json.dumps([False, keys]) + "\n"

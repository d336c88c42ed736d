"""The disk cache of compiled CuTe DSL kernels (`agentab.kernels.cute.cache`), across processes.

Real compiles of the cheapest kernel (a small grouped GEMV) in fresh processes over one cache
folder; no GPU: a kernel called with CPU tensors stops at its signature check, whose message
names the compiled signature, so a fresh and a cached function can be compared by it.
Marked `gpu`: it needs the gpu extra (nvidia-cutlass-dsl), not a GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import torch
from agentab.kernels.cute.cache import stats
from agentab.kernels.cute.gemv import GemvSpec, compile_gemv

spec = GemvSpec(**json.loads(sys.argv[1]))
f = compile_gemv(spec)
args = [torch.zeros(spec.n, spec.k, dtype=torch.bfloat16),
        torch.zeros(spec.m, spec.x_cols, dtype=torch.bfloat16),
        torch.zeros(8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16),
        torch.zeros(spec.m, spec.out_cols, dtype=torch.bfloat16), torch.zeros(spec.m)]
try:
    f(*args)
    check = "ran"
except Exception as e:
    check = str(e)
s = stats()
print(json.dumps({"compiled": s.compiled, "from_cache": s.from_cache, "rejected": s.rejected,
                  "type": type(f).__name__, "check": check, "line": s.describe()}))
"""

# the uv projection's shape of the tiny preset: 4 groups of 32 x 64, one token
SPEC = {"n": 128, "k": 64, "m": 1, "x_cols": 256, "out_cols": 128, "groups": 4,
        "x_group_stride": 64}  # fmt: skip


def compile_in_child(cache: Path, spec: dict | None = None, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_KEEP"}
    environ.update(AGENTAB_CACHE_DIR=str(cache), AGENTAB_CUTE_CACHE="1", PYTHONPATH=str(REPO))
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec or SPEC)],
        env=environ, capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["stderr"] = out.stderr
    return res


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "cute").rglob("*.o"))


def test_a_second_process_loads_the_kernel_the_first_compiled(tmp_path: Path) -> None:
    first = compile_in_child(tmp_path)
    assert (first["compiled"], first["from_cache"], first["rejected"]) == (1, 0, 0)
    [obj] = entries(tmp_path)
    meta = json.loads(obj.with_suffix(".json").read_text())
    assert meta["sha256"] == hashlib.sha256(obj.read_bytes()).hexdigest()
    assert "GemvSpec(n=128, k=64, m=1" in meta["parts"]["key"]
    stored = obj.stat().st_mtime_ns

    second = compile_in_child(tmp_path)
    assert (second["compiled"], second["from_cache"], second["rejected"]) == (0, 1, 0)
    assert second["type"] == "Function"  # tvm_ffi's, loaded from the object file
    assert "1 from cache" in second["line"]
    # the same compiled signature (the check a launch runs first), and the entry left as it was
    assert "expected device_type=cuda" in first["check"]
    assert second["check"] == first["check"]
    assert entries(tmp_path) == [obj] and obj.stat().st_mtime_ns == stored


def test_a_changed_shape_or_source_misses(tmp_path: Path) -> None:
    compile_in_child(tmp_path)
    other = compile_in_child(tmp_path, {**SPEC, "m": 2})  # two tokens
    assert (other["compiled"], other["from_cache"]) == (1, 0)
    assert len(entries(tmp_path)) == 2
    assert "Tensor([2, 256], bfloat16)" in other["check"]

    # the source of the host's module is part of the key
    from agentab.kernels.cute import cache

    mod = tmp_path / "cache_probe_kernel.py"
    mod.write_text("def host():\n    return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import cache_probe_kernel as probe

        before = cache.digest(cache.key_parts(probe.host, (), ("spec",), "--opts"))
        assert before == cache.digest(cache.key_parts(probe.host, (), ("spec",), "--opts"))
        mod.write_text("def host():\n    return 2\n")
        cache.source_digest.cache_clear()  # as a new process would read them
        after = cache.digest(cache.key_parts(probe.host, (), ("spec",), "--opts"))
        assert after != before
        assert cache.digest(cache.key_parts(probe.host, (), ("spec",), "--other")) != after
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cache_probe_kernel", None)


def test_a_corrupt_entry_is_compiled_again(tmp_path: Path) -> None:
    first = compile_in_child(tmp_path)
    [obj] = entries(tmp_path)
    good = obj.read_bytes()
    obj.write_bytes(good[: len(good) // 2])  # a torn write of another tool, a bad disk

    again = compile_in_child(tmp_path)
    assert (again["compiled"], again["from_cache"], again["rejected"]) == (1, 0, 1)
    assert "unusable" in again["stderr"] and again["check"] == first["check"]
    meta = json.loads(obj.with_suffix(".json").read_text())
    assert meta["sha256"] == hashlib.sha256(obj.read_bytes()).hexdigest()  # rewritten

    # an object that matches no sidecar at all (garbage with a fresh digest) fails to load
    obj.write_bytes(b"not an object file")
    obj.with_suffix(".json").write_text(
        json.dumps({"sha256": hashlib.sha256(b"not an object file").hexdigest()})
    )
    third = compile_in_child(tmp_path)
    assert (third["compiled"], third["rejected"]) == (1, 1)
    assert compile_in_child(tmp_path)["from_cache"] == 1


def test_the_cache_can_be_turned_off(tmp_path: Path) -> None:
    off = compile_in_child(tmp_path, AGENTAB_CUTE_CACHE="0")
    assert (off["compiled"], off["from_cache"]) == (1, 0)
    assert "cache off" in off["line"]
    assert entries(tmp_path) == []


def test_the_startup_line_counts_compiles_and_loads(tmp_path: Path, monkeypatch) -> None:
    """What the local engine prints when its specialized graphs are captured."""
    from agentab.kernels.cute.cache import CompileStats

    monkeypatch.setenv("AGENTAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AGENTAB_CUTE_CACHE", "1")
    before = CompileStats(compiled=3, from_cache=1, seconds=2.0)
    after = CompileStats(compiled=4, from_cache=22, seconds=2.5, rejected=1)
    line = after.since(before).describe()
    assert line == (f"compiled 22 CuTe DSL kernels in 0.5 s (21 from cache {tmp_path / 'cute'}, "
                    "1 unusable entries recompiled)")  # fmt: skip
    monkeypatch.setenv("AGENTAB_CUTE_CACHE", "0")
    assert CompileStats(compiled=2, seconds=1.0).describe() == (
        "compiled 2 CuTe DSL kernels in 1.0 s (cache off)"
    )

"""The engine-source digest: in every agentab engine's manifest, and it tracks the code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import agentab
from agentab.analysis.guard import check, manifest_differences
from agentab.engine.sim import build_simulator
from agentab.engine.source import engine_source_digest, source_digest
from agentab.errors import AgentabError

PACKAGE = Path(agentab.__file__).resolve().parent


def test_the_simulators_manifest_carries_the_digest_of_this_install() -> None:
    digest = engine_source_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert build_simulator("gb300-tp16-kimi-k3").describe()["engine_source"] == digest
    assert source_digest(PACKAGE) == digest


def test_the_digest_changes_with_engine_or_kernel_code_and_ignores_caches(tmp_path: Path) -> None:
    copy = tmp_path / "agentab"
    for tree in ("engine", "kernels"):
        shutil.copytree(PACKAGE / tree, copy / tree, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == engine_source_digest()
    cache = copy / "engine" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "scheduler.cpython-311.pyc").write_bytes(b"compiled")
    assert source_digest(copy) == engine_source_digest()
    moe_config = next((copy / "kernels" / "moe_configs").glob("*.json"))
    moe_config.write_text(moe_config.read_text() + "\n")
    tiles_changed = source_digest(copy)
    assert tiles_changed != engine_source_digest()
    scheduler = copy / "engine" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n# changed\n")
    assert source_digest(copy) not in (engine_source_digest(), tiles_changed)


def test_runs_of_different_engine_code_are_refused_by_the_guard() -> None:
    run = {"gpu_count": 1, "model": "m", "decode_backend": "auto", "engine_source": "aaaa"}
    resumed = {**run, "engine_source": "bbbb"}
    other_arm = {**run, "decode_backend": "latency_specialized"}
    diffs = manifest_differences([run, resumed], [other_arm, other_arm])
    assert [d.field for d in diffs] == ["engine_source"]
    with pytest.raises(AgentabError, match=r"engine_source \(A: \{aaaa, bbbb\}, B: aaaa\)"):
        check(diffs)

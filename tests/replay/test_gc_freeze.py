"""The run's collector freeze and a frozen load: the run hands back only what it froze itself."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from agentab.replay import ReplayOptions, simulate_to_dir
from agentab.workloads.generator import generate, load_config


def _simulate(out: Path) -> None:
    simulate_to_dir(
        generate(load_config("agentx-coding"), 2, 7),
        engine_options={"profile": "gb300-tp16-kimi-k3"},
        replay=ReplayOptions(concurrency=2, seed=7, duration_s=20.0),
        out_dir=out,
        progress=False,
    )


def test_a_run_unfreezes_what_it_froze(tmp_path: Path) -> None:
    gc.unfreeze()
    _simulate(tmp_path / "run")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_before_the_run_outlasts_it(tmp_path: Path) -> None:
    gc.collect()
    gc.freeze()  # as load(..., freeze=True) leaves it
    try:
        _simulate(tmp_path / "run")
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_workload_is_frozen_while_the_plan_and_manifest_are_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the plan and the content hash allocates enough to start full collections; a
    workload no loader froze must already be out of their reach then."""
    import agentab.replay.api as api

    gc.unfreeze()
    seen: list[int] = []
    build_plan = api.build_plan

    def spy(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return build_plan(*args, **kwargs)

    monkeypatch.setattr(api, "build_plan", spy)
    _simulate(tmp_path / "run")
    assert len(seen) == 1 and seen[0] > 0
    assert gc.get_freeze_count() == 0

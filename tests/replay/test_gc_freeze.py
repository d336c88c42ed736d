"""The run's collector freeze and a frozen load: the run hands back only what it froze itself."""

from __future__ import annotations

import gc
from pathlib import Path

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

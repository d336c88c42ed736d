"""benchmarks/profile_sim_case.py turns py-spy's raw stacks into inclusive shares exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _module():
    path = REPO / "benchmarks" / "profile_sim_case.py"
    spec = importlib.util.spec_from_file_location("profile_sim_case", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shares_count_a_frame_once_per_sample_and_only_under_simulate_to_dir() -> None:
    profile = _module()
    root = "simulate_to_dir (/x/lib/python3.12/site-packages/agentab/replay/api.py:50)"
    loop = "_loop (/src/agentab/engine/core.py:10)"
    step = "step (/src/agentab/engine/core.py:20)"
    raw = "\n".join(
        [
            f"<module> (bench.py:1);{root};{loop};{step};{loop} 3",  # the loop recurs: once
            f"<module> (bench.py:1);{root};sleep (/usr/lib/python3.12/asyncio/tasks.py:600) 1",
            "<module> (bench.py:1);import_numba (numba/__init__.py:1) 5",  # outside the run
        ]
    )
    total, shares = profile.inclusive_shares(raw)
    assert total == 4
    assert shares == [
        (100.0, "simulate_to_dir (agentab/replay/api.py)"),
        (75.0, "step (agentab/engine/core.py)"),
        (75.0, "_loop (agentab/engine/core.py)"),
        (25.0, "sleep (asyncio/tasks.py)"),
    ]

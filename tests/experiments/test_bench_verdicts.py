"""`benchmarks/bench_verdicts.py` fans its pairs out through the product's backends: the figures
of a tiny setting are the same from one process, from a pool of two, and from Ray tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ("--aa-pairs", "2", "--effect-pairs", "1", "--effects", "0.1", "--repeats", "2",
        "--sessions", "6", "--concurrency", "2", "--duration", "2:60", "--resamples", "50",
        "--sequential-pairs", "1", "--max-blocks", "2")  # fmt: skip


def figures(tmp_path: Path, name: str, *spread: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_verdicts.py"), *TINY, *spread,
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "  3/3 pairs (" in result.stdout
    report = json.loads(out.read_text())
    assert set(report["concurrency"]) == {"2"}
    return report["concurrency"]


@pytest.mark.slow
def test_the_pool_gives_the_figures_of_one_process(tmp_path: Path) -> None:
    one = figures(tmp_path, "one", "--workers", "1")
    assert one["2"]["fixed"]["+0.00"]["pairs"] == 2
    assert one["2"]["fixed"]["+0.10"]["pairs"] == 1
    assert one["2"]["sequential"]["+0.10"]["pairs"] == 1
    assert figures(tmp_path, "two", "--workers", "2") == one


@pytest.mark.ray
@pytest.mark.slow
def test_ray_tasks_give_the_figures_of_one_process(tmp_path: Path) -> None:
    one = figures(tmp_path, "one", "--workers", "1")
    assert figures(tmp_path, "ray", "--ray", "local", "--workers", "2") == one


def test_ray_with_runs_kept_on_this_disk_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_verdicts.py"), "--ray", "local",
         "--keep", str(tmp_path / "kept")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.endswith(
        "bench_verdicts.py: error: --keep and --from keep the runs on this host's disk: "
        "not with --ray\n"
    )
    assert not (tmp_path / "kept").exists()

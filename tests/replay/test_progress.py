"""Progress outside a terminal: plain lines at a fixed wall-time interval and one at the end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentab.workloads.generator import generate, load_config
from agentab.workloads.io import save

LINE = re.compile(
    r"simulate (?P<dir>\S+): (?:warmup|profiling (?P<window>[\d,]+)/1,800s), t=[\d,]+s "
    r"done (?P<done>[\d,]+) in flight (?P<inflight>[\d,]+) errors 0 \(0\.0%\) [\d,]+ tok/s"
)


def simulate(workload: Path, out: Path, interval: str) -> subprocess.CompletedProcess[str]:
    args = ["simulate", str(workload), "--profile", "h200-tp1-kimi-shard", "--concurrency", "4"]
    return subprocess.run(
        [sys.executable, "-m", "agentab", *args, "--duration", "1800", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "AGENTAB_PROGRESS_INTERVAL_S": interval},
    )


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "w.jsonl"
    save(generate(load_config("agentx-coding"), 20, 3), path)
    return path


def test_a_run_outside_a_terminal_prints_progress_lines(workload: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = simulate(workload, out, "0.1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.endswith("\n")
    lines = proc.stderr.splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    assert len(lines) >= 2  # at least one line during the run (it takes well over 0.1 s)
    assert {m["dir"] for m in matches if m} == {str(out)}
    last = matches[-1]
    assert last is not None
    stats = json.loads((out / "manifest.json").read_text())["stats"]
    assert (last["window"], last["inflight"]) == ("1,800", "0")
    assert int(last["done"].replace(",", "")) == stats["finished"]


def test_a_bad_progress_interval_is_one_line_before_the_run(workload: Path, tmp_path: Path) -> None:
    proc = simulate(workload, tmp_path / "run", "soon")
    assert proc.returncode == 2
    assert proc.stderr == (
        "agentab: error: AGENTAB_PROGRESS_INTERVAL_S must be a number of seconds > 0, got 'soon'\n"
    )
    assert not (tmp_path / "run").exists()

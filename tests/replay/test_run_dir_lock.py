"""Two replays into one run dir: the second is refused while the first runs, and the first's
records stay its own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from agentab.rundir import scan_records
from agentab.workloads import save
from agentab.workloads.generator import apply_overrides, generate, load_config
from tests.serving import served

SMALL = {"output_median": 12, "output_max": 64, "suffix_median": 20, "suffix_max": 200}


def test_a_second_replay_into_a_run_dir_in_use_is_refused(tmp_path: Path) -> None:
    config = apply_overrides(load_config("agentx-coding"), SMALL, "test").validate()
    workload = tmp_path / "w.jsonl"
    save(generate(config, 4, 5), workload)
    out = tmp_path / "run"
    sim = ("--engine", "sim", "--profile", "gb300-tp16-kimi-k3", "--decode-backend", "auto")
    with served(*sim) as url:
        args = [sys.executable, "-m", "agentab", "replay", str(workload), "--url", url]
        args += ["--out", str(out), "--concurrency", "2", "--duration", "4", "--quiet"]
        first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (out / "manifest.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            second = subprocess.run(args, capture_output=True, text=True, timeout=60)
            assert first.poll() is None  # refused while the first was still running
        finally:
            _stdout, stderr = first.communicate(timeout=300)
    assert second.returncode == 2
    assert second.stderr == (
        f"agentab: error: {out}: in use by another agentab replay (pid {first.pid}); wait for "
        "it to end, or choose another --out\n"
    )
    assert first.returncode == 0, stderr
    ids = scan_records(out).select("request_id").collect()["request_id"]
    assert ids.len() > 0 and ids.is_unique().all()

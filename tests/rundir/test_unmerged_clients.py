"""A sharded run dir whose clients' records are still under `clients/`: opening it while its
replay runs is refused in one line (the replay holds the dir's lock), and nothing is merged."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path


def test_a_run_dir_still_written_by_its_replay_is_not_merged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "clients" / "0" / "records").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"status": "running"}))
    with (run / ".agentab.lock").open("w") as lock:  # held as a running replay holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        result = subprocess.run(
            [sys.executable, "-m", "agentab", "report", str(run)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: {run}: its replay is still running (pid {os.getpid()}); its "
        "clients' records are merged into records/ when it ends\n"
    )
    assert sorted(p.name for p in run.iterdir()) == [".agentab.lock", "clients", "manifest.json"]

"""`benchmarks/bench_replay_clients.py`: its rows as JSON, and a SIGTERM that ends it ends the
`agentab serve` it started too (a real server process, a real signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_replay_clients.py"
TINY = ("--lanes", "4", "--sessions", "8", "--out-tokens", "50")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_the_rows_are_written_as_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--clients", "1", "2", "--duration", "3",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["cores"] == os.cpu_count()
    rows = report["rows"]
    assert [(r["lanes"], r["clients"]) for r in rows] == [(4, 1), (4, 2)]
    assert rows[0]["vs_first"] == 1.0
    for row in rows:
        assert row["bound"] in {"server", "client", "host", "-"}
        assert row["chunks_per_s"] > 0 and row["itl_requests"] > 0
        assert 0 <= row["server_cores"] <= 1.5 and row["client_cores"] >= 0
    printed = [line for line in result.stdout.splitlines() if line.startswith("lanes ")]
    assert len(printed) == 2 and all("; bound: " in line for line in printed)


@pytest.mark.slow
def test_sigterm_ends_the_server_it_started(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY, "--clients", "2", "--duration", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while "serving on" not in line:
        assert line, proc.communicate()
        line = proc.stdout.readline()
    server = int(line.rsplit("(pid ", 1)[1].rstrip(")\n"))
    assert alive(server)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not alive(server)  # stopped and waited for by the script


@pytest.mark.slow
def test_a_run_against_two_replicas_matches_each_request_to_its_replica(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--clients", "2", "--replicas", "2",
         "--duration", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["lanes"], row["replicas"], row["clients"]) == (4, 2, 2)
    # every request's ITL was compared with the emissions of the replica that served it
    assert row["itl_requests"] > 0 and row["itl_error_p50_pct"] < 50
    assert 0 <= row["server_core_max"] <= row["server_cores"] <= 2.5
    assert row["client_us_per_chunk"] > 0

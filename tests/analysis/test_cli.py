"""`agentab report` and `agentab compare` as a user runs them (subprocess, exit codes, stderr)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .rundirs import manifest, synthetic_records, write_run


def agentab(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentab", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    return {
        "a": write_run(root / "a", synthetic_records(1), manifest()),
        "b": write_run(
            root / "b",
            synthetic_records(1, itl_scale=0.8),
            manifest(decode_backend="latency_specialized", arm="latency_specialized"),
        ),
        "b8": write_run(
            root / "b8",
            synthetic_records(1, itl_scale=0.8),
            manifest(decode_backend="latency_specialized", arm="ls-8gpu", gpu_count=8),
        ),
    }


def test_report_prints_the_table_and_writes_summary_json(runs: dict[str, Path]) -> None:
    result = agentab("report", runs["a"])
    assert result.returncode == 0, result.stderr
    assert "P90 interactivity = 1/P90(ITL)" in result.stdout
    summary = json.loads((runs["a"] / "summary.json").read_text())
    assert summary["requests_ok"] == 160
    assert f"{summary['p90_interactivity_tok_s']:,.1f}" in result.stdout


def test_compare_json_has_metrics_and_guard(runs: dict[str, Path]) -> None:
    # One run per arm: the effect is measured, the verdict withheld.
    result = agentab("compare", runs["a"], runs["b"], "--json", "--resamples", "500")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    headline = data["metrics"]["p90_interactivity_tok_s"]
    assert set(headline) >= {"a", "b", "ratio", "ci_low", "ci_high", "verdict", "n_a", "n_b"}
    assert headline["ratio"] == pytest.approx(1 / 0.8)
    assert headline["verdict"] == "no verdict"
    assert data["guard"] == []


def test_compare_of_two_repeats_per_arm_gives_a_verdict(tmp_path: Path) -> None:
    for k in range(2):
        write_run(tmp_path / "a" / f"run-{k}", synthetic_records(1 + k), manifest(repeat=k))
        write_run(
            tmp_path / "b" / f"run-{k}",
            synthetic_records(1 + k, itl_scale=0.8),
            manifest(decode_backend="latency_specialized", arm="ls", repeat=k),
        )
    result = agentab("compare", tmp_path / "a", tmp_path / "b", "--json", "--resamples", "500")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["repeat_interval"] == "paired"
    assert data["metrics"]["p90_interactivity_tok_s"]["verdict"] == "better"


def test_compare_refuses_different_gpu_counts_in_one_line(runs: dict[str, Path]) -> None:
    result = agentab("compare", runs["a"], runs["b8"])
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "gpu_count (A: 16, B: 8)" in lines[0]


def test_allow_diff_marks_the_first_line_as_confounded(runs: dict[str, Path]) -> None:
    result = agentab(
        "compare", runs["a"], runs["b8"], "--allow-diff", "gpu_count", "--resamples", "200"
    )
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("**CONFOUNDED by gpu_count**")


def test_report_of_a_missing_dir_is_one_line(tmp_path: Path) -> None:
    result = agentab("report", tmp_path / "nope")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not a run dir" in result.stderr


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ("running", "running: never finalised (its process is gone: killed or crashed)"),
        ("interrupted", "interrupted: interrupted by a signal before its window ended"),
        ("error_rate", "error_rate: stopped early: its error rate exceeded --max-error-rate"),
        (None, "no status in the manifest (not written by a finished replay)"),
    ],
)
def test_unfinished_runs_are_refused_by_report_and_compare(
    tmp_path: Path, runs: dict[str, Path], status: str | None, why: str
) -> None:
    m = manifest(status=status, writer={"pid": 2**22 + 1, "host": socket.gethostname()})
    if status is None:
        del m["status"]
    bad = write_run(tmp_path / "bad", synthetic_records(1), m)
    line = (
        f"agentab: error: {bad} ({why}): refusing to report on an unfinished run "
        "(pass --allow-incomplete to use it anyway)\n"
    )
    report = agentab("report", bad)
    assert (report.returncode, report.stdout, report.stderr) == (2, "", line)
    compare = agentab("compare", runs["a"], bad)
    assert (compare.returncode, compare.stdout, compare.stderr) == (2, "", line)


def client(k: int, behind_p90: float) -> dict:
    """A `clients` entry of the manifest (agentab.replay.client_load)."""
    return {
        "client": k,
        "host": "h",
        "pid": 1,
        "lanes": 8,
        "clock_t0": 5.0,
        "requests": 100,
        "chunks": 9000,
        "wall_s": 10.0,
        "chunks_per_s": 900.0,
        "loop_lag_ms": {"p50": 1.0, "p90": 6.5, "p99": 12.5, "max": 40.0},
        "behind_plan_ms": {"p50": 2.0, "p90": behind_p90, "p99": 45.0, "max": 50.0},
    }


def test_a_run_whose_client_fell_behind_its_plan_is_refused(
    tmp_path: Path, runs: dict[str, Path]
) -> None:
    late = write_run(
        tmp_path / "late",
        synthetic_records(1),
        manifest(clients=[client(0, 3.0), client(1, 10.5), client(2, 1.0)]),
    )
    line = (
        f"agentab: error: {late}: refusing to report on this run: its replay client 2 of 3 fell "
        "behind its plan: requests sent 10.5 ms late at P90 (bound 10 ms, the replay's "
        "max_behind_plan_ms), its event loop 6.5 ms late at P90; the timings measure the "
        "client, not the server: replay with more client processes (--clients N) (pass "
        "--allow-incomplete to use it anyway)\n"
    )
    report = agentab("report", late)
    assert (report.returncode, report.stdout, report.stderr) == (2, "", line)
    compare = agentab("compare", runs["a"], late)
    assert (compare.returncode, compare.stdout, compare.stderr) == (2, "", line)
    allowed = agentab("report", late, "--allow-incomplete")
    assert allowed.returncode == 0, allowed.stderr
    # at the bound it is kept
    kept = write_run(tmp_path / "kept", synthetic_records(1), manifest(clients=[client(0, 10.0)]))
    assert agentab("report", kept).returncode == 0
    # the bound is the one the run was replayed with (a server sharing the client's cores)
    loose = manifest(clients=[client(0, 10.5)])
    loose["replay"] = {**loose.get("replay", {}), "max_behind_plan_ms": 12.0}
    assert (
        agentab("report", write_run(tmp_path / "loose", synthetic_records(1), loose)).returncode
        == 0
    )
    tight = manifest(clients=[client(0, 3.0)])
    tight["replay"] = {**tight.get("replay", {}), "max_behind_plan_ms": 2.5}
    refused = agentab("report", write_run(tmp_path / "tight", synthetic_records(1), tight))
    assert refused.returncode == 2
    assert "requests sent 3.0 ms late at P90 (bound 2.5 ms, the replay's" in refused.stderr


def test_a_run_still_in_progress_is_named_as_such(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        m = manifest(status="running", writer={"pid": live.pid, "host": socket.gethostname()})
        bad = write_run(tmp_path / "live", synthetic_records(1), m)
        result = agentab("report", bad)
    finally:
        live.kill()
        live.wait()
    assert result.returncode == 2
    assert f"({'running: still in progress'} (process {live.pid})):" in result.stderr


def test_allow_incomplete_marks_the_first_line(tmp_path: Path, runs: dict[str, Path]) -> None:
    m = manifest(status="interrupted")
    bad = write_run(tmp_path / "bad", synthetic_records(1, itl_scale=0.8), m)
    why = "interrupted: interrupted by a signal before its window ended"
    first = (
        f"**INCOMPLETE RUN(S)**: {bad} ({why}). Their records stop early; figures from them do "
        "not describe a full profiling window."
    )
    report = agentab("report", bad, "--allow-incomplete")
    assert report.returncode == 0, report.stderr
    assert report.stdout.splitlines()[0] == first
    compare = agentab("compare", runs["a"], bad, "--allow-incomplete", "--json")
    assert compare.returncode == 0, compare.stderr
    assert json.loads(compare.stdout)["incomplete_runs"] == [f"{bad} ({why})"]
    md = agentab("compare", runs["a"], bad, "--allow-incomplete", "--resamples", "200")
    assert md.stdout.splitlines()[0] == first


def test_compare_seeds_its_bootstrap_as_ab_does(runs: dict[str, Path]) -> None:
    result = agentab("compare", runs["a"], runs["b"], "--json", "--resamples", "200")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bootstrap"]["seed"] == 42


def test_report_omits_figures_the_run_did_not_measure(runs: dict[str, Path]) -> None:
    # The synthetic server marks no reasoning chunks, so there is no TTFO: no empty row.
    result = agentab("report", runs["a"])
    assert result.returncode == 0, result.stderr
    assert not any(line.startswith("| ttfo_s") for line in result.stdout.splitlines())
    assert "Not measured in this run: ttfo_s." in result.stdout.splitlines()

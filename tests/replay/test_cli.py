"""`agentab simulate` / `agentab replay` command lines: run dirs, manifests, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from agentab.replay.manifest import REQUIRED_KEYS
from agentab.rundir import RECORD_SCHEMA, scan_metrics, scan_records
from agentab.workloads import save
from agentab.workloads.generator import generate, load_config


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wl") / "agentx.jsonl"
    save(generate(load_config("agentx-coding"), 6, 3), path)
    return path


def agentab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentab", *args], capture_output=True, text=True, timeout=300
    )


def test_simulate_writes_a_complete_run_dir(workload: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim"
    proc = agentab(
        "simulate",
        str(workload),
        "--profile",
        "h200-tp1-kimi-shard",
        "--concurrency",
        "3",
        "--duration",
        "120",
        "--scrape-metrics",
        "--arm",
        "A",
        "--out",
        str(out),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}: ")
    assert "stopped by duration" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(REQUIRED_KEYS) <= set(manifest)
    assert manifest["arm"] == "A"
    assert manifest["engine"] == "agentab-sim"
    assert manifest["profile"] == "h200-tp1-kimi-shard"
    assert manifest["gpu_count"] == 1 and manifest["tp"] == 1
    assert manifest["decode_backend"] == "auto"
    assert manifest["seed"] == 42
    assert manifest["replay"]["concurrency"] == 3
    assert manifest["status"] == "completed"
    df = scan_records(out).collect()
    assert df.schema == RECORD_SCHEMA
    assert df.height == manifest["stats"]["finished"] > 0
    assert set(df["phase"].unique()) == {"warmup", "profiling"}
    assert df.filter(pl.col("phase") == "warmup").height == manifest["stats"]["warmup_requests"]
    # The 120 s window opens when the last warmup request has ended.
    window_start = manifest["stats"]["profiling_start_s"]
    last_warmup_end = df.filter(pl.col("phase") == "warmup").select(
        (pl.col("sent_s") + pl.col("chunk_times_s").list.last()).max()
    )
    assert window_start == pytest.approx(last_warmup_end.item())
    assert window_start > 0
    assert window_start + 100 < df["planned_s"].max() <= window_start + 120.0
    # One lane = one session tree at a time: warmup starts every lane at t=0.
    assert df.group_by("lane").agg(pl.col("sent_s").min())["sent_s"].to_list() == [0.0] * 3
    metrics = scan_metrics(out).collect()
    assert "vllm:prefix_cache_hits_total" in metrics["name"].to_list()
    # The same command again refuses to overwrite the run.
    again = agentab(
        "simulate", str(workload), "--profile", "h200-tp1-kimi-shard", "--out", str(out), "--quiet"
    )
    assert again.returncode == 2
    assert again.stderr.strip().endswith(
        "already holds a run (manifest.json); choose another --out"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "2", "--rate", "1"], "--concurrency is closed loop"),
        (["--start-window", "0.8", "0.2"], "start_window must be two fractions"),
        (
            ["--duration", "0"],
            "no stopping rule: give --duration, --max-requests, --lane-requests or --passes "
            "(duration_s, max_requests, lane_requests or passes in an experiment's [replay])",
        ),
        (["--decode-backend", "fast"], "'--decode-backend': 'fast' is not one of"),
        (["--concurrency", "0"], "Invalid value for '--concurrency': 0 is not in the range x>=1"),
        # the simulator's options: out of range, wrong type, unknown
        (["--max-num-seqs", "0"], "agentab: error: --max-num-seqs: expected int >= 1, got 0\n"),
        (
            ["--num-draft-tokens", "-1"],
            "agentab: error: --num-draft-tokens: expected int >= 0, got -1\n",
        ),
        (
            ["--num-draft-tokens", "2", "--acceptance-probs", "0.9,1.5"],
            "agentab: error: --acceptance-probs[1]: expected float <= 1.0, got 1.5\n",
        ),
        (["--kv-blocks", "x"], "Invalid value for '--kv-blocks': 'x' is not a valid integer."),
        (
            ["--kv-block", "8"],
            "No such option '--kv-block'. (Did you mean one of: '--block-size', ",
        ),
        (
            ["--time-scale", "1"],
            "--time-scale replays recorded session arrivals, but all 6 sessions arrive at the "
            "same time (a generated workload?), so all would start at once; use --rate or "
            "--concurrency",
        ),
    ],
)
def test_bad_options_are_one_line_errors(
    workload: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    proc = agentab(
        "simulate",
        str(workload),
        "--profile",
        "h200-tp1-kimi-shard",
        "--out",
        str(tmp_path / "x"),
        "--quiet",
        *args,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("agentab: error: ")
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_replay_unreachable_server_is_one_line(workload: Path, tmp_path: Path) -> None:
    proc = agentab(
        "replay",
        str(workload),
        "--url",
        "http://127.0.0.1:9",
        "--out",
        str(tmp_path / "r"),
        "--quiet",
    )
    assert proc.returncode == 2
    assert "cannot reach the server" in proc.stderr and "Traceback" not in proc.stderr


def test_every_workload_form_is_accepted(tmp_path: Path) -> None:
    # A directory of AgentX JSON files and a Mooncake trace with its own block size: the forms
    # `workload inspect` accepts, `simulate` and `replay` accept too.
    from agentab.workloads import load

    data = Path(__file__).resolve().parents[1] / "data"
    sessions = tmp_path / "agentx"
    sessions.mkdir()
    for name in ("joins.json", "bg-reset.json"):
        (sessions / name).write_bytes((data / "agentx" / name).read_bytes())
    proc = agentab(
        "simulate",
        str(sessions),
        "--profile",
        "h200-tp1-kimi-shard",
        "--passes",
        "1",
        "--warmup-requests",
        "0",
        "--start-window",
        "0",
        "0",
        "--out",
        str(tmp_path / "dir"),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    expected = len(list(load(sessions).sessions[0].all_requests()))
    assert json.loads((tmp_path / "dir" / "manifest.json").read_text())["workload"]["sessions"] == 2
    assert scan_records(tmp_path / "dir").collect().height >= expected
    mooncake = agentab(
        "simulate",
        str(data / "mooncake" / "sample.jsonl"),
        "--block-size",
        "16",
        "--profile",
        "h200-tp1-kimi-shard",
        "--passes",
        "1",
        "--out",
        str(tmp_path / "mc"),
        "--quiet",
    )
    assert mooncake.returncode == 0, mooncake.stderr
    assert (
        load(data / "mooncake" / "sample.jsonl", block_size=16).content_hash
        == json.loads((tmp_path / "mc" / "manifest.json").read_text())["workload_hash"]
    )

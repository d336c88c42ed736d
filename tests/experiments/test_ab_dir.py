"""`agentab ab` against real servers: the experiment dir carries no URL credentials, and a
second `ab` process on a dir in use is refused while the first completes untouched."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentab.rundir import scan_records
from tests.serving import served

SECRET = "s3cret-pw"
TINY = (
    "{ system_tokens_median = 120, tool_tokens_median = 200, first_message_median = 40, "
    "suffix_median = 20, suffix_max = 200, output_median = 12, output_max = 64, "
    "parent_turns_median = 6, parent_turns_max = 12, subagent_turns_median = 3, "
    "subagent_turns_max = 4, context_cap = 2048, tool_pause_median_s = 0.05, "
    "human_pause_median_s = 0.2, pause_max_s = 1.0 }"
)


def experiment_text(urls: tuple[str, str], duration_s: float) -> str:
    a, b = (u.replace("http://", f"http://alice:{SECRET}@") for u in urls)
    return f"""\
# the servers: {a} and {b}
name = "http-dir"
repeats = 1
seed = 3

[workload]
generate = {{ preset = "agentx-coding", sessions = 4, seed = 7, config = {TINY} }}

[gpus]
count = 16

[replay]
concurrency = 2
duration_s = {duration_s}
warmup_requests = 1

[engine]
kind = "http"

[[arms]]
decode_backend = "auto"
url = "{a}"

[[arms]]
decode_backend = "latency_specialized"
url = "{b}"
"""


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    common = ("--engine", "sim", "--profile", "gb300-tp16-kimi-k3", "--decode-backend")
    with served(*common, "auto") as a, served(*common, "latency_specialized") as b:
        yield a, b


def ab(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "agentab", "ab", *map(str, args), "--no-progress"]


def test_no_copy_in_the_experiment_dir_holds_the_password(
    servers: tuple[str, str], tmp_path: Path
) -> None:
    text = experiment_text(servers, 2.0)
    path = tmp_path / "exp.toml"
    path.write_text(text)
    out = tmp_path / "out"
    result = subprocess.run(ab(path, "-o", out), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    leaks = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []
    assert (out / "experiment.toml").read_text() == text.replace(f"alice:{SECRET}@", "<redacted>@")
    manifest = (out / "auto" / "run-1" / "manifest.json").read_text()
    assert f'"url": "{servers[0].replace("http://", "http://<redacted>@")}"' in manifest
    # the redacted copy still names this experiment: the same command resumes it, and a copy
    # that still held the password (written by an older agentab) is redacted then
    (out / "experiment.toml").write_text(text)
    again = subprocess.run(ab(path, "-o", out), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr and "2 of 2 runs complete, 0 to run" in again.stderr
    assert SECRET not in (out / "experiment.toml").read_text()


def test_a_second_ab_on_a_dir_in_use_is_refused(servers: tuple[str, str], tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(experiment_text(servers, 4.0))
    out = tmp_path / "out"
    first = subprocess.Popen(ab(path, "-o", out), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        manifest = out / "auto" / "run-1" / "manifest.json"
        deadline = time.monotonic() + 60
        while not manifest.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manifest.exists(), first.communicate()[1]
        second = subprocess.run(ab(path, "-o", out), capture_output=True, text=True, timeout=60)
        assert first.poll() is None  # the refusal came while the first was still running
    finally:
        stdout, stderr = first.communicate(timeout=300)
    assert second.returncode == 2
    assert second.stdout == ""
    assert second.stderr == (
        f"agentab: error: {out}: in use by another agentab ab (pid {first.pid}); wait for it to "
        "end, or choose another -o\n"
    )
    assert first.returncode == 0, stderr.decode()
    for arm in ("auto", "latency_specialized"):
        ids = scan_records(out / arm / "run-1").select("request_id").collect()["request_id"]
        assert ids.len() > 0 and ids.is_unique().all()
    assert (out / "report.md").read_bytes() == stdout
    # the lock went with its process: the same command now resumes the completed dir
    again = subprocess.run(ab(path, "-o", out), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "2 of 2 runs complete, 0 to run" in again.stderr

"""Every output path follows one rule: missing parent folders are created before the work
starts, and a path that cannot be written is refused then, in one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentab.outputs import RULE, prepare_output
from tests.analysis.rundirs import manifest, synthetic_records, write_run

REPO = Path(__file__).resolve().parent.parent
FIT_REPORT = REPO / "benchmarks/results/fidelity-vllm-cpu/vllm-cpu-tiny.fit.json"
ASSUMED = (
    "decode.specialized",
    "spec_decode.drafter_step_us",
    "prefill.mixed_decode_row_us",
    "engine.async_scheduling",
)


def agentab(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentab", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("outputs")
    a = write_run(root / "a", synthetic_records(1), manifest())
    b = write_run(
        root / "b",
        synthetic_records(1, itl_scale=0.8),
        manifest(decode_backend="latency_specialized", arm="latency_specialized"),
    )
    return a, b


def test_export_creates_the_parquet_files_folders(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "requests.parquet"
    result = agentab("export", runs[0], "-o", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{out}: 1 run(s)\n"
    assert out.stat().st_size > 0


def test_compare_creates_the_html_reports_folders(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "nodir" / "report.html"
    result = agentab("compare", *runs, "--html", out, "--resamples", "200")
    assert result.returncode == 0, result.stderr
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_calibrate_writes_its_profile_into_a_new_folder(tmp_path: Path) -> None:
    """The fit that used to end in a traceback after the measurement (here a refit of a
    committed report: the same fit and write, without the half minute of timing)."""
    out = tmp_path / "nodir" / "x.toml"
    args = ["calibrate", "--refit", FIT_REPORT, "-o", out]
    for name in ASSUMED:
        args += ["--allow-assumed", name]
    result = agentab(*args)
    assert result.returncode == 0, result.stderr
    assert out.is_file() and out.with_suffix(".fit.json").is_file()


def test_workload_generate_creates_its_folders(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "w.jsonl"
    result = agentab("workload", "generate", "--sessions", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    assert out.is_file()


def test_a_file_in_the_way_is_refused_before_anything_is_measured(tmp_path: Path) -> None:
    """The server does not exist: the output error comes first, so no measurement ran."""
    (tmp_path / "afile").write_text("")
    result = agentab(
        "calibrate", "-o", tmp_path / "afile" / "x.toml", "--url", "http://127.0.0.1:9"
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"agentab: error: Invalid value for '-o' / '--out': cannot create folder "
        f"{tmp_path / 'afile'}: a file is in the way (see 'agentab calibrate --help')\n"
    )


def test_a_folder_named_as_a_file_is_refused(runs: tuple[Path, Path], tmp_path: Path) -> None:
    result = agentab("export", runs[0], "-o", tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: Invalid value for '-o' / '--out': {tmp_path} is a folder; expected a "
        "file name (see 'agentab export --help')\n"
    )


def test_a_run_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("")
    result = agentab("simulate", tmp_path / "w.jsonl", "--profile", "x", "--out", tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: Invalid value for '--out': {tmp_path / 'run'} is a file; expected a "
        "folder (see 'agentab simulate --help')\n"
    )


def test_prepare_output_kinds(tmp_path: Path) -> None:
    prepare_output(tmp_path / "x" / "y" / "f.txt", "file")
    assert (tmp_path / "x" / "y").is_dir() and not (tmp_path / "x" / "y" / "f.txt").exists()
    prepare_output(tmp_path / "d1" / "d2", "dir")
    assert (tmp_path / "d1").is_dir() and not (tmp_path / "d1" / "d2").exists()
    prepare_output(tmp_path / "x", "any")
    with pytest.raises(ValueError, match="is a folder; expected a file name"):
        prepare_output(tmp_path / "x", "file")


def test_the_rule_is_in_the_top_level_help() -> None:
    result = agentab("--help")
    assert "missing parent" in result.stdout and "folders are created before a command" in (
        " ".join(result.stdout.split())
    )
    assert RULE.endswith("before the work starts.")

"""The bench's rows and table with three paths: the speedup is against the faster standard
path at each batch size, and the device script's table reads what the drivers write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agentab.kernels.bench import finish_row, table
from agentab.kernels.config import get_preset

REPO = Path(__file__).resolve().parents[2]
CFG = get_preset("k2-tp8-shard")


def _detail(touched: float) -> dict:
    return {"touched_experts": touched, "kernel_names": ["k"], "eager_kernel_breakdown": None}


def _row(batch: int, eager: float, compiled: float, special: float) -> dict:
    row = {"batch": batch, "standard_eager_us": eager, "standard_eager_kernels": 75,
           "standard_us": compiled, "standard_kernels": 24, "specialized_us": special,
           "specialized_kernels": 10}  # fmt: skip
    detail = {n: _detail(8.0 * batch) for n in ("standard-eager", "standard", "specialized")}
    return finish_row(CFG, 4096, row, detail)


def test_speedup_is_against_the_faster_standard_path() -> None:
    a = _row(1, eager=270.0, compiled=180.0, special=90.0)
    assert (a["speedup"], a["speedup_vs"]) == (2.0, "standard")
    b = _row(64, eager=1500.0, compiled=1600.0, special=1000.0)  # compiled slower here
    assert (b["speedup"], b["speedup_vs"]) == (1.5, "standard-eager")
    lines = table({"rows": [a, b]}).splitlines()
    assert lines[0].split() == ["batch", "eager_us", "standard_us", "special_us", "speedup",
                                "vs", "k_eager", "k_std", "k_spec", "MB", "roofline"]  # fmt: skip
    assert lines[1].split()[:9] == ["1", "270.0", "180.0", "90.0", "2.00", "standard", "75",
                                    "24", "10"]  # fmt: skip
    assert lines[2].split()[5] == "standard-eager"


def test_device_script_table_reads_check_and_bench_documents(tmp_path: Path) -> None:
    check = {"ok": False, "results": [
        {"path": "standard", "batch": 1, "ok": True, "out_err": 4e-3, "h1_err": 2e-3,
         "expert_mismatches": 0},
        {"path": "standard", "batch": 2, "ok": False, "error": "RuntimeError: x"},
        {"path": "specialized", "batch": 1, "ok": True, "out_err": 2e-3, "h1_err": 2e-3,
         "expert_mismatches": 0},
    ]}  # fmt: skip
    (tmp_path / "check.json").write_text(json.dumps(check))
    (tmp_path / "results.json").write_text(json.dumps({"rows": [_row(1, 270.0, 180.0, 90.0)]}))
    script = REPO / "scripts" / "gpu" / "standard_paths_table.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "check.json"), str(tmp_path / "results.json")],
        capture_output=True, text=True, check=True, cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["standard"][1:3] == ["1", "1"] and rows["specialized"][1:3] == ["1", "0"]
    assert rows["1"][5] == "standard"
    missing = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "none.json"), str(tmp_path / "no.json")],
        capture_output=True, text=True, check=True, cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    ).stdout  # fmt: skip
    assert "check: no" in missing and "bench: no" in missing

"""`agentab calibrate` then `agentab fidelity` against the real vLLM CPU build: the same flow
as benchmarks/bench_fidelity.py, smaller. The CPU machine is noisy, so the errors are
printed, not asserted; what is asserted is that both sides replayed the same requests and
every figure was produced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_fidelity import bench

pytestmark = pytest.mark.vllm


def test_calibrate_then_fidelity_at_concurrency_1_and_4(
    vllm_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTAB_VLLM_PYTHON", vllm_python)
    log = bench(tmp_path, concurrencies=[1, 4], sessions=8, steps=96)
    assert [line.split()[1] for line in log] == ["workload", "calibrate", "fidelity", "fidelity"]
    report = json.loads((tmp_path / "vllm-cpu-tiny.fit.json").read_text())
    assert report["provenance"]["engine"] == "vllm"
    assert report["scheduler"]["block_size"] == 128
    for c in (1, 4):
        result = json.loads((tmp_path / f"c{c}" / "fidelity.json").read_text())
        arm = result["arms"]["A"]
        assert arm["requests"]["measured"] == arm["requests"]["simulated"] > 0
        rows = {r["metric"]: r for r in arm["metrics"]}
        for metric in ("ITL P90 (ms)", "TTFT P90 (ms)", "E2E P90 (ms)", "cache hit ratio"):
            assert rows[metric]["error"] is not None, metric
        print(f"\nconcurrency {c}:\n" + (tmp_path / f"c{c}" / "fidelity.md").read_text())

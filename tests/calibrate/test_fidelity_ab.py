"""Both decode paths end to end against `agentab serve`: calibrate the standard path on a server
running `auto` and the specialized path on one running `latency_specialized` (the known
profile's two tables), then `agentab fidelity` with both servers as an A/B. The servers are
the simulator itself, so the replayed requests and the cache must agree exactly; times are
printed, and only the direction of the A/B (the specialized path is twice as fast per layer in
the known profile) is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentab.cli import main
from agentab.engine.profile import load_profile
from agentab.workloads.generator import generate, load_config
from agentab.workloads.native import dump_native
from tests.serving import served

TRUTH = Path(__file__).with_name("truth.toml")
WORKLOAD_CONFIG = Path(__file__).parents[2] / "benchmarks" / "fidelity" / "agentx-tiny.toml"


@pytest.mark.slow
def test_ab_fidelity_against_served_simulators(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "both-paths.toml"
    workload = tmp_path / "heldout.jsonl"
    dump_native(generate(load_config("agentx-coding", WORKLOAD_CONFIG), 2, 3), workload)
    common = ["--profile", str(TRUTH), "--max-model-len", "4096"]
    with (
        served(*common) as url_a,
        served(*common, "--decode-backend", "latency_specialized") as url_b,
    ):
        main(
            [
                "calibrate",
                "--url",
                url_a,
                "--specialized-url",
                url_b,
                "-o",
                str(profile),
                "--batches",
                "1,2,4",
                "--steps",
                "32",
                "--prefill-repeats",
                "1",
                "--quiet",
                "--allow-assumed",
                "spec_decode.drafter_step_us",
                "--allow-assumed",
                "decode.cuda_graph_max_tokens",
            ]
        )
        capsys.readouterr()
        p = load_profile(profile)
        assert p.specialized.batch_tokens.tolist() == [1.0, 2.0, 4.0]
        assert (p.specialized.layer_time_us < p.standard.layer_time_us[:3]).all()
        out = tmp_path / "fidelity"
        main(
            [
                "fidelity",
                str(workload),
                "--profile",
                str(profile),
                "--url",
                url_a,
                "--b-url",
                url_b,
                "--concurrency",
                "2",
                "-o",
                str(out),
                "--quiet",
            ]
        )
    printed = capsys.readouterr().out
    print(printed)
    result = json.loads((out / "fidelity.json").read_text())
    for arm in result["arms"].values():
        assert arm["requests"]["measured"] == arm["requests"]["simulated"] > 0
        rows = {r["metric"]: r for r in arm["metrics"]}
        assert abs(rows["cache hit ratio"]["error"]) < 0.02  # the same requests, the same cache
    ab = result["ab"]
    assert ab["measured_ratio"] > 1 and ab["predicted_ratio"] > 1
    assert "B/A P90 interactivity: measured" in printed

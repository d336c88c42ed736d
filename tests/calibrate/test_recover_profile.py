"""Calibration finds a truth it was not told: `agentab serve` runs the simulator with a known
profile behind HTTP, `agentab calibrate` times it like any server (client-side clock, real
time), and the fitted whole-step decode table matches the known one within 5%."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from agentab.cli import main
from agentab.engine.profile import load_profile
from tests.serving import served

TRUTH = Path(__file__).with_name("truth.toml")
ASSUMED = ("spec_decode.drafter_step_us", "decode.cuda_graph_max_tokens", "decode.specialized")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibrated") / "recovered.toml"
    with served("--profile", str(TRUTH), "--max-model-len", "4096") as url:
        args = ["calibrate", "--url", url, "-o", str(out), "--steps", "64", "--quiet"]
        for field in ASSUMED:
            args += ["--allow-assumed", field]
        main(args)
    return out


def test_recovers_the_decode_table_within_5_percent(calibrated: Path) -> None:
    truth, fitted = load_profile(TRUTH), load_profile(calibrated)
    t = fitted.standard
    # the timed batches, then one point from the prefill load (checked below)
    assert t.batch_tokens[:-1].tolist() == [1, 2, 4, 8, 16]
    true_step = truth.standard.step_fixed_us + truth.num_layers * np.interp(
        t.batch_tokens[:-1], truth.standard.batch_tokens, truth.standard.layer_time_us
    )
    got = t.step_fixed_us + fitted.num_layers * t.layer_time_us[:-1]
    errors = got / true_step - 1
    print("decode table error per batch:", np.round(errors, 4).tolist())
    assert np.all(np.abs(errors) < 0.05), errors
    kv_error = fitted.kv_read_us_per_context_token() / truth.kv_read_us_per_context_token() - 1
    print(f"KV read per context token: error {kv_error:+.1%}")
    assert abs(kv_error) < 0.25


def test_engine_facts_are_copied_and_assumptions_are_named(calibrated: Path) -> None:
    doc = tomllib.loads(calibrated.read_text())
    assert doc["kv_cache"]["block_size_tokens"] == 16
    assert doc["kv_cache"]["capacity_blocks"] == 20000
    assert (doc["gpu_count"], doc["tp"], doc["status"]) == (1, 1, "measured")
    text = calibrated.read_text()
    assert "cuda_graph_max_tokens = 1  # [A]" in text
    assert "drafter_step_us = 0.0  # [A]" in text
    report = json.loads(calibrated.with_suffix(".fit.json").read_text())
    assert report["assumed"] == [
        "decode.specialized",
        "spec_decode.drafter_step_us",
        "decode.cuda_graph_max_tokens",
    ]
    assert report["timing"] == "client"
    assert report["scheduler"] == {
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "kv_blocks": 20000,
    }
    assert report["provenance"]["engine"] == "agentab-sim"
    assert report["provenance"]["command"].startswith("agentab calibrate -o ")
    assert len(report["decode"]["standard"]["residuals"]) == 10

"""Calibration finds a truth it was not told: `agentab serve` runs the simulator with a known
profile behind HTTP, `agentab calibrate` times it like any server (client-side clock, real
time), and the fitted whole-step decode table matches the known one within 5%, the cost per
decode row of a mixed step within 20%, and the engine's async scheduling is copied."""

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
MIXED_ROW_US = 2000.0  # the served truth's cost per decode row of a mixed step


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("calibrated")
    out = root / "recovered.toml"
    truth = root / "truth-mixed-async.toml"  # the truth, with the two terms a GPU engine has
    truth.write_text(
        TRUTH.read_text()
        + f"mixed_decode_row_us = {MIXED_ROW_US}  # test value\n"
        + "\n[engine]\nasync_scheduling = true  # test value\n"
    )
    with served("--profile", str(truth), "--max-model-len", "4096") as url:
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
    # the engine code that was timed, as the server describes it
    from agentab.engine.source import engine_source_digest

    assert report["provenance"]["engine_source"] == engine_source_digest()
    assert f"# Engine source: {engine_source_digest()} (the digest" in text
    assert report["provenance"]["command"].startswith("agentab calibrate -o ")
    assert len(report["decode"]["standard"]["residuals"]) == 10
    assert report["engine"]["standard"]["async_scheduling"] is True
    assert "async_scheduling = true  # [E] /agentab/describe" in text


def test_recovers_the_mixed_step_cost_per_decode_row_within_20_percent(calibrated: Path) -> None:
    """Prompts of 255 tokens beside 4, 8 and 16 decode rows (three each), each step timed by
    the decode rows' gap around it: the slope over the rows is the per-row term."""
    fitted = load_profile(calibrated)
    report = json.loads(calibrated.with_suffix(".fit.json").read_text())
    mixed = report["mixed"]
    assert [r["rows"] for r in mixed["residuals"]] == [4, 8, 16]
    assert len(report["measurements"]["standard"]["mixed"]) == 9
    error = fitted.mixed_decode_row_us / MIXED_ROW_US - 1
    print(
        f"mixed step per decode row: {fitted.mixed_decode_row_us:.0f} us "
        f"(+- {mixed['us_per_decode_row']['stderr']:.0f}), error {error:+.1%}; "
        f"offset {mixed['offset_us']['value']:.0f} us"
    )
    assert abs(error) < 0.2

"""`agentab fidelity --ab`: the measurement is an A/B that already ran. The test A/B runs on the
simulator with the truth profile, so predicting it with the same profile and engine limits must
reproduce every run exactly: every error is 0 and the predicted B/A equals the measured one.
Then the same dir predicted with a profile twice as slow on the specialized path shows the
direction of the error that profile makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentab.cli import main

TRUTH = Path(__file__).with_name("truth.toml")
WORKLOAD_CONFIG = Path(__file__).parents[2] / "benchmarks" / "fidelity" / "agentx-tiny.toml"
LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "block_size": 16, "kv_blocks": 4096}

EXPERIMENT = f"""
name = "recorded"
repeats = 2
seed = 7
[workload]
generate = {{ preset = "agentx-coding", sessions = 6, seed = 3 }}
[gpus]
count = 1
[replay]
concurrency = 3
duration_s = 120.0
warmup_requests = 1
[engine]
kind = "simulator"
profile = "{TRUTH}"
{chr(10).join(f"{k} = {v}" for k, v in LIMITS.items())}
[[arms]]
decode_backend = "auto"
[[arms]]
decode_backend = "latency_specialized"
"""


def limits_flags() -> list[str]:
    return [x for k, v in LIMITS.items() for x in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(scope="module")
def ab_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recorded")
    experiment = root / "experiment.toml"
    experiment.write_text(EXPERIMENT)
    main(["ab", str(experiment), "-o", str(root / "ab")])
    return root / "ab"


def fidelity_of(ab_dir: Path, profile: Path, out: Path, capsys) -> dict:
    capsys.readouterr()
    args = ["fidelity", "--ab", str(ab_dir), "--profile", str(profile), "-o", str(out)]
    main([*args, *limits_flags(), "--quiet", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "fidelity.json").read_text())
    return printed


def test_the_profile_that_ran_the_ab_predicts_it_exactly(ab_dir: Path, tmp_path: Path, capsys):
    result = fidelity_of(ab_dir, TRUTH, tmp_path / "same", capsys)
    assert [a["arm"] for a in result["arms"].values()] == ["auto", "latency_specialized"]
    for arm in result["arms"].values():
        assert len(arm["runs"]) == 2 and len(arm["per_run"]) == 2
        assert arm["requests"]["measured"] == arm["requests"]["simulated"] > 0
        for row in arm["metrics"]:
            assert row["measured"] == row["simulated"], row
            if row["error"] is not None:
                assert row["error"] == 0.0
    ab = result["ab"]
    assert ab["measured_ratio"] == ab["predicted_ratio"] > 1.0 and ab["error"] == 0.0
    assert "B/A P90 interactivity" in (tmp_path / "same" / "fidelity.md").read_text()


def test_a_slower_specialized_profile_underpredicts_the_gain(ab_dir: Path, tmp_path: Path, capsys):
    slow = tmp_path / "slow-specialized.toml"
    specialized = "layer_time_us = [400, 500, 700, 1100, 2000, 3500]"
    text = TRUTH.read_text()
    assert text.count(specialized) == 1
    text = text.replace(specialized, "layer_time_us = [800, 1000, 1400, 2200, 4000, 7000]")
    slow.write_text(text.replace('name = "truth"', 'name = "slow-specialized"'))
    result = fidelity_of(ab_dir, slow, tmp_path / "slow", capsys)
    a_rows = {r["metric"]: r for r in result["arms"]["A"]["metrics"]}
    assert a_rows["ITL P50 (ms)"]["error"] == 0.0  # arm A runs the standard path only
    assert result["ab"]["predicted_ratio"] < result["ab"]["measured_ratio"]
    assert result["ab"]["error"] < 0


def test_the_profiles_async_scheduling_is_what_the_runs_are_simulated_with(
    ab_dir: Path, tmp_path: Path, capsys
):
    """A profile with `[engine] async_scheduling = true` simulates every recorded run
    scheduling one step ahead (each simulated run's manifest says so, the recorded ones not).
    What the mode changes is checked by the engine tests (this A/B's prompts wait behind
    prefill chunks of seconds, and its figures come out the same either way)."""
    ahead = tmp_path / "truth-async.toml"
    text = TRUTH.read_text().replace('name = "truth"', 'name = "truth-async"')
    ahead.write_text(text + "\n[engine]\nasync_scheduling = true  # test value\n")
    result = fidelity_of(ab_dir, ahead, tmp_path / "async", capsys)
    assert result["engine_options"]["profile"] == str(ahead)
    simulated = sorted((tmp_path / "async" / "simulated").glob("*/run-*"))
    recorded = sorted(ab_dir.glob("*/run-*"))
    assert len(simulated) == len(recorded) == 4
    assert all(json.loads((r / "manifest.json").read_text())["async_scheduling"] for r in simulated)
    assert not any(
        json.loads((r / "manifest.json").read_text())["async_scheduling"] for r in recorded
    )


def test_a_profile_calibrated_on_other_engine_code_is_named(ab_dir: Path, tmp_path: Path, capsys):
    """The fit report beside a profile names the engine code it timed; when the measured runs
    ran other code, the table's first line says so (and the JSON carries both)."""
    from agentab.engine.source import engine_source_digest

    ran = engine_source_digest()  # what the simulator of the recorded A/B ran
    profile = tmp_path / "truth.toml"
    profile.write_text(TRUTH.read_text())
    for calibrated_on, noted in ((ran, False), ("0123456789abcdef", True)):
        profile.with_suffix(".fit.json").write_text(
            json.dumps({"provenance": {"engine_source": calibrated_on}})
        )
        out = tmp_path / calibrated_on
        result = fidelity_of(ab_dir, profile, out, capsys)
        assert result["engine_source"] == {"profile": calibrated_on, "measured": [ran]}
        first = (out / "fidelity.md").read_text().splitlines()[0]
        note = (
            f"note: the profile was calibrated on engine source {calibrated_on}; the measured "
            f"runs ran {ran}: the errors below include the change between them"
        )
        assert (first == note) is noted, first


def test_recorded_mode_refuses_replay_flags_and_non_ab_dirs(ab_dir: Path, tmp_path: Path, capsys):
    def error(args: list[str]) -> str:
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2
        return capsys.readouterr().err.strip()

    base = ["fidelity", "--profile", str(TRUTH), "-o", str(tmp_path / "x"), *limits_flags()]
    msg = error([*base, "--ab", str(ab_dir), "--concurrency", "4", "--url", "http://x"])
    assert msg == (
        "agentab: error: --ab replays the plans its runs recorded; drop --url, --concurrency"
    )
    msg = error([*base, "--ab", str(tmp_path)])
    assert msg == (
        f"agentab: error: --ab {tmp_path}: not an `agentab ab` experiment dir (no experiment.toml)"
    )
    msg = error(base)
    assert msg == (
        "agentab: error: give WORKLOAD and --url (replay now), or --ab DIR (a recorded A/B)"
    )


def test_a_speculative_ab_is_predicted_with_the_drafts_and_acceptance_it_ran(
    tmp_path: Path, capsys
):
    """The recorded runs drafted (3 drafts at per-position rates): each is simulated with the
    same drafts and rates, read from its manifest, so the profile that ran it predicts it
    exactly; simulated without drafts it would be far off."""
    experiment = tmp_path / "spec.toml"
    spec = "num_draft_tokens = 3\nacceptance_probs = [0.8, 0.6, 0.4]\n"
    spec += '[[arms]]\ndecode_backend = "auto"'
    experiment.write_text(EXPERIMENT.replace('[[arms]]\ndecode_backend = "auto"', spec, 1))
    main(["ab", str(experiment), "-o", str(tmp_path / "ab")])
    result = fidelity_of(tmp_path / "ab", TRUTH, tmp_path / "fid", capsys)
    for arm in result["arms"].values():
        assert arm["spec"] == {"num_draft_tokens": 3, "acceptance_probs": [0.8, 0.6, 0.4]}
        assert arm["requests"]["measured"] == arm["requests"]["simulated"] > 0
        for row in arm["metrics"]:
            assert row["measured"] == row["simulated"], row
    assert result["ab"]["error"] == 0.0


LOCAL_SPEC = {
    "method": "early_exit",
    "num_speculative_tokens": 7,
    "draft_layers": 1,
    "rejection_sample_method": "synthetic",
    "synthetic_acceptance_length": 6.0,
    "synthetic_acceptance_rates": None,
}


def test_a_local_engine_runs_synthetic_acceptance_is_the_simulators(tmp_path: Path):
    """vLLM's names on the local engine, the simulator's own on its side: the same length, or
    the same per-position rates."""
    from agentab.calibrate.recorded import simulator_spec

    assert simulator_spec(tmp_path, {"spec": None}) == {}
    assert simulator_spec(tmp_path, {"spec": LOCAL_SPEC}) == {
        "num_draft_tokens": 7,
        "acceptance_length": 6.0,
    }
    rates = [0.769, 0.5914, 0.4548, 0.3498, 0.269, 0.2069, 0.1591]
    by_rates = {**LOCAL_SPEC, "synthetic_acceptance_length": None}
    by_rates["synthetic_acceptance_rates"] = rates
    assert simulator_spec(tmp_path, {"spec": by_rates}) == {
        "num_draft_tokens": 7,
        "acceptance_probs": tuple(rates),
    }


def test_greedy_acceptance_is_read_from_the_runs_counters_or_refused(tmp_path: Path):
    """Greedy verification accepts what the drafter achieved, which only the run's counters
    hold: a run without them is refused, naming it."""
    from agentab.calibrate.recorded import simulator_spec
    from agentab.errors import AgentabError

    greedy = {**LOCAL_SPEC, "rejection_sample_method": "standard"}
    greedy["synthetic_acceptance_length"] = None
    with pytest.raises(AgentabError) as exc:
        simulator_spec(tmp_path / "run-1", {"spec": greedy})
    assert str(tmp_path / "run-1") in str(exc.value)
    with pytest.raises(AgentabError) as exc:
        simulator_spec(tmp_path, {"spec": {"method": "eagle"}})
    assert "names no num_speculative_tokens" in str(exc.value)

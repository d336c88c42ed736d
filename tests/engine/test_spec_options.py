"""The local engine's `speculative_config` (vLLM's names): its errors, its flag, its file line,
and the guard that refuses arms whose speculative configs differ. No torch needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.analysis.guard import check, manifest_differences
from agentab.engine.local.launch import local_launch, serve_args
from agentab.engine.options import (
    LocalOptions,
    OptionsError,
    SpeculativeConfig,
    decode_options,
    flag_name,
    toml_name,
)
from agentab.engine.spec_decode import acceptance_length_to_rates, conditional_rates
from agentab.errors import AgentabError


def error(spec: object, name=toml_name("engine")) -> tuple[str | None, str]:
    with pytest.raises(OptionsError) as exc:
        decode_options(LocalOptions, {"preset": "tiny", "speculative_config": spec}, name=name)
    assert "\n" not in str(exc.value)
    return exc.value.field, str(exc.value)


SC = "engine.speculative_config"


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({}, "speculative_config", f"{SC}.num_speculative_tokens: missing (required)"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens",
         f"{SC}.num_speculative_tokens: expected int >= 1, got 0"),
        ({"num_speculative_tokens": 3, "k": 1}, "speculative_config.k",
         f"{SC}.k: unknown option (known: method, num_speculative_tokens, draft_layers, "
         "rejection_sample_method, synthetic_acceptance_length, synthetic_acceptance_rates)"),
        ({"num_speculative_tokens": 3, "method": "eagle"}, "speculative_config.method",
         f"{SC}.method: expected one of early_exit, got 'eagle'"),
        ({"num_speculative_tokens": 3, "rejection_sample_method": "block"},
         "speculative_config.rejection_sample_method",
         f"{SC}.rejection_sample_method: expected one of standard, synthetic, got 'block'"),
        ({"num_speculative_tokens": 3, "rejection_sample_method": "synthetic"},
         "speculative_config.rejection_sample_method",
         f"{SC}.rejection_sample_method: 'synthetic' needs exactly one of "
         "synthetic_acceptance_length or synthetic_acceptance_rates"),
        ({"num_speculative_tokens": 7, "rejection_sample_method": "synthetic",
          "synthetic_acceptance_length": 8.5}, "speculative_config.synthetic_acceptance_length",
         f"{SC}.synthetic_acceptance_length: must be in [1, 8] (1 + num_speculative_tokens), "
         "got 8.5"),
        ({"num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0},
         "speculative_config.synthetic_acceptance_length",
         f"{SC}.synthetic_acceptance_length: only with rejection_sample_method = 'synthetic'"),
        ({"num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
          "synthetic_acceptance_rates": [0.9, 0.8]},
         "speculative_config.synthetic_acceptance_rates",
         f"{SC}.synthetic_acceptance_rates: needs 3 values (one per draft position), got 2"),
        ({"num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
          "synthetic_acceptance_rates": [0.5, 0.9]},
         "speculative_config.synthetic_acceptance_rates",
         f"{SC}.synthetic_acceptance_rates: must be non-increasing, got [0.5, 0.9]"),
        ({"num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
          "synthetic_acceptance_rates": [0.9, 1.5]},
         "speculative_config.synthetic_acceptance_rates",
         f"{SC}.synthetic_acceptance_rates[1]: expected float <= 1.0, got 1.5"),
        (7, "speculative_config", f"{SC}: expected object, got 7"),
    ],
)  # fmt: skip
def test_a_bad_speculative_config_is_one_line_naming_the_sub_field(spec, field, message):
    assert error(spec) == (field, message)


def test_flags_name_it_as_the_flag():
    assert error({"num_speculative_tokens": -1}, name=flag_name)[1] == (
        "--speculative-config.num_speculative_tokens: expected int >= 1, got -1"
    )


def test_vllms_schedule_and_conditional_rates():
    """vLLM's `_acceptance_length_to_rates` and `unconditional_to_conditional_rates`."""
    assert acceptance_length_to_rates(6, 7) == (1, 1, 1, 1, 1, 0, 0)
    assert acceptance_length_to_rates(8, 7) == (1,) * 7
    assert acceptance_length_to_rates(1, 3) == (0, 0, 0)
    assert acceptance_length_to_rates(3.5, 7) == (1, 1, 0.5, 0, 0, 0, 0)
    assert conditional_rates((0.9, 0.6, 0.3, 0.0, 0.0)).tolist() == pytest.approx(
        [0.9, 2 / 3, 0.5, 0.0, 0.0], rel=1e-7
    )
    assert conditional_rates((0.9,)).dtype.name == "float32"


def test_an_arm_passes_its_config_to_its_server_as_vllms_json_flag():
    spec = {"num_speculative_tokens": 7, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 6.0}  # fmt: skip
    launch = local_launch({"preset": "tiny", "device": "cpu", "speculative_config": spec}, "auto")
    assert isinstance(launch.speculative_config, SpeculativeConfig)
    args = serve_args(launch, 8000)
    flag = args[args.index("--speculative-config") + 1]
    assert flag == (
        '{"method":"early_exit","num_speculative_tokens":7,"draft_layers":1,'
        '"rejection_sample_method":"synthetic","synthetic_acceptance_length":6.0,'
        '"synthetic_acceptance_rates":null}'
    )
    import orjson

    again = decode_options(
        LocalOptions, {"preset": "tiny", "speculative_config": orjson.loads(flag)}
    )
    assert again.speculative_config == launch.speculative_config


def test_an_experiment_names_the_line_of_a_bad_sub_table_key(tmp_path: Path):
    from agentab.experiments.experiment import load_experiment

    text = """name = "x"
[workload]
generate = { preset = "agentx-coding", sessions = 2, seed = 7 }
[gpus]
count = 1
[replay]
concurrency = 1
[engine]
kind = "local"
preset = "tiny"
device = "cpu"

[engine.speculative_config]
num_speculative_tokens = 7
rejection_sample_method = "synthetic"
synthetic_acceptance_length = 9.0

[[arms]]
decode_backend = "auto"
[[arms]]
decode_backend = "latency_specialized"
"""
    path = tmp_path / "exp.toml"
    path.write_text(text)
    with pytest.raises(AgentabError) as err:
        load_experiment(path)
    assert str(err.value) == (
        f"{path}:16: engine.speculative_config.synthetic_acceptance_length: must be in [1, 8] "
        "(1 + num_speculative_tokens), got 9.0"
    )
    path.write_text(text.replace("9.0", "6.0"))
    options = load_experiment(path).engine_options
    assert isinstance(options, LocalOptions) and options.speculative_config is not None
    assert options.speculative_config.synthetic_acceptance_length == 6.0


def test_the_guard_refuses_arms_whose_speculative_configs_differ():
    """The manifest records the engine's `spec` (the config as given and the resolved rates):
    runs whose configs differ in anything are refused, as a GPU count would be."""
    base = {"gpu_count": 1, "model": "m", "engine_source": "a", "decode_backend": "auto"}
    spec = {"method": "early_exit", "num_speculative_tokens": 7, "draft_layers": 1,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 6.0,
            "synthetic_acceptance_rates": None,
            "synthetic_rates_resolved": [1, 1, 1, 1, 1, 0, 0]}  # fmt: skip
    a = {**base, "spec": spec}
    b = {**base, "decode_backend": "latency_specialized", "spec": spec}
    assert manifest_differences([a], [b]) == []
    other = {**spec, "synthetic_acceptance_length": 5.0,
             "synthetic_rates_resolved": [1, 1, 1, 1, 0, 0, 0]}  # fmt: skip
    diffs = manifest_differences([a], [{**b, "spec": other}])
    assert [d.field for d in diffs] == ["spec.synthetic_acceptance_length",
                                        "spec.synthetic_rates_resolved"]  # fmt: skip
    with pytest.raises(AgentabError, match="refusing to compare"):
        check(diffs)
    # an arm without speculative decoding against one with it
    off = manifest_differences([a], [{**b, "spec": None}])
    assert {d.field for d in off} == {"spec", *(f"spec.{key}" for key in spec)}


def test_a_report_says_when_acceptance_is_synthetic():
    from agentab.analysis.caveats import synthetic_acceptance_caveats

    spec = {"num_speculative_tokens": 7, "rejection_sample_method": "synthetic",
            "synthetic_rates_resolved": [1, 1, 0.8, 0, 0, 0, 0]}  # fmt: skip
    manifest = {"engine": "agentab-local", "spec": spec}
    assert synthetic_acceptance_caveats([manifest, manifest]) == [
        "**Synthetic acceptance**: engine agentab-local accepts drafts by vLLM's synthetic "
        "method (7 draft tokens, per-position rates 1.00, 1.00, 0.80, 0.00, 0.00, 0.00, 0.00), "
        "not by verifying them: the A/B measures the decode paths at this acceptance, not "
        "whether a drafter reaches it on your prompts."
    ]
    greedy = {**spec, "rejection_sample_method": "standard"}
    assert synthetic_acceptance_caveats([{"engine": "agentab-local", "spec": greedy}]) == []
    assert synthetic_acceptance_caveats([{"engine": "agentab-sim", "spec": None}]) == []

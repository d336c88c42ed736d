"""Typed engine options: one decoder, whose errors are one line naming the field as given."""

from __future__ import annotations

import pytest

from agentab.engine.options import (
    DECODE_BACKENDS,
    DecodeBackend,
    LocalLaunch,
    OptionsError,
    SimulatorOptions,
    decode_options,
    flag_name,
    parse_decode_backend,
    toml_name,
)
from agentab.engine.vllm.args import VllmLaunch


def error(cls, data, name=toml_name("engine")) -> tuple[str | None, str]:
    with pytest.raises(OptionsError) as exc:
        decode_options(cls, data, name=name)
    assert "\n" not in str(exc.value)
    return exc.value.field, str(exc.value)


def test_defaults_and_none_mean_the_default() -> None:
    opts = decode_options(SimulatorOptions, {"profile": "p", "kv_blocks": None, "seed": None})
    assert opts == SimulatorOptions(profile="p")
    assert (opts.decode_backend, opts.max_num_seqs, opts.kv_blocks) == ("auto", 1024, None)
    assert opts.decode_backend is DecodeBackend.AUTO


def test_the_backend_is_one_enum_whose_values_are_what_users_write() -> None:
    assert DECODE_BACKENDS == ("auto", "latency_specialized")
    assert parse_decode_backend("latency_specialized") is DecodeBackend.LATENCY_SPECIALIZED
    assert DecodeBackend.LATENCY_SPECIALIZED.specialized
    assert not DecodeBackend.AUTO.specialized
    assert f"{DecodeBackend.AUTO}" == "auto" and DecodeBackend.AUTO == "auto"


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"decode_backend": "fast"}, "decode_backend",
         "engine.decode_backend: expected one of auto, latency_specialized, got 'fast'"),
        ({"decode_backend": 3}, "decode_backend",
         "engine.decode_backend: expected one of auto, latency_specialized, got 3"),
        ({"kv_blok": 8}, "kv_blok", "engine.kv_blok: unknown option (known: decode_backend, "
         "specialized_max_tokens, seed, profile, num_draft_tokens, acceptance_length, "
         "acceptance_probs, max_num_seqs, "
         "max_num_batched_tokens, kv_blocks, block_size, fast_forward, step_noise, run_noise, "
         "noise_seed)"),
        ({"max_num_seqs": "8"}, "max_num_seqs", "engine.max_num_seqs: expected int, got '8'"),
        ({"fast_forward": 1}, "fast_forward", "engine.fast_forward: expected bool, got 1"),
        ({"seed": True}, "seed", "engine.seed: expected int, got True"),
        ({"max_num_seqs": 0}, "max_num_seqs", "engine.max_num_seqs: expected int >= 1, got 0"),
        ({"acceptance_length": 0.5}, "acceptance_length",
         "engine.acceptance_length: expected float >= 1.0, got 0.5"),
        ({"acceptance_probs": [0.9, -0.1]}, "acceptance_probs",
         "engine.acceptance_probs[1]: expected float >= 0.0, got -0.1"),
        ({"acceptance_probs": 0.9}, "acceptance_probs",
         "engine.acceptance_probs: expected array, got 0.9"),
    ],
)  # fmt: skip
def test_a_bad_simulator_option_is_one_line_naming_it(data: dict, field: str, message: str) -> None:
    assert error(SimulatorOptions, {"profile": "p", **data}) == (field, message)


def test_the_name_is_the_callers_spelling() -> None:
    data = {"profile": "p", "num_draft_tokens": -1}
    assert error(SimulatorOptions, data, name=flag_name)[1] == (
        "--num-draft-tokens: expected int >= 0, got -1"
    )
    assert error(SimulatorOptions, data, name=str)[1] == (
        "num_draft_tokens: expected int >= 0, got -1"
    )
    assert error(SimulatorOptions, {}) == ("profile", "engine.profile: missing (required)")


def test_local_and_vllm_options_decode_the_same_way() -> None:
    launch = decode_options(LocalLaunch, {"preset": "tiny", "device": "cuda:1", "tp": 2})
    assert (launch.device, launch.tp, launch.startup_timeout_s) == ("cuda:1", 2, 600.0)
    assert error(LocalLaunch, {"preset": "tiny", "weight_sets": 0}) == (
        "weight_sets",
        "engine.weight_sets: expected int >= 1, got 0",
    )
    assert error(VllmLaunch, {"model": "m", "env": {"HF_HOME": 1}}) == (
        "env",
        "engine.env: expected str values, got {'HF_HOME': 1}",
    )
    assert error(VllmLaunch, {"model": ""}) == (
        "model",
        "engine.model: expected str of length >= 1, got ''",
    )

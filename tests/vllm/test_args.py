"""Argument lists, refusals and manifest helpers of agentab.engine.vllm (no server needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentab.engine.options import toml_name
from agentab.engine.vllm import TINY_MOE, TINY_MOE_PATH, VllmLaunch, build_args, launched_server
from agentab.engine.vllm.args import check_gpus, gpu_ids_of, redact, redact_env, resolve_model
from agentab.engine.vllm.introspect import parse_info_metric, split_config_items
from agentab.errors import AgentabError

PY_API = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")


def launch(**kw) -> VllmLaunch:
    return VllmLaunch(**{"model": "org/model", "command": PY_API, **kw})


def test_arms_differ_only_in_the_decode_backend_key() -> None:
    spec = launch(
        server_args=("--max-model-len", "2048", "--additional-config", '{"z": 1, "a": {"b": 2}}')
    )
    a = build_args(spec, "auto", 8000)
    b = build_args(spec, "latency_specialized", 8000)
    assert len(a) == len(b)
    differing = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert differing == [len(a) - 1]
    assert a[-2] == "--additional-config"
    assert a[-1] == '{"a":{"b":2},"decode_backend":"auto","z":1}'
    assert b[-1] == '{"a":{"b":2},"decode_backend":"latency_specialized","z":1}'
    assert a == [
        *PY_API,
        "--model",
        "org/model",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--enable-prefix-caching",
        "--max-model-len",
        "2048",
        "--enable-prompt-tokens-details",
        "--additional-config",
        '{"a":{"b":2},"decode_backend":"auto","z":1}',
    ]


def test_additional_config_equals_form_and_no_user_config() -> None:
    merged = build_args(launch(server_args=('--additional-config={"k":"v"}',)), "auto", 1)
    assert merged[-2:] == ["--additional-config", '{"decode_backend":"auto","k":"v"}']
    assert not any(a.startswith("--additional-config=") for a in merged)
    plain = build_args(launch(), "latency_specialized", 1)
    assert plain[-2:] == ["--additional-config", '{"decode_backend":"latency_specialized"}']


def test_prefix_caching_off_and_prompt_details_not_duplicated() -> None:
    args = build_args(
        launch(enable_prefix_caching=False, server_args=("--no-enable-prompt-tokens-details",)),
        "auto",
        1,
    )
    assert "--no-enable-prefix-caching" in args
    assert "--enable-prefix-caching" not in args
    assert "--enable-prompt-tokens-details" not in args
    assert args.count("--no-enable-prompt-tokens-details") == 1


@pytest.mark.parametrize(
    ("arg", "field"),
    [
        ("--port", "port"),
        ("--tensor-parallel-size=2", "tensor_parallel_size"),
        ("-tp", "tensor_parallel_size"),
        ("-pp", "pipeline_parallel_size"),
        ("--model", "model"),
        ("--enable-prefix-caching", "enable_prefix_caching"),
    ],
)
def test_owned_flags_are_refused(arg: str, field: str) -> None:
    with pytest.raises(AgentabError, match=f"must not contain {arg.split('=')[0]}; set `{field}"):
        launch(server_args=(arg, "2"))


@pytest.mark.parametrize(
    ("server_args", "message"),
    [
        (("--additional-config", '{"decode_backend": "auto"}'), "must not set decode_backend"),
        (("--additional-config.decode_backend=auto",), "write --additional-config.decode_backend"),
        (("--additional-config", "[1]"), "must be a JSON object"),
        (("--additional-config", "{bad"), "is not JSON"),
        (("--additional-config",), "no JSON"),
        (("--additional-config={}", "--additional-config={}"), "twice"),
    ],
)
def test_bad_additional_config_is_refused(server_args: tuple[str, ...], message: str) -> None:
    with pytest.raises(AgentabError, match=message):
        launch(server_args=server_args)


def test_unknown_decode_backend_is_refused() -> None:
    with pytest.raises(AgentabError) as err:
        build_args(launch(), "fast", 1)
    assert str(err.value) == (
        "decode_backend: expected one of auto, latency_specialized, got 'fast'"
    )


def test_gpu_layout_must_use_exactly_the_experiment_gpus() -> None:
    with pytest.raises(AgentabError) as err:
        check_gpus(launch(tensor_parallel_size=2), gpu_ids_of(1))
    assert str(err.value) == (
        "vllm launch: tensor_parallel_size 2 x pipeline_parallel_size 1 = 2 GPUs, but the "
        "experiment's gpus give 1 (0); they must be equal"
    )
    check_gpus(launch(tensor_parallel_size=2), gpu_ids_of([3, 5]))
    check_gpus(launch(tensor_parallel_size=2, pipeline_parallel_size=2), gpu_ids_of(4))
    with pytest.raises(AgentabError, match="x data_parallel_size 2 = 4 GPUs"):
        check_gpus(launch(tensor_parallel_size=2, data_parallel_size=2), gpu_ids_of(2))
    with pytest.raises(AgentabError, match="lists a device twice"):
        check_gpus(launch(tensor_parallel_size=2), [1, 1])
    assert gpu_ids_of(3) == [0, 1, 2]
    for bad in (0, True, [], [-1], ["0"]):
        with pytest.raises(AgentabError, match="gpus"):
            gpu_ids_of(bad)


def test_tp2_on_one_gpu_is_refused_before_anything_starts(tmp_path) -> None:
    marker = tmp_path / "started"
    spec = VllmLaunch(
        model="org/model",
        command=(sys.executable, "-c", f"open({str(marker)!r}, 'w')"),
        tensor_parallel_size=2,
    )
    log_dir = tmp_path / "run"
    with (
        pytest.raises(AgentabError, match="= 2 GPUs, but the experiment's gpus give 1"),
        launched_server(spec, decode_backend="auto", gpus=1, log_dir=log_dir),
    ):
        pass
    assert not marker.exists()
    assert not log_dir.exists()


def test_from_mapping_names_unknown_and_missing_keys() -> None:
    engine = toml_name("engine")
    with pytest.raises(AgentabError, match=r"^engine\.tp: unknown option \(known: model, "):
        VllmLaunch.from_mapping({"model": "m", "tp": 2}, name=engine)
    with pytest.raises(AgentabError, match=r"^engine\.model: missing \(required\)$"):
        VllmLaunch.from_mapping({}, name=engine)
    with pytest.raises(AgentabError) as err:
        VllmLaunch.from_mapping({"model": "m", "tensor_parallel_size": 0}, name=engine)
    assert str(err.value) == "engine.tensor_parallel_size: expected int >= 1, got 0"
    with pytest.raises(AgentabError) as err:
        VllmLaunch.from_mapping({"model": "m", "stop_grace_s": "5"}, name=engine)
    assert str(err.value) == "engine.stop_grace_s: expected float, got '5'"
    spec = VllmLaunch.from_mapping(
        {"model": "m", "command": "python -m x", "server_args": "--a 'b c'"}
    )
    assert spec.command == ("python", "-m", "x")
    assert spec.server_args == ("--a", "b c")


def test_builtin_model_resolves_to_the_shipped_config() -> None:
    path, served = resolve_model(TINY_MOE)
    assert path == str(TINY_MOE_PATH)
    assert served == TINY_MOE
    config = json.loads((TINY_MOE_PATH / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["vocab_size"] >= 32000  # replay's token ids span [1, 32000)
    args = build_args(VllmLaunch(model=TINY_MOE, command=PY_API), "auto", 1)
    assert args[args.index("--model") + 1] == str(TINY_MOE_PATH)
    assert args[args.index("--served-model-name") + 1] == TINY_MOE
    with pytest.raises(AgentabError, match="no built-in model 'nope' \\(shipped: tiny-qwen3-moe"):
        resolve_model("agentab:nope")
    assert resolve_model("org/model") == ("org/model", None)


def test_redaction() -> None:
    args = ["--api-key", "s3cret", "--hf-token=abc", "--skip-tokenizer-init", "--x", "1"]
    assert redact(args) == [
        "--api-key",
        "<redacted>",
        "--hf-token=<redacted>",
        "--skip-tokenizer-init",
        "--x",
        "1",
    ]
    assert redact_env({"HF_TOKEN": "t", "OPENAI_API_KEY": "k", "CUDA_VISIBLE_DEVICES": "0,1"}) == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HF_TOKEN": "<redacted>",
        "OPENAI_API_KEY": "<redacted>",
    }


def test_config_line_and_info_metric_parsing() -> None:
    items = split_config_items(
        "model='m', speculative_config=Spec(a=1, b=[2, 3]), tensor_parallel_size=2, "
        "compilation_config={'mode': 0, 'x': 'a,b'}, dtype=torch.bfloat16"
    )
    assert items == {
        "model": "m",
        "speculative_config": "Spec(a=1, b=[2, 3])",
        "tensor_parallel_size": "2",
        "compilation_config": "{'mode': 0, 'x': 'a,b'}",
        "dtype": "torch.bfloat16",
    }
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0"} 1.0\n'
    )
    assert parse_info_metric(text, "vllm:cache_config_info") == {
        "block_size": "128",
        "cache_dtype": "auto",
    }
    assert parse_info_metric(text, "vllm:other_info") is None


def test_redaction_covers_credentials_json_and_secret_looking_names() -> None:
    config = '{"decode_backend":"auto","hf":{"api_key":"k1","tokens":["t"]},"n":1}'
    assert redact(["--credentials", "c", "--additional-config", config, "--pat=x"]) == [
        "--credentials",
        "<redacted>",
        "--additional-config",
        '{"decode_backend":"auto","hf":{"api_key":"<redacted>","tokens":"<redacted>"},"n":1}',
        "--pat=<redacted>",
    ]
    assert redact(["--additional-config", '{"decode_backend":"auto"}']) == [
        "--additional-config",
        '{"decode_backend":"auto"}',
    ]
    env = {"GH_PAT": "a", "DB_PASS": "b", "X_TOKEN": "c", "S3_KEY": "d", "PATH": "/bin"}
    assert redact_env(env) == {
        "DB_PASS": "<redacted>",
        "GH_PAT": "<redacted>",
        "PATH": "/bin",
        "S3_KEY": "<redacted>",
        "X_TOKEN": "<redacted>",
    }


def test_credentials_in_a_url_never_reach_the_manifest(tmp_path: Path) -> None:
    from agentab.replay import ReplayOptions
    from agentab.replay.manifest import build_manifest
    from agentab.replay.targets.http import redact_url
    from agentab.workloads.model import Request, Session, Workload

    assert redact_url("http://user:s3cret@127.0.0.1:8000") == "http://<redacted>@127.0.0.1:8000"
    assert redact_url("https://host/v1") == "https://host/v1"
    wl = Workload((Session("s", 16, (Request(t=0.0, in_tokens=4, out_tokens=1),)),))
    manifest = build_manifest(
        wl,
        ReplayOptions(passes=1),
        tmp_path,
        target_facts={"url": "http://u:k@h:1"},
        manifest_extra={"server_url": "http://a:b@h:2/x"},
    )
    assert (manifest["url"], manifest["server_url"]) == (
        "http://<redacted>@h:1",
        "http://<redacted>@h:2/x",
    )

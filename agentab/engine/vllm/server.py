"""Real vLLM arms: launch a server per arm, or attach to a running one, and describe it.

`launched_server` and `attached_server` are context managers yielding a `RunningServer` whose
`manifest` is merged into the run manifest. The A/B guard compares every manifest field but a
few (url, pid, seeds, the decode backend), so the manifest holds only facts that are equal for
two correctly configured arms: the redacted command line (decode backend included; the guard
masks it), versions, the server-reported parallel, engine and cache config. What differs
between any two starts of the same arm (pid, startup time, the KV-cache size vLLM derives from
the memory free at that moment) goes to `vllm-server.json` beside the log instead.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.error
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentab.engine.vllm.args import (
    VllmLaunch,
    build_args,
    check_gpus,
    gpu_ids_of,
    redact,
    redact_env,
)
from agentab.engine.vllm.introspect import describe_server, http_get
from agentab.engine.vllm.process import ServerProcess, free_port, port_is_free
from agentab.errors import AgentabError

LOG_NAME = "vllm-server.log"
RUNTIME_NAME = "vllm-server.json"
_LAST_PORT: dict[str, int] = {}
# cache_config_info labels that depend on the memory free at startup, not on the configuration.
_RUNTIME_CACHE_LABELS = (
    "num_gpu_blocks",
    "num_cpu_blocks",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
)


@dataclass
class RunningServer:
    """A server ready for traffic: its base URL, served model id and manifest facts."""

    url: str
    model: str | None
    manifest: dict[str, Any]
    runtime: dict[str, Any] = field(default_factory=dict)
    log_path: Path | None = None
    startup_s: float | None = None


def _gpu_name(gpu_ids: Sequence[int]) -> str | None:
    """The GPUs' product name from nvidia-smi, or None where there is none (the CPU build)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader", "-i", ",".join(map(str, gpu_ids))],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = sorted({line.strip() for line in out.splitlines() if line.strip()})
    return ", ".join(names) or None


def _facts(described: dict[str, Any], *, mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split what the server reported into comparable facts and per-start runtime values."""
    cache = dict(described.get("cache_config") or {})
    runtime_cache = {k: cache.pop(k) for k in _RUNTIME_CACHE_LABELS if k in cache}
    additional = described.get("additional_config")
    if isinstance(additional, dict):
        additional = {k: v for k, v in additional.items() if k != "decode_backend"}
    facts = {
        "mode": mode,
        "version": described.get("version"),
        "models": described.get("models"),
        "model_root": described.get("model_root"),
        "max_model_len": described.get("max_model_len"),
        "parallel_config": described.get("parallel_config"),
        "engine_config": described.get("engine_config"),
        "cache_config": cache or None,
        "additional_config": additional,
    }
    return facts, {"kv_cache": runtime_cache or None}


def _served_tp(parallel: dict[str, Any] | None) -> int | None:
    if not parallel:
        return None
    tp = parallel.get("tensor_parallel_size")
    return int(tp) if isinstance(tp, int) else None


def _port_for(host: str, port: int | None) -> int:
    """The port to use: the caller's, else the one the previous arm used if free, else any.

    Reusing the previous arm's port makes the two arms' argument lists byte-identical except for
    the decode backend (and their URLs equal), so the A/B guard has nothing to explain away.
    """
    if port is not None:
        return port
    previous = _LAST_PORT.get(host)
    if previous is not None and port_is_free(host, previous):
        return previous
    return free_port(host)


@contextmanager
def launched_server(
    launch: VllmLaunch | Mapping[str, Any],
    *,
    decode_backend: str,
    gpus: int | Sequence[int],
    log_dir: str | Path,
    port: int | None = None,
) -> Iterator[RunningServer]:
    """Start one arm's server, yield it once healthy, and stop it (group and port) on exit.

    `launch` is a `VllmLaunch` or an experiment's `[engine]` table (kind removed). Everything
    that can be refused is refused before a process starts (parallel layout vs GPUs, decode
    backend, owned flags). `log_dir` receives `vllm-server.log` and `vllm-server.json` (the
    facts of this start that differ between starts: pid, startup time, KV-cache size). A server
    that exits or stays unhealthy past `startup_timeout_s` raises `AgentabError` with its last
    log lines.
    """
    if not isinstance(launch, VllmLaunch):
        launch = VllmLaunch.from_mapping(launch)
    gpu_ids = gpu_ids_of(gpus)
    check_gpus(launch, gpu_ids)
    build_args(launch, decode_backend, 0)  # refuse a bad backend before touching ports
    port = _port_for(launch.host, port)
    args = build_args(launch, decode_backend, port)
    env = {**launch.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))}
    log_dir = Path(log_dir)
    log_path = log_dir / LOG_NAME
    server = ServerProcess(
        args,
        env=env,
        log_path=log_path,
        host=launch.host,
        port=port,
        stop_grace_s=launch.stop_grace_s,
    )
    _LAST_PORT[launch.host] = port
    try:
        startup_s = server.wait_healthy(launch.startup_timeout_s)
        described = describe_server(server.url, log_path=log_path)
        facts, runtime = _facts(described, mode="launch")
        parallel = facts["parallel_config"] or {}
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            wanted = getattr(launch, key)
            if key in parallel and parallel[key] != wanted:
                raise AgentabError(
                    f"vllm: the server reports {key} {parallel[key]}, agentab asked for {wanted}"
                )
        model = facts["models"][0] if facts["models"] else None
        manifest: dict[str, Any] = {
            "engine": "vllm",
            "url": server.url,
            "model": model,
            "gpu_count": len(gpu_ids),
            "gpu_ids": gpu_ids,
            "gpu_name": _gpu_name(gpu_ids),
            "tp": _served_tp(parallel) or launch.tensor_parallel_size,
            "decode_backend": decode_backend,
            "vllm": {
                **facts,
                "command": shlex.join(redact(args)),
                "env": redact_env(env),
                "visible_gpu_ids": gpu_ids,
                "log": LOG_NAME,
            },
        }
        runtime.update(
            url=server.url,
            args=redact(args),
            pid=server.proc.pid,
            startup_s=round(startup_s, 3),
        )
        (log_dir / RUNTIME_NAME).write_text(json.dumps(runtime, indent=2) + "\n")
        try:
            yield RunningServer(
                url=server.url,
                model=model,
                manifest=manifest,
                runtime=runtime,
                log_path=log_path,
                startup_s=startup_s,
            )
        except (Exception, SystemExit) as exc:
            died = server.death(exc)
            if died is not None:
                raise died from exc
            raise
    finally:
        server.stop()


@contextmanager
def attached_server(
    url: str, gpu_count: int, *, api_key_env: str | None = None
) -> Iterator[RunningServer]:
    """Use a server someone else started; `gpu_count` is what the experiment declares for it.

    agentab cannot see which GPUs a remote server uses, so the declared count is recorded and
    checked against the parallel config the server reports, when it reports one
    (`/server_info` needs VLLM_SERVER_DEV_MODE=1 on the server). Nothing is stopped on exit.
    """
    if not isinstance(gpu_count, int) or isinstance(gpu_count, bool) or gpu_count < 1:
        raise AgentabError(f"vllm attach {url}: gpu_count must be an integer >= 1")
    url = url.rstrip("/")
    headers = {}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise AgentabError(f"vllm attach {url}: environment variable {api_key_env} is empty")
        headers["Authorization"] = f"Bearer {key}"
    started = time.monotonic()
    try:
        http_get(f"{url}/health", timeout_s=10.0, headers=headers)
    except (urllib.error.URLError, OSError) as exc:
        raise AgentabError(f"vllm attach: {url}/health does not answer: {exc}") from None
    described = describe_server(url, headers=headers)
    facts, runtime = _facts(described, mode="attach")
    parallel = facts["parallel_config"] or {}
    sizes = [
        parallel.get(k)
        for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    ]
    ints = [s for s in sizes if isinstance(s, int)]
    if len(ints) == len(sizes):
        used = ints[0] * ints[1] * ints[2]
        if used != gpu_count:
            raise AgentabError(
                f"vllm attach {url}: the server reports tp {sizes[0]} x pp {sizes[1]} x "
                f"dp {sizes[2]} = {used} GPUs, the experiment declares {gpu_count}"
            )
    model = facts["models"][0] if facts["models"] else None
    manifest: dict[str, Any] = {
        "engine": "vllm",
        "model": model,
        "gpu_count": gpu_count,
        "gpu_ids": None,
        "gpu_name": None,
        "tp": _served_tp(parallel),
        "url": url,
        "vllm": {**facts, "command": None, "env": None, "visible_gpu_ids": None, "log": None},
    }
    runtime.update(url=url, probe_s=round(time.monotonic() - started, 3))
    reported = (described.get("additional_config") or {}).get("decode_backend")
    if reported is not None:
        manifest["decode_backend"] = reported
    yield RunningServer(url=url, model=model, manifest=manifest, runtime=runtime)

"""A local-engine arm: `agentab serve --engine local` in its own process, stopped after the run.

Each arm runs in a fresh server process with byte-identical options except the decode backend,
so the arms never share a process, a KV cache or memory: stopping the process frees the
device for the next arm, as with vLLM arms. The process group is stopped with the same
machinery as vLLM's (`engine.vllm.process.ServerProcess`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentab.engine.local.config import OPTIONS
from agentab.engine.vllm.process import ServerProcess, free_port
from agentab.engine.vllm.server import RunningServer
from agentab.errors import AgentabError

LOG_NAME = "local-server.log"
# [engine] keys of an experiment of kind "local"
LAUNCH_KEYS = ("preset", *OPTIONS, "startup_timeout_s")


def serve_args(engine: Mapping[str, Any], decode_backend: str, port: int) -> list[str]:
    """The `agentab serve` command line of one arm (the same for both arms but the backend)."""
    unknown = sorted(set(engine) - set(LAUNCH_KEYS))
    if unknown:
        known = ", ".join(LAUNCH_KEYS)
        raise AgentabError(f"[engine]: unknown key(s) {', '.join(unknown)} (known: {known})")
    if not isinstance(engine.get("preset"), str):
        raise AgentabError("[engine]: a local engine needs preset (tiny or k2-tp8-shard)")
    args = [sys.executable, "-m", "agentab", "serve", "--engine", "local"]
    args += ["--preset", engine["preset"]]
    for key in OPTIONS:
        if engine.get(key) is not None:
            args += ["--" + key.replace("_", "-"), str(engine[key])]
    args += ["--decode-backend", decode_backend, "--host", "127.0.0.1", "--port", str(port)]
    return args


@contextmanager
def launched_local_server(
    engine: Mapping[str, Any], *, decode_backend: str, log_dir: Path
) -> Iterator[RunningServer]:
    """Start one arm's server, wait for /health, yield it, stop its process group."""
    port = free_port()
    args = serve_args(engine, decode_backend, port)
    timeout = float(engine.get("startup_timeout_s", 600))
    proc = ServerProcess(
        args,
        env={},
        log_path=Path(log_dir) / LOG_NAME,
        host="127.0.0.1",
        port=port,
        stop_grace_s=30.0,
        label="local engine server",
    )
    try:
        startup = proc.wait_healthy(timeout)
        yield RunningServer(
            url=proc.url,
            model=None,
            manifest={},
            runtime={"pid": proc.proc.pid, "startup_s": startup},
            log_path=proc.log_path,
            startup_s=startup,
        )
    finally:
        proc.stop()

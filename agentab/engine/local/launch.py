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

import msgspec

from agentab.engine.options import LocalLaunch, decode_options, flag_name, option_names
from agentab.engine.vllm.process import ServerProcess, free_port
from agentab.engine.vllm.server import RunningServer

LOG_NAME = "local-server.log"
# LocalLaunch fields that are not `agentab serve` flags: the backend goes last, the timeout is
# the launcher's own
_NOT_FLAGS = ("decode_backend", "startup_timeout_s")


def local_launch(
    engine: LocalLaunch | Mapping[str, Any], decode_backend: str | None = None
) -> LocalLaunch:
    """An experiment's `[engine]` table (or a launch) with the arm's decode backend."""
    if isinstance(engine, LocalLaunch):
        data: dict[str, Any] = msgspec.structs.asdict(engine)
    else:
        data = dict(engine)
    if decode_backend is not None:
        data["decode_backend"] = decode_backend
    return decode_options(LocalLaunch, data)


def serve_args(launch: LocalLaunch, port: int) -> list[str]:
    """The `agentab serve` command line of one arm (the same for both arms but the backend)."""
    args = [sys.executable, "-m", "agentab", "serve", "--engine", "local"]
    defaults = LocalLaunch(preset=launch.preset)
    for key in option_names(LocalLaunch):
        value = getattr(launch, key)
        if key not in _NOT_FLAGS and (key == "preset" or value != getattr(defaults, key)):
            text = (
                msgspec.json.encode(value).decode()
                if isinstance(value, msgspec.Struct)
                else str(value)
            )
            args += [flag_name(key), text]
    args += ["--decode-backend", launch.decode_backend.value]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    return args


@contextmanager
def launched_local_server(
    engine: LocalLaunch | Mapping[str, Any], *, decode_backend: str, log_dir: Path
) -> Iterator[RunningServer]:
    """Start one arm's server, wait for /health, yield it, stop its process group."""
    launch = local_launch(engine, decode_backend)
    port = free_port()
    args = serve_args(launch, port)
    timeout = launch.startup_timeout_s
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

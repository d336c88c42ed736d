"""`agentab serve`: run an OpenAI-compatible server over an agentab engine until SIGINT/SIGTERM.

It binds 127.0.0.1 unless `--host` says otherwise (the simulator is not meant to face a network),
and prints one line `agentab serve: listening on http://HOST:PORT ...` once it accepts requests
(`--port 0` picks a free port; scripts read it from that line).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import click

from agentab.engine.cli import simulator_flags, simulator_options

ENGINES = ("sim",)


@click.command("serve")
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(ENGINES),
    default="sim",
    show_default=True,
    help="Which engine serves (sim: the simulator, real clock).",
)
@simulator_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 picks a free port.")
@click.option(
    "--model",
    "model_name",
    default="agentab-sim",
    show_default=True,
    help="Model name served at /v1/models.",
)
@click.option(
    "--max-model-len",
    type=int,
    default=None,
    help="Refuse prompt + max_tokens above this (vLLM-style 400).",
)
@click.option("--seed", type=int, default=None, help="Engine seed (spec-decode acceptance).")
@click.option(
    "--record-emissions",
    is_flag=True,
    help="Keep per-request chunk write times at /agentab/emissions (tests).",
)
def serve(**kw: Any) -> None:
    """Serve an agentab engine over the OpenAI API (completions, chat, /metrics)."""
    from agentab.engine import build_simulator
    from agentab.engine.server import EngineServer

    options = simulator_flags(kw)
    if kw["seed"] is not None:
        options["seed"] = kw["seed"]
    engine = build_simulator(kw["profile"], kw["decode_backend"], **options)
    server = EngineServer(
        engine,
        model=kw["model_name"],
        max_model_len=kw["max_model_len"],
        record_emissions=kw["record_emissions"],
    )
    asyncio.run(_run(server, kw["host"], kw["port"]))


async def _run(server: Any, host: str, port: int) -> None:
    from agentab.engine.server import start_server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, bound = await start_server(server, host, port)
    except OSError as exc:
        from agentab.errors import AgentabError

        raise AgentabError(f"--host {host} --port {port}: cannot listen: {exc}") from None
    facts = server.engine.describe()
    click.echo(
        f"agentab serve: listening on http://{host}:{bound} (engine {facts.get('engine')}, "
        f"profile {facts.get('profile')}, decode_backend {facts.get('decode_backend')})",
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    click.echo("agentab serve: stopped")

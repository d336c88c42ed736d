"""`agentab serve`: run an OpenAI-compatible server over an agentab engine until SIGINT/SIGTERM.

It binds 127.0.0.1 unless `--host` says otherwise (the simulator is not meant to face a network),
and prints one line `agentab serve: listening on http://HOST:PORT ...` once it accepts requests
(`--port 0` picks a free port; scripts read it from that line).

`--replicas N` runs N independent replicas (agentab.engine.replicas), one process and one port
each (base port + i), each printing its own line; /metrics, /health and /agentab/emissions stay
per replica.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import click

from agentab.engine.cli import simulator_options, simulator_options_of
from agentab.engine.options import (
    LocalOptions,
    decode_options,
    flag_name,
    option_names,
    options_file_table,
)
from agentab.engine.server import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_READ_TIMEOUT_S,
)
from agentab.errors import AgentabError

ENGINES = ("sim", "local")


def _with_simulator_options(command: Any) -> Any:
    return simulator_options(command, profile_required=False)


@click.command("serve")
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(ENGINES),
    default="sim",
    show_default=True,
    help="Which engine serves: sim (the simulator on the real clock, needs --profile) or "
    "local (the torch model with both decode backends, needs --preset).",
)
@_with_simulator_options
@click.option(
    "--preset",
    default=None,
    help="Local engine: the model preset (tiny: CPU; k2-tp8-shard: one TP8 rank of Kimi-K2).",
)
@click.option("--num-layers", type=int, default=None, help="Local engine: decoder layers.")
@click.option(
    "--weight-sets",
    type=int,
    default=None,
    help="Local engine: distinct layer weight sets cycled over the layers.",
)
@click.option(
    "--device", default=None, help="Local engine: cpu or cuda [default: cuda where there is one]."
)
@click.option("--block-size", type=int, default=None, help="Local engine: KV block tokens (16).")
@click.option(
    "--tp",
    type=int,
    default=None,
    help="Local engine: tensor-parallel ranks, one process each (CPU, gloo) [default: 1].",
)
@click.option(
    "--speculative-config",
    default=None,
    help="Local engine: speculative decoding as JSON, vLLM's names "
    '(\'{"num_speculative_tokens": 7, "rejection_sample_method": "synthetic", '
    '"synthetic_acceptance_length": 6}\'), or a TOML file with a [speculative_config] '
    "table (`agentab acceptance -o` writes one; docs/engine.md).",
)
@click.option(
    "--prefill-graphs",
    type=bool,
    default=None,
    metavar="BOOL",
    help="Local engine: run prefill and mixed steps in piecewise CUDA graphs, attention eager "
    "between them [default: true on one GPU, false on the CPU].",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="0 picks a free port.",
)
@click.option(
    "--model",
    "model_name",
    default=None,
    help="Model name served at /v1/models [default: agentab-sim, or agentab-local-PRESET].",
)
@click.option(
    "--max-model-len",
    type=int,
    default=None,
    help="Refuse prompt + max_tokens above this (vLLM-style 400).",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Engine seed (simulator: spec-decode acceptance; local engine: the weights).",
)
@click.option(
    "--record-emissions",
    is_flag=True,
    help="Keep per-request chunk write times at /agentab/emissions (tests).",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    metavar="N",
    help="Data-parallel replicas: N independent engines, each its own process on port "
    "--port + i (0: each a free port), each printing its own 'listening on' line. Each "
    "replica keeps its own /metrics, /health and /agentab/emissions (nothing is summed "
    "here); give every URL to `agentab replay --url` (repeated), which keeps each session "
    "on one replica. A replica that exits stops the others and the command exits 1.",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_REQUEST_BYTES,
    show_default=True,
    help="Refuse a larger request body (413) before reading it.",
)
@click.option(
    "--read-timeout",
    "read_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_READ_TIMEOUT_S,
    show_default=True,
    help="Seconds a request body may take to arrive (else 408).",
)
@click.option(
    "--idle-timeout",
    "idle_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_IDLE_TIMEOUT_S,
    show_default=True,
    help="Close a connection that sends no complete request for this long (nothing, half a "
    "header, or an idle keep-alive).",
)
def serve(**kw: Any) -> None:
    """Serve an agentab engine over the OpenAI API (completions, chat, /metrics)."""
    if kw["replicas"] > 1:
        from agentab.engine.replicas import serve_replicas

        _check_engine_flags(kw)  # once, in one line, before N processes would each say it
        serve_replicas(serve_one, kw)
        return
    serve_one({**kw, "replica": None, "announce": None})


def serve_one(kw: dict[str, Any]) -> None:
    """One engine behind one server until SIGINT/SIGTERM (a replica's whole process too)."""
    from agentab.engine.server import EngineServer

    logging.basicConfig(format="agentab serve: %(message)s", level=logging.WARNING)
    logging.getLogger("agentab.serve").setLevel(logging.INFO)

    engine = _local_engine(kw) if kw["engine_kind"] == "local" else _simulator(kw)
    server = EngineServer(
        engine,
        model=kw["model_name"] or _default_model(kw),
        max_model_len=kw["max_model_len"] or engine.describe().get("max_model_len"),
        record_emissions=kw["record_emissions"],
        max_request_bytes=kw["max_request_bytes"],
        read_timeout_s=kw["read_timeout_s"],
        idle_timeout_s=kw["idle_timeout_s"],
    )
    asyncio.run(_run(server, kw["host"], kw["port"], kw["replica"], kw["announce"]))


def _default_model(kw: dict[str, Any]) -> str:
    return f"agentab-local-{kw['preset']}" if kw["engine_kind"] == "local" else "agentab-sim"


_LOCAL_ONLY = (
    "preset", "num_layers", "weight_sets", "device", "block_size", "tp", "speculative_config",
    "prefill_graphs",
)  # fmt: skip
_SIM_ONLY = ("profile", "num_draft_tokens", "acceptance_length", "acceptance_probs")


def _given(kw: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if kw.get(n) is not None]


def _check_engine_flags(kw: dict[str, Any]) -> None:
    """The flags that the chosen engine needs, and none of the other engine's."""
    if kw["engine_kind"] == "local":
        if kw["preset"] is None:
            raise AgentabError("--engine local needs --preset (tiny or k2-tp8-shard)")
        if extra := _given(kw, _SIM_ONLY):
            raise AgentabError(f"{', '.join(extra)}: simulator options, not the local engine's")
        return
    if kw["profile"] is None:
        raise AgentabError("--engine sim needs --profile (a hardware profile name or TOML)")
    if extra := _given(kw, _LOCAL_ONLY):
        raise AgentabError(f"{', '.join(extra)}: local-engine options; add --engine local")


def _simulator(kw: dict[str, Any]) -> Any:
    from agentab.engine.sim import simulator_from

    _check_engine_flags(kw)
    options = simulator_options_of(
        kw, profile=kw["profile"], decode_backend=kw["decode_backend"], seed=kw["seed"]
    )
    return simulator_from(options)


def _local_engine(kw: dict[str, Any]) -> Any:
    from agentab.engine.local.build import local_engine_from

    _check_engine_flags(kw)
    flags = {name: kw.get(name) for name in option_names(LocalOptions)}
    if flags["speculative_config"] is not None:
        flags["speculative_config"] = _json_flag("speculative_config", flags["speculative_config"])
    options = decode_options(LocalOptions, flags, name=flag_name)
    click.echo(f"agentab serve: building the local engine (preset {kw['preset']})", err=True)
    return local_engine_from(options)


def _json_flag(name: str, text: str) -> Any:
    """A flag whose value is a JSON object (as vLLM's `--speculative-config`), or a TOML file
    holding it as a table of the flag's name (what `agentab acceptance -o` writes)."""
    import orjson

    table = options_file_table(text, name, flag_name(name))
    if table is not None:
        return table

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise AgentabError(f"{flag_name(name)}: not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise AgentabError(f"{flag_name(name)}: expected a JSON object, got {text!r}")
    return value


async def _run(
    server: Any, host: str, port: int, replica: int | None, announce: Any = None
) -> None:
    """Serve until SIGINT/SIGTERM; a replica (`replica` set) says its bound port over the
    `announce` pipe to the process that supervises it."""
    from agentab.engine.server import start_server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, bound = await start_server(server, host, port)
    except OSError as exc:
        raise AgentabError(f"--host {host} --port {port}: cannot listen: {exc}") from None
    facts = server.engine.describe()
    what = (
        f"preset {facts.get('preset')}, decoder {facts.get('decoder_impl')}"
        if facts.get("engine") == "agentab-local"
        else f"profile {facts.get('profile')}"
    )
    if announce is not None:
        announce.send(bound)
    which = "" if replica is None else f"replica {replica}, "
    click.echo(
        f"agentab serve: listening on http://{host}:{bound} ({which}engine {facts.get('engine')}, "
        f"{what}, decode_backend {facts.get('decode_backend')})",
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    click.echo(
        "agentab serve: stopped" if replica is None else f"agentab serve: replica {replica} stopped"
    )

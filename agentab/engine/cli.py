"""`agentab engine ...`: look inside the engine.

`engine trace` runs a workload through the simulator on the virtual clock and prints every step
as a JSON line, so the scheduler's decisions (budget split, chunking, admission, preemption,
prefix hits, which decode path ran) can be read directly.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import orjson

from agentab.engine.local.verify_bench import VERIFY_HELP, VERIFY_ROWS_HELP
from agentab.engine.options import (
    DECODE_BACKENDS,
    SimulatorOptions,
    decode_options,
    flag_name,
    option_names,
    options_file_table,
)
from agentab.errors import AgentabError
from agentab.kernels.paths import PATH_NAMES
from agentab.outputs import OutputPath, output_help


@click.group()
def engine() -> None:
    """Inspect the engine and its simulator."""


def parse_acceptance_probs(
    ctx: click.Context | None, param: click.Parameter | None, value: str | None
) -> list[float] | None:
    """`--acceptance-probs 0.9,0.7,0.5` -> per-position acceptance rates (a click callback);
    a TOML file's `[simulator] acceptance_probs` (`agentab acceptance -o FILE`) as well."""
    if value is None:
        return None
    table = options_file_table(value, "simulator", "--acceptance-probs")
    if table is not None:
        probs = table.get("acceptance_probs")
        if not isinstance(probs, list):
            raise AgentabError(f"--acceptance-probs {value}: [simulator] has no acceptance_probs")
        return probs
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise AgentabError(f"--acceptance-probs: {value!r} is not a comma-separated list") from None


# The simulator options `agentab simulate` and `agentab serve` expose as flags (the rest of
# `SimulatorOptions` are set per command or left at their defaults).
SIMULATOR_FLAGS = tuple(
    name
    for name in option_names(SimulatorOptions)
    if name not in ("block_size", "seed", "fast_forward")
)


def simulator_options(
    command: Callable[..., Any], *, profile_required: bool = True
) -> Callable[..., Any]:
    """Add the simulator's flags (profile, decode backend, spec decode, limits) to a command."""
    options = [
        click.option(
            "--profile",
            required=profile_required,
            help="Hardware profile name or TOML path (the simulator's).",
        ),
        click.option(
            "--decode-backend",
            type=click.Choice(DECODE_BACKENDS),
            default="auto",
            show_default=True,
            help="Which decode path the engine may use for the steps it supports.",
        ),
        click.option(
            "--specialized-max-tokens",
            type=int,
            default=None,
            help="Per-shape dispatch under latency_specialized: a step of more padded tokens "
            "runs the standard path (e.g. 4 where `agentab kernels bench` shows the "
            "specialized decoder losing from 8 tokens). Default: the profile's limit (64).",
        ),
        click.option("--num-draft-tokens", type=int, default=None, help="Speculative drafts."),
        click.option(
            "--acceptance-length",
            type=float,
            default=None,
            help="Synthetic mean acceptance length (spec decode).",
        ),
        click.option(
            "--acceptance-probs",
            callback=parse_acceptance_probs,
            default=None,
            help="Per-position acceptance rates, e.g. 0.9,0.7,0.5 (instead of the length), or a "
            "TOML file with [simulator] acceptance_probs (`agentab acceptance -o` writes one).",
        ),
        click.option("--max-num-seqs", type=int, default=None),
        click.option("--max-num-batched-tokens", type=int, default=None),
        click.option("--kv-blocks", type=int, default=None, help="Override KV capacity (blocks)."),
        click.option(
            "--step-noise",
            type=click.FloatRange(min=0.0, max=1.0),
            default=None,
            help="Timing noise: log sigma of each step's time (a real engine's step-to-step "
            "variation; 0.025 was measured on an H200). Default 0: exact prices.",
        ),
        click.option(
            "--run-noise",
            type=click.FloatRange(min=0.0, max=1.0),
            default=None,
            help="Timing noise: log sigma of one factor on every step of the run.",
        ),
        click.option(
            "--noise-seed", type=int, default=None, help="Seed of the timing noise (default 0)."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def simulator_flags(kw: dict[str, Any]) -> dict[str, Any]:
    """The flags of `simulator_options` that were given, by option name."""
    return {name: kw[name] for name in SIMULATOR_FLAGS if kw.get(name) is not None}


def simulator_options_of(kw: dict[str, Any], **fixed: Any) -> SimulatorOptions:
    """A command's simulator flags (and the options it sets itself) as `SimulatorOptions`;
    a bad value is an error naming its flag."""
    return decode_options(SimulatorOptions, {**simulator_flags(kw), **fixed}, name=flag_name)


@engine.command()
@click.argument("workload_path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", default=None, help="agentx|mooncake|native (detected if unset).")
@click.option("--profile", default="gb300-tp16-kimi-k3", show_default=True, help="Name or TOML.")
@click.option(
    "--decode-backend", type=click.Choice(DECODE_BACKENDS), default="auto", show_default=True
)
@click.option("--num-draft-tokens", type=int, default=0, show_default=True)
@click.option("--acceptance-length", type=float, default=None, help="Mean tokens per verify step.")
@click.option("--acceptance-probs", default=None, help="Per-position rates, e.g. 0.9,0.7,0.5.")
@click.option("--max-num-seqs", type=int, default=1024, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True)
@click.option("--kv-blocks", type=int, default=None, help="Override KV capacity (blocks).")
@click.option("--sessions", "max_sessions", type=int, default=None, help="First N sessions only.")
@click.option("--seed", type=int, default=0, show_default=True)
def trace(
    workload_path: Path,
    fmt: str | None,
    profile: str,
    decode_backend: str,
    num_draft_tokens: int,
    acceptance_length: float | None,
    acceptance_probs: str | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_blocks: int | None,
    max_sessions: int | None,
    seed: int,
) -> None:
    """Run WORKLOAD_PATH through the simulator and print one JSON line per step.

    Each session's requests (its whole tree, depth first) are sent back to back with no pauses;
    all sessions start at time 0. A final line {"summary": ...} closes the trace.
    """
    from agentab.clock import run_virtual
    from agentab.engine.sim import simulator_from
    from agentab.workloads import load

    workload = load(workload_path, fmt, freeze=True)
    sessions = workload.sessions[:max_sessions] if max_sessions is not None else workload.sessions
    options = {
        "profile": profile,
        "decode_backend": decode_backend,
        "num_draft_tokens": num_draft_tokens,
        "acceptance_length": acceptance_length,
        "acceptance_probs": parse_acceptance_probs(None, None, acceptance_probs),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "kv_blocks": kv_blocks,
        "seed": seed,
    }
    eng = simulator_from(decode_options(SimulatorOptions, options, name=flag_name))
    out = sys.stdout.buffer
    closed = _ReaderGone()

    def observe(rec: dict[str, Any]) -> None:
        try:
            out.write(orjson.dumps(rec) + b"\n")
        except BrokenPipeError:
            closed.stop()  # `| head` has all it wants: stop instead of simulating for nobody

    eng.step_observer = observe
    try:
        summary = run_virtual(_trace(eng, sessions, closed))
        out.write(orjson.dumps({"summary": summary}) + b"\n")
        out.flush()
    except BrokenPipeError:
        closed.gone = True
    if closed.gone:
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class _ReaderGone:
    """Set when stdout's reader has gone; cancels the trace's main task once."""

    def __init__(self) -> None:
        self.gone = False
        self.task: asyncio.Task[Any] | None = None

    def stop(self) -> None:
        if not self.gone and self.task is not None:
            self.task.cancel()
        self.gone = True


async def _trace(eng: Any, sessions: Any, closed: _ReaderGone) -> dict[str, Any]:
    from agentab.engine.types import EngineRequest, FinalUsage
    from agentab.workloads.tokens import prompt_token_ids

    loop = asyncio.get_running_loop()
    closed.task = asyncio.current_task()
    totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}

    async def run_session(session: Any) -> None:
        for i, request in enumerate(session.all_requests()):
            ids = prompt_token_ids(session, request)
            req = EngineRequest(f"{session.id}:{i}", ids, max(int(request.out_tokens), 1))
            async for ev in eng.generate(req):
                if isinstance(ev, FinalUsage):
                    totals["requests"] += 1
                    totals["prompt_tokens"] += ev.prompt_tokens
                    totals["completion_tokens"] += ev.completion_tokens
                    totals["cached_tokens"] += ev.cached_tokens

    eng.start()
    try:
        await asyncio.gather(*(run_session(s) for s in sessions))
    except asyncio.CancelledError:
        if not closed.gone:
            raise
        return {}
    finally:
        await eng.stop()
    return {
        **totals,
        "sessions": len(sessions),
        "simulated_s": loop.time(),
        "metrics": eng.metrics(),
        "engine": eng.describe(),
    }


@engine.command("verify-bench")
@click.option("--preset", default="k2-tp8-shard", show_default=True)
@click.option("--batch", default="1,2,4,8,16,32,64", show_default=True,
              help="decode batch sizes timed first, as `kernels bench` times them")  # fmt: skip
@click.option("--context", default=4096, show_default=True, type=click.IntRange(1))
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1))
@click.option("--iters", default=100, show_default=True, type=click.IntRange(5))
@click.option("--paths", default=",".join(PATH_NAMES), show_default=True,
              help="the paths timed at the batch sizes (verify shapes: standard and "
                   "specialized of these)")  # fmt: skip
@click.option("--verify", default="3,5,7", show_default=True, help=VERIFY_HELP)
@click.option("--verify-rows", default="", help=VERIFY_ROWS_HELP)
@click.option("-o", "--out", type=OutputPath(), default=Path("results.json"),
              show_default=True, help=output_help("The results (JSON)."))  # fmt: skip
def verify_bench(
    preset: str,
    batch: str,
    context: int,
    layers: int,
    iters: int,
    paths: str,
    verify: str,
    verify_rows: str,
    out: Path,
) -> None:
    """Speculative decoding's verify shapes per layer on the local engine's decode paths (GPU).

    Each shape is ROWS sequences of 1 + k query tokens over the engine's paged cache, built by
    the engine's own functions as its decode graphs run a verify step (the row's queries share
    its block table, at positions c..c+k; padded to the engine's graph size). The decode batch
    sizes run first, as `agentab kernels bench` runs them, then every shape on the compiled
    standard and the specialized path in the same process: two tables, `rows` and
    `verify_rows` in the results. The verify rows' bytes count the cache entries as the
    attention kernels read them (each query reads its row's entries) and each entry once."""
    from agentab.engine.local.verify_bench import full_table, run_verify_bench, verify_shapes
    from agentab.kernels.check import parse_batches
    from agentab.kernels.cli import need_cuda
    from agentab.kernels.paths import check_path_names

    batches = parse_batches(batch)
    shapes = verify_shapes(verify, verify_rows)
    if shapes is None:
        raise AgentabError("--verify: needs the drafts per row, e.g. 3,5,7")
    names = tuple(p for p in paths.split(",") if p)
    check_path_names(names)
    need_cuda("agentab engine verify-bench")
    res = run_verify_bench(preset, batches, shapes, context, layers, iters, paths=names)
    res["command"] = (
        f"agentab engine verify-bench --preset {preset} --batch {batch} --context {context} "
        f"--layers {layers} --iters {iters} --paths {paths} --verify {verify}"
        + (f" --verify-rows {verify_rows}" if verify_rows else "")
    )
    out.write_text(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode())
    click.echo(full_table(res))

"""`agentab kernels`: check and bench the specialized decoder layer on the GPU.

Both commands need a CUDA GPU (and the gpu extra for the specialized path); the same drivers run
without click as `python -m agentab.kernels.check` / `python -m agentab.kernels.bench`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from agentab.errors import AgentabError
from agentab.kernels.check import parse_batches
from agentab.kernels.config import PRESETS, get_preset
from agentab.kernels.paths import PATH_NAMES, check_path_names
from agentab.outputs import OutputPath, output_help


def need_cuda(command: str = "agentab kernels") -> None:
    """torch installed (the gpu extra) and a CUDA GPU visible, or one line saying which not."""
    from agentab.extras import require

    require("torch", command, extra="gpu")
    import torch

    if not torch.cuda.is_available():
        raise AgentabError(
            f"{command.removeprefix('agentab ')}: needs a CUDA GPU (none visible to torch)"
        )


@click.group()
def kernels() -> None:
    """The specialized decoder layer: correctness checks and per-layer benchmarks (GPU)."""


@kernels.command()
@click.option("--preset", default="k2-tp8-shard", type=click.Choice(sorted(PRESETS)))
@click.option("--batch", default="1-64", show_default=True, help="e.g. 1-64 or 1,2,4")
@click.option("--context", default=512, show_default=True, type=click.IntRange(1))
@click.option("--paths", default=",".join(PATH_NAMES), show_default=True,
              help="standard (compiled, vLLM's design), standard-eager, specialized")  # fmt: skip
@click.option("-o", "--out", type=OutputPath(), default=None,
              help=output_help("Write the results as JSON here."))  # fmt: skip
def check(preset: str, batch: str, context: int, paths: str, out: Path | None) -> None:
    """Every path against the fp32 reference at every batch size (exit 1 on any failure)."""
    from agentab.kernels.check import run_check

    batches = parse_batches(batch)
    get_preset(preset)
    names = tuple(p for p in paths.split(",") if p)
    check_path_names(names)
    need_cuda()
    res = run_check(preset, batches, context, paths=names)
    if out:
        out.write_text(json.dumps(res, indent=1))
    n_fail = sum(not r["ok"] for r in res["results"])
    click.echo(f"check: {len(res['results']) - n_fail} passed, {n_fail} failed")
    if not res["ok"]:
        raise SystemExit(1)


@kernels.command()
@click.option("--preset", default="k2-tp8-shard", type=click.Choice(sorted(PRESETS)))
@click.option("--batch", default="1,2,4,8,16,32,64", show_default=True)
@click.option("--context", default=4096, show_default=True, type=click.IntRange(1))
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1))
@click.option("--iters", default=100, show_default=True, type=click.IntRange(5))
@click.option("--standard-extra", default="", help="batch sizes timed for the standard path only")
@click.option("--paths", default=",".join(PATH_NAMES), show_default=True,
              help="the paths timed")  # fmt: skip
@click.option("-o", "--out", type=OutputPath(), default=Path("results.json"),
              show_default=True, help=output_help("The results (JSON)."))  # fmt: skip
@click.option("--profile-out", type=OutputPath(), default=None,
              help=output_help("Also write the simulator HardwareProfile TOML here."))  # fmt: skip
def bench(
    preset: str,
    batch: str,
    context: int,
    layers: int,
    iters: int,
    standard_extra: str,
    paths: str,
    out: Path,
    profile_out: Path | None,
) -> None:
    """Microseconds and kernels per layer for every path; writes results.json (and a profile).

    The specialized path's speedup is against the faster standard path at each batch size.
    Speculative decoding's verify shapes (rows of 1 + k query tokens over the local engine's
    paged cache): `agentab engine verify-bench`."""
    from agentab.kernels.bench import run_bench, table
    from agentab.kernels.profile_toml import write_profile

    batches = parse_batches(batch)
    extra = parse_batches(standard_extra) if standard_extra else []
    names = tuple(p for p in paths.split(",") if p)
    check_path_names(names)
    need_cuda()
    res = run_bench(preset, batches, context, layers, iters, standard_extra=extra, paths=names)
    res["command"] = (
        f"agentab kernels bench --preset {preset} --batch {batch} --context {context} "
        f"--layers {layers} --iters {iters}"
        + (f" --standard-extra {standard_extra}" if standard_extra else "")
        + (f" --paths {paths}" if names != PATH_NAMES else "")
    )
    out.write_text(json.dumps(res, indent=1))
    if profile_out:
        write_profile(res, profile_out)
    click.echo(table(res))

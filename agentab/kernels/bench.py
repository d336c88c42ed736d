"""`kernels bench`: per-layer time of the decode paths on the GPU, and a simulator profile.

For each batch size: every path (standard-eager, standard, specialized) is captured in one
CUDA graph holding `layers` layers with their own weights and caches (weights read per replay
far exceed L2), timed over many replays (median, CUDA events), and its kernels per layer
counted from the profiler. Bytes are the
fewest the step must move (`LayerConfig.step_bytes`, with the routed experts actually touched);
the roofline fraction is bytes / time / 4.3 TB/s for the specialized path, and its speedup is
against the faster of the two standard paths at that batch size (named in `speedup_vs`).

Speculative decoding's verify shapes (rows of 1 + k query tokens over the local engine's paged
cache) are timed by `agentab engine verify-bench` (agentab.engine.local.verify_bench), which
builds their inputs with the engine's own functions and runs this bench's layers over them.

Runnable without click: `python -m agentab.kernels.bench --preset k2-tp8-shard ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from agentab.errors import AgentabError
from agentab.kernels.config import HBM_ROOFLINE_BYTES_PER_S, LayerConfig, get_preset
from agentab.kernels.paths import PATH_NAMES, STANDARD_PATHS, check_path_names, result_key

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def _log(msg: str) -> None:
    print(msg, flush=True)


def bench_path(
    name: str,
    cfg: LayerConfig,
    layers: list[Any],
    batch: int,
    context: int,
    iters: int,
    seed: int,
) -> dict[str, Any]:
    """Time one path at one batch size; returns us/layer, kernels/layer, touched experts."""
    import torch

    from agentab.kernels.paths import make_path
    from agentab.kernels.weights import init_state

    dev = layers[0].w_o.device
    gen = torch.Generator(device=dev).manual_seed(seed + batch)
    x = torch.randn(batch, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)
    states = [
        init_state(cfg, batch, context, seed + 10 * i + batch, dev) for i in range(len(layers))
    ]
    t0 = time.time()
    paths = [make_path(name, cfg, w, context, batch) for w in layers]
    build_s = time.time() - t0
    return time_layers(paths, states, x, iters, build_s, breakdown=batch in (1, 64))


def time_layers(
    paths: list[Any], states: list[Any], x: Any, iters: int, build_s: float, breakdown: bool
) -> dict[str, Any]:
    """The layers chained in one graph, timed; kernels of one layer counted (and timed eagerly
    one by one with `breakdown`)."""
    import torch

    from agentab.kernels.harness import (
        capture,
        kernel_names,
        kernel_times,
        layer_chain,
        time_replays,
    )

    graph, outs = capture(layer_chain(x, paths, states))
    t = time_replays(graph, iters=iters)
    names = kernel_names(lambda: paths[0].step(x, states[0]))
    rows = None
    if breakdown:
        rows = [
            {"kernel": k, "us": round(us, 2), "launches": n}
            for k, us, n in kernel_times(lambda: paths[0].step(x, states[0]))
        ]
    graph.replay()
    torch.cuda.synchronize()
    touched = [float(torch.unique(o.ids.long()).numel()) for o in outs]
    n = len(paths)
    return {
        "us_per_layer": t["median"] / n,
        "p10_us_per_layer": t["p10"] / n,
        "p90_us_per_layer": t["p90"] / n,
        "kernels": len(names),
        "kernel_names": names,
        "touched_experts": sum(touched) / len(touched),
        "build_s": build_s,
        "eager_kernel_breakdown": rows,
    }


def finish_row(
    cfg: LayerConfig, context: int, row: dict[str, Any], detail: dict[str, Any]
) -> dict[str, Any]:
    """Complete a results row from the per-path `bench_path` results in `detail`.

    `row` already holds `batch` and `<path>_us` / `<path>_kernels` for the paths measured;
    adds bytes (with the experts the step touched), speedup and the roofline fractions. The
    speedup is against the faster standard path (`speedup_vs` names it).
    """
    if not detail:
        return row
    touched = next(iter(detail.values()))["touched_experts"]
    nbytes = cfg.step_bytes(row["batch"], context, touched_experts=touched)
    row["bytes"] = int(nbytes)
    row["touched_experts"] = touched
    std = {n: row[f"{result_key(n)}_us"] for n in STANDARD_PATHS if f"{result_key(n)}_us" in row}
    if "specialized_us" in row and std:
        best = min(std, key=lambda n: std[n])
        row["speedup"] = round(std[best] / row["specialized_us"], 3)
        row["speedup_vs"] = best
        row["roofline_fraction"] = round(
            nbytes / (row["specialized_us"] * 1e-6) / HBM_ROOFLINE_BYTES_PER_S, 3
        )
    row["standard_roofline_fraction"] = round(
        nbytes / (row["standard_us"] * 1e-6) / HBM_ROOFLINE_BYTES_PER_S, 3
    ) if "standard_us" in row else None  # fmt: skip
    row["kernel_names"] = {k: v["kernel_names"] for k, v in detail.items()}
    row["eager_kernel_breakdown"] = {
        k: v["eager_kernel_breakdown"] for k, v in detail.items() if v["eager_kernel_breakdown"]
    }
    return row


def time_each_path(
    row: dict[str, Any],
    paths: Iterable[str],
    measure: Callable[[str], dict[str, Any]],
    label: str,
) -> dict[str, Any]:
    """`measure` each path into `row` (`<path>_us` and `<path>_kernels`, or `<path>_error`:
    a failing path must not hide the other paths' figures), a progress line each; returns
    the per-path results."""
    detail: dict[str, Any] = {}
    for name in paths:
        try:
            r = measure(name)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            row[f"{result_key(name)}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            continue
        row[f"{result_key(name)}_us"] = round(r["us_per_layer"], 2)
        row[f"{result_key(name)}_kernels"] = r["kernels"]
        detail[name] = r
        _log(f"  {label} {name:14s} {r['us_per_layer']:9.1f} us/layer "
             f"(p10 {r['p10_us_per_layer']:.1f}, p90 {r['p90_us_per_layer']:.1f}) "
             f"{r['kernels']} kernels, build {r['build_s']:.1f}s")  # fmt: skip
    return detail


def run_bench(
    preset: str,
    batches: list[int],
    context: int,
    layers: int = 4,
    iters: int = 100,
    seed: int = 0,
    standard_extra: list[int] | None = None,
    paths: tuple[str, ...] = PATH_NAMES,
    then: Callable[[LayerConfig, list[Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Measure every batch size; returns the results document (see docs/kernels.md). `then`
    runs after them in the same process over the same layer weights and adds its entries to
    the document (the engine's verify shapes: agentab.engine.local.verify_bench)."""
    import torch

    from agentab.kernels.weights import init_weights

    cfg = get_preset(preset)
    dev = torch.device("cuda")
    weights = [init_weights(cfg, seed + 1000 * i, dev) for i in range(layers)]
    rows, extra_rows = [], []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        measure = partial(
            bench_path, cfg=cfg, layers=weights, batch=b, context=context, iters=iters, seed=seed
        )
        detail = time_each_path(row, paths, measure, f"batch {b:3d}")
        rows.append(finish_row(cfg, context, row, detail))
    for b in standard_extra or []:
        r = bench_path("standard", cfg, weights, b, context, max(20, iters // 4), seed)
        extra_rows.append({"batch": b, "standard_us": round(r["us_per_layer"], 2),
                           "standard_kernels": r["kernels"]})  # fmt: skip
        _log(f"  batch {b:3d} standard     {r['us_per_layer']:9.1f} us/layer (profile only)")
    doc = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": preset,
        "context": context,
        "layers_per_graph": layers,
        "iters": iters,
        "hbm_roofline_bytes_per_s": HBM_ROOFLINE_BYTES_PER_S,
        "rows": rows,
        "standard_extra_rows": extra_rows,
    }
    if then is not None:
        doc.update(then(cfg, weights))
    return doc


def table(results: dict[str, Any]) -> str:
    """The short table printed last."""
    head = f"{'batch':>5} {'eager_us':>9} {'standard_us':>11} {'special_us':>10} " \
           f"{'speedup':>7} {'vs':>14} {'k_eager':>7} {'k_std':>5} {'k_spec':>6} {'MB':>8} " \
           f"{'roofline':>8}"  # fmt: skip
    lines = [head]
    nan = float("nan")
    for r in results["rows"]:
        if "bytes" not in r:
            lines.append(f"{r['batch']:>5} failed: {r}")
            continue
        lines.append(
            f"{r['batch']:>5} {r.get('standard_eager_us', nan):>9.1f} "
            f"{r.get('standard_us', nan):>11.1f} {r.get('specialized_us', nan):>10.1f} "
            f"{r.get('speedup', nan):>7.2f} {r.get('speedup_vs', '-'):>14} "
            f"{r.get('standard_eager_kernels', 0):>7} {r.get('standard_kernels', 0):>5} "
            f"{r.get('specialized_kernels', 0):>6} "
            f"{r['bytes'] / 1e6:>8.1f} {r.get('roofline_fraction', nan):>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentab.kernels.bench", description=__doc__)
    p.add_argument("--preset", default="k2-tp8-shard")
    p.add_argument("--batch", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument(
        "--standard-extra", default="", help="batch sizes timed for the standard path only"
    )
    p.add_argument("--paths", default=",".join(PATH_NAMES), help="the paths timed")
    p.add_argument("--out", default="results.json")
    p.add_argument("--profile-out", default="", help="write a HardwareProfile TOML here")
    a = p.parse_args(argv)
    from agentab.kernels.profile_toml import write_profile

    batches = [int(b) for b in a.batch.split(",") if b]
    extra = [int(b) for b in a.standard_extra.split(",") if b]
    names = tuple(n for n in a.paths.split(",") if n)
    try:
        check_path_names(names)
    except AgentabError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    res = run_bench(a.preset, batches, a.context, a.layers, a.iters, standard_extra=extra,
                    paths=names)  # fmt: skip
    res["command"] = "python -m agentab.kernels.bench " + " ".join(argv or sys.argv[1:])
    Path(a.out).write_text(json.dumps(res, indent=1))
    if a.profile_out:
        write_profile(res, Path(a.profile_out))
    print(table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

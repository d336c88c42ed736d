"""`kernels bench`: per-layer time of the decode paths on the GPU, and a simulator profile.

For each batch size: every path (standard-eager, standard, specialized) is captured in one
CUDA graph holding `layers` layers with their own weights and caches (weights read per replay
far exceed L2), timed over many replays (median, CUDA events), and its kernels per layer
counted from the profiler. Bytes are the
fewest the step must move (`LayerConfig.step_bytes`, with the routed experts actually touched);
the roofline fraction is bytes / time / 4.3 TB/s for the specialized path, and its speedup is
against the faster of the two standard paths at that batch size (named in `speedup_vs`).

With `--verify K,...` (and `--verify-rows R,...`) it then times speculative decoding's verify
shapes, R rows of 1 + K query tokens, on the compiled standard and the specialized path, their
inputs built by the local engine's own functions (`kernels.verify`): the paged cache, each
row's queries at consecutive positions sharing its block table, the engine's padded graph
size. Their bytes count the cache entries as the attention kernels read them (each query reads
its row's entries) and, beside them, each entry once (`verify_rows` in the results).

Runnable without click: `python -m agentab.kernels.bench --preset k2-tp8-shard ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from agentab.errors import AgentabError
from agentab.kernels.config import HBM_ROOFLINE_BYTES_PER_S, LayerConfig, get_preset
from agentab.kernels.paths import PATH_NAMES, STANDARD_PATHS, check_path_names, result_key
from agentab.kernels.verify import (
    DEFAULT_ROWS,
    VerifyShape,
    build,
    max_len_for,
    parse_verify,
    step_bytes,
)

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
VERIFY_HELP = (
    "speculative decoding's verify shapes: drafts per row k, e.g. 3,5,7; each row is 1 + k "
    "query tokens over its own cached context, built as the local engine's decode graphs run "
    "a verify step (the row's queries share its block table, at positions c..c+k; padded to "
    "the engine's graph size); timed on the standard and specialized paths after the batch "
    "sizes, reported under verify_rows"
)
VERIFY_ROWS_HELP = (
    "the rows (sequences) of each verify shape, e.g. 1,2,4,8 (the default with --verify); "
    "rows x (1 + k) must pad to at most 64 token rows"
)


def verify_shapes(verify: str, rows: str) -> list[VerifyShape] | None:
    """The `--verify` / `--verify-rows` options' shapes (None without `--verify`); bad values
    are one-line errors naming the option."""
    if not verify.strip():
        if rows.strip():
            raise AgentabError("--verify-rows: needs --verify (the drafts per row)")
        return None
    return parse_verify(verify, rows if rows.strip() else ",".join(map(str, DEFAULT_ROWS)))


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


def bench_verify(
    name: str,
    cfg: LayerConfig,
    layers: list[Any],
    shape: VerifyShape,
    context: int,
    max_len: int,
    iters: int,
    seed: int,
) -> dict[str, Any]:
    """Time one path at one verify shape, its inputs built as the local engine builds a verify
    step (`verify.build`); adds the bytes the step reads (`verify.step_bytes`)."""
    from agentab.kernels.paths import make_path

    dev = layers[0].w_o.device
    vb = build(cfg, shape, context, max_len, len(layers), seed + shape.tokens, dev)
    t0 = time.time()
    b = shape.graph_rows
    paths = [make_path(name, cfg, w, max_len, b, paged_slots=vb.slots) for w in layers]
    r = time_layers(paths, vb.states, vb.x, iters, time.time() - t0, breakdown=False)
    pos, tables = vb.host_rows()
    r["bytes"], r["bytes_distinct"] = step_bytes(
        cfg, pos, tables, vb.step.block_size, r["touched_experts"]
    )
    return r


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


# the paths timed at verify shapes: the compiled standard path and the specialized one
VERIFY_PATHS = ("standard", "specialized")
VERIFY_BYTES_NOTE = (
    "bytes: every touched weight once, each token row's new cache entry and activations, and "
    "the cache entries the attention kernels read: one set of programs per token row, so each "
    "of a verify row's 1 + k queries reads the row's entries (up to its own position) itself, "
    "and repeats may be served from L2; bytes_distinct counts each entry once. Padding rows of "
    "the engine's graph (graph_rows - tokens) run too, at position 0 in the scratch block."
)


def finish_verify_row(row: dict[str, Any], detail: dict[str, Any]) -> dict[str, Any]:
    """Complete a verify row from the per-path `bench_verify` results in `detail`: bytes (as
    the kernels read them, and distinct), touched experts, speedup against the standard path,
    and the roofline fractions of both byte counts."""
    if not detail:
        return row
    first = next(iter(detail.values()))
    row["bytes"], row["bytes_distinct"] = first["bytes"], first["bytes_distinct"]
    row["touched_experts"] = first["touched_experts"]

    def share(nbytes: int, us: float) -> float:
        return round(nbytes / (us * 1e-6) / HBM_ROOFLINE_BYTES_PER_S, 3)

    for key in ("specialized", "standard"):
        if f"{key}_us" in row:
            prefix = "" if key == "specialized" else "standard_"
            row[f"{prefix}roofline_fraction"] = share(row["bytes"], row[f"{key}_us"])
            row[f"{prefix}roofline_fraction_distinct"] = share(
                row["bytes_distinct"], row[f"{key}_us"]
            )
    if "specialized_us" in row and "standard_us" in row:
        row["speedup"] = round(row["standard_us"] / row["specialized_us"], 3)
        row["speedup_vs"] = "standard"
    row["kernel_names"] = {k: v["kernel_names"] for k, v in detail.items()}
    return row


def run_verify(
    cfg: LayerConfig,
    weights: list[Any],
    shapes: list[VerifyShape],
    context: int,
    iters: int,
    seed: int,
    paths: tuple[str, ...],
) -> list[dict[str, Any]]:
    """Every verify shape on the compiled standard and the specialized path, one row each."""
    max_len = max_len_for(shapes, context)
    rows = []
    for shape in shapes:
        row: dict[str, Any] = {
            "shape": shape.label, "rows": shape.rows, "k": shape.k,
            "query_tokens": shape.queries, "tokens": shape.tokens,
            "graph_rows": shape.graph_rows, "context": context, "max_len": max_len,
        }  # fmt: skip
        detail: dict[str, Any] = {}
        for name in (p for p in VERIFY_PATHS if p in paths):
            try:
                r = bench_verify(name, cfg, weights, shape, context, max_len, iters, seed)
            except Exception as exc:  # a failing path must not hide the other path's figures
                import traceback

                traceback.print_exc()
                row[f"{result_key(name)}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            row[f"{result_key(name)}_us"] = round(r["us_per_layer"], 2)
            row[f"{result_key(name)}_kernels"] = r["kernels"]
            detail[name] = r
            _log(f"  verify {shape.label:>5} ({shape.graph_rows:2d} rows) {name:11s} "
                 f"{r['us_per_layer']:9.1f} us/layer (p10 {r['p10_us_per_layer']:.1f}, "
                 f"p90 {r['p90_us_per_layer']:.1f}) {r['kernels']} kernels, "
                 f"build {r['build_s']:.1f}s")  # fmt: skip
        rows.append(finish_verify_row(row, detail))
    return rows


def run_bench(
    preset: str,
    batches: list[int],
    context: int,
    layers: int = 4,
    iters: int = 100,
    seed: int = 0,
    standard_extra: list[int] | None = None,
    paths: tuple[str, ...] = PATH_NAMES,
    verify: list[VerifyShape] | None = None,
) -> dict[str, Any]:
    """Measure every batch size (and verify shape); returns the results document (see
    docs/kernels.md). Verify shapes, when given, run after the decode batch sizes, on the
    compiled standard and the specialized path."""
    import torch

    from agentab.kernels.weights import init_weights

    cfg = get_preset(preset)
    dev = torch.device("cuda")
    weights = [init_weights(cfg, seed + 1000 * i, dev) for i in range(layers)]
    rows, extra_rows = [], []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        detail: dict[str, Any] = {}
        for name in paths:
            try:
                r = bench_path(name, cfg, weights, b, context, iters, seed)
            except Exception as exc:  # a failing path must not hide the other path's figures
                import traceback

                traceback.print_exc()
                row[f"{result_key(name)}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            row[f"{result_key(name)}_us"] = round(r["us_per_layer"], 2)
            row[f"{result_key(name)}_kernels"] = r["kernels"]
            detail[name] = r
            _log(f"  batch {b:3d} {name:14s} {r['us_per_layer']:9.1f} us/layer "
                 f"(p10 {r['p10_us_per_layer']:.1f}, p90 {r['p90_us_per_layer']:.1f}) "
                 f"{r['kernels']} kernels, build {r['build_s']:.1f}s")  # fmt: skip
        rows.append(finish_row(cfg, context, row, detail))
    for b in standard_extra or []:
        r = bench_path("standard", cfg, weights, b, context, max(20, iters // 4), seed)
        extra_rows.append({"batch": b, "standard_us": round(r["us_per_layer"], 2),
                           "standard_kernels": r["kernels"]})  # fmt: skip
        _log(f"  batch {b:3d} standard     {r['us_per_layer']:9.1f} us/layer (profile only)")
    verify_rows = run_verify(cfg, weights, verify, context, iters, seed, paths) if verify else []
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
    if verify:
        doc["verify_rows"] = verify_rows
        doc["verify_bytes"] = VERIFY_BYTES_NOTE
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
    if results.get("verify_rows"):
        lines += ["", verify_table(results["verify_rows"])]
    return "\n".join(lines)


def verify_table(rows: list[dict[str, Any]]) -> str:
    """The verify shapes (rows x (1 + k) query tokens, the engine's padded graph rows): MB as
    the kernels read them and distinct, roofline shares of both for the specialized path."""
    head = f"{'verify':>6} {'tokens':>6} {'graph':>5} {'standard_us':>11} {'special_us':>10} " \
           f"{'speedup':>7} {'k_std':>5} {'k_spec':>6} {'MB_read':>8} {'MB_dist':>8} " \
           f"{'roofline':>8} {'roof_dist':>9}"  # fmt: skip
    lines = [head]
    nan = float("nan")
    for r in rows:
        if "bytes" not in r:
            lines.append(f"{r['shape']:>6} failed: {r}")
            continue
        lines.append(
            f"{r['shape']:>6} {r['tokens']:>6} {r['graph_rows']:>5} "
            f"{r.get('standard_us', nan):>11.1f} {r.get('specialized_us', nan):>10.1f} "
            f"{r.get('speedup', nan):>7.2f} {r.get('standard_kernels', 0):>5} "
            f"{r.get('specialized_kernels', 0):>6} {r['bytes'] / 1e6:>8.1f} "
            f"{r['bytes_distinct'] / 1e6:>8.1f} {r.get('roofline_fraction', nan):>8.2f} "
            f"{r.get('roofline_fraction_distinct', nan):>9.2f}"
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
    p.add_argument("--verify", default="", help=VERIFY_HELP)
    p.add_argument("--verify-rows", default="", help=VERIFY_ROWS_HELP)
    p.add_argument("--out", default="results.json")
    p.add_argument("--profile-out", default="", help="write a HardwareProfile TOML here")
    a = p.parse_args(argv)
    from agentab.kernels.profile_toml import write_profile

    batches = [int(b) for b in a.batch.split(",") if b]
    extra = [int(b) for b in a.standard_extra.split(",") if b]
    names = tuple(n for n in a.paths.split(",") if n)
    try:
        shapes = verify_shapes(a.verify, a.verify_rows)
        check_path_names(names)
    except AgentabError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    res = run_bench(a.preset, batches, a.context, a.layers, a.iters, standard_extra=extra,
                    paths=names, verify=shapes)  # fmt: skip
    res["command"] = "python -m agentab.kernels.bench " + " ".join(argv or sys.argv[1:])
    Path(a.out).write_text(json.dumps(res, indent=1))
    if a.profile_out:
        write_profile(res, Path(a.profile_out))
    print(table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

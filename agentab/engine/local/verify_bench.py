"""`agentab engine verify-bench`: speculative decoding's verify shapes, timed per layer on the
compiled standard and the specialized path, with inputs the local engine's own functions build.

A verify step gives each sequence 1 + k query tokens; the local engine runs them as 1 + k token
rows of its decode graphs over the row's block table (`verify_shapes`). This command runs the
kernel bench's decode batch sizes first (`agentab.kernels.bench`, the same layers and weights,
in the same process), then every (rows, k) shape on both paths, and prints a second table:
`verify_rows` in the results. Their bytes count the cache entries as the attention kernels read
them (each query reads its row's entries) and, beside them, each entry once. The shapes live
here, above the kernels, because only the engine knows how it lays a verify step out.

Runnable without click: `python -m agentab.engine.local.verify_bench --verify 3,5,7 ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from agentab.engine.local.verify_shapes import (
    DEFAULT_ROWS,
    VerifyShape,
    build,
    max_len_for,
    parse_verify,
    step_bytes,
)
from agentab.errors import AgentabError
from agentab.kernels.bench import DEFAULT_BATCHES, run_bench, table, time_each_path, time_layers
from agentab.kernels.config import HBM_ROOFLINE_BYTES_PER_S, LayerConfig
from agentab.kernels.paths import PATH_NAMES, check_path_names

VERIFY_HELP = (
    "speculative decoding's verify shapes: drafts per row k, e.g. 3,5,7; each row is 1 + k "
    "query tokens over its own cached context, built as the local engine's decode graphs run "
    "a verify step (the row's queries share its block table, at positions c..c+k; padded to "
    "the engine's graph size); timed on the compiled standard and the specialized path after the "
    "decode batch sizes, reported under verify_rows"
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
    step (`verify_shapes.build`); adds the bytes the step reads (`verify_shapes.step_bytes`)."""
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
        measure = partial(
            bench_verify, cfg=cfg, layers=weights, shape=shape, context=context,
            max_len=max_len, iters=iters, seed=seed,
        )  # fmt: skip
        label = f"verify {shape.label:>5} ({shape.graph_rows:2d} rows)"
        paths_here = [p for p in VERIFY_PATHS if p in paths]
        detail = time_each_path(row, paths_here, measure, label)
        rows.append(finish_verify_row(row, detail))
    return rows


def run_verify_bench(
    preset: str,
    batches: list[int],
    shapes: list[VerifyShape],
    context: int,
    layers: int = 4,
    iters: int = 100,
    seed: int = 0,
    paths: tuple[str, ...] = PATH_NAMES,
) -> dict[str, Any]:
    """The kernel bench's document for `batches`, then the verify shapes over the same layers,
    under `verify_rows` (with `verify_bytes`, what their bytes count)."""

    def verify(cfg: LayerConfig, weights: list[Any]) -> dict[str, Any]:
        rows = run_verify(cfg, weights, shapes, context, iters, seed, paths)
        return {"verify_rows": rows, "verify_bytes": VERIFY_BYTES_NOTE}

    return run_bench(preset, batches, context, layers, iters, seed, paths=paths, then=verify)


def full_table(results: dict[str, Any]) -> str:
    """The decode table, then the verify shapes' table."""
    return table(results) + "\n\n" + verify_table(results.get("verify_rows", []))


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
    p = argparse.ArgumentParser(prog="python -m agentab.engine.local.verify_bench",
                                description=__doc__)  # fmt: skip
    p.add_argument("--preset", default="k2-tp8-shard")
    p.add_argument("--batch", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--paths", default=",".join(PATH_NAMES), help="the paths timed")
    p.add_argument("--verify", default="3,5,7", help=VERIFY_HELP)
    p.add_argument("--verify-rows", default="", help=VERIFY_ROWS_HELP)
    p.add_argument("--out", default="results.json")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batch.split(",") if b]
    names = tuple(n for n in a.paths.split(",") if n)
    try:
        shapes = verify_shapes(a.verify, a.verify_rows)
        check_path_names(names)
    except AgentabError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    if shapes is None:
        print(f"{p.prog}: error: --verify: needs the drafts per row", file=sys.stderr)
        return 2
    res = run_verify_bench(a.preset, batches, shapes, a.context, a.layers, a.iters, paths=names)
    res["command"] = f"{p.prog} " + " ".join(argv or sys.argv[1:])
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(full_table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

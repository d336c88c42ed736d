"""The decoder's speed targets against the H200's measured read ceiling, from committed results.

Targets (specialized layer against the compiled standard layer, k2-tp8-shard, per layer):
>= 1.8x at 1 token, >= 1.3x at every shape of 2 to 32 tokens (verify shapes included),
>= 1.0x at 64 tokens with >= 80% of the 4.3 TB/s roofline. For each measured shape this
prints the bytes the step moves (as the bench counted them), the roofline time, the standard
layer's measured time, the time the target requires, that as a share of the roofline and as
TB/s, and compares it with the fastest read measured on this H200: a target needing more than
that is out of reach whatever the kernels do. Only committed measurements are used; a figure
that is not measured is printed as missing.

    python benchmarks/kernels/ceiling_table.py \
        -o benchmarks/results/kernels-h200-targets-vs-read-ceiling.md \
        --json benchmarks/results/kernels-h200-targets-vs-read-ceiling.json

Inputs (benchmarks/results/): `kernels-h200.json` (context 4096) and
`kernels-h200-context-32k.json` (32768), the decode batch sizes; the later 4k bench runs of the
same standard layer (`kernels-h200-variance/`, `kernels-h200-final-check/`,
`kernels-h200-uv-tail/`) for the fastest standard time measured; the read ceilings in
`kernels-h200-layer-read-ceiling/pdl_ceiling-*.json` (one plain read of the layer's 182.6 MB,
and the same bytes read by six or nine dependent kernels: the 10-kernel structure's ceiling);
verify shapes from `kernels-h200-verify-shapes/verify-context-<C>.json` where they exist
(`scripts/gpu/verify_shapes.sh` writes them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agentab.kernels.config import HBM_ROOFLINE_BYTES_PER_S as ROOFLINE  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DECODE = {4096: "kernels-h200.json", 32768: "kernels-h200-context-32k.json"}
# later 4k runs of the same standard layer (the routed rows summed pointwise, 2026-12-01 on)
STANDARD_4K = (
    "kernels-h200.json",
    "kernels-h200-variance/results-p1.json",
    "kernels-h200-variance/results-p2.json",
    "kernels-h200-final-check/bench.json",
    "kernels-h200-final-check/after-layer-chain/bench.json",
    "kernels-h200-uv-tail/bench.json",
)
CEILING = "kernels-h200-layer-read-ceiling"
VERIFY = "kernels-h200-verify-shapes/verify-context-{}.json"
SMALL = 4  # the specialized path's 10-kernel structure serves up to 4 token rows


def target(tokens: int) -> float:
    """1.8x at 1 token, 1.3x at 2-32, 1.0x above (the 64-token target; 48 tokens, the 8 x 6
    verify shape, has none of its own and is held to it, without the roofline condition)."""
    return 1.8 if tokens == 1 else 1.3 if tokens <= 32 else 1.0


def load(rel: str) -> dict[str, Any] | None:
    path = RESULTS / rel
    return json.loads(path.read_text()) if path.is_file() else None


def read_ceiling() -> dict[str, Any]:
    """The fastest plain read and the fastest multi-kernel read of the layer's bytes."""
    best: dict[str, Any] = {}
    for path in sorted((RESULTS / CEILING).glob("pdl_ceiling-*.json")):
        doc = json.loads(path.read_text())
        for row in doc["rows"]:
            kind = "plain" if row.get("kernels_per_layer") == 1 else "structure"
            if kind not in best or row["us_per_layer"] < best[kind]["us"]:
                best[kind] = {
                    "us": row["us_per_layer"],
                    "bytes": doc["total_bytes"],
                    "tb_s": doc["total_bytes"] / row["us_per_layer"] / 1e6,
                    "variant": row["variant"],
                    "file": f"{CEILING}/{path.name}",
                }
    return best


def fastest_standard_4k() -> dict[int, tuple[float, str]]:
    out: dict[int, tuple[float, str]] = {}
    for rel in STANDARD_4K:
        doc = load(rel)
        for row in doc["rows"] if doc else []:
            us = row.get("standard_us")
            if us is not None and (row["batch"] not in out or us < out[row["batch"]][0]):
                out[row["batch"]] = (us, rel)
    return out


def required(tokens: int, nbytes: float, standard_us: float) -> float:
    """The specialized layer's time the target allows (us)."""
    need = standard_us / target(tokens)
    if tokens == 64:  # and >= 80% of the roofline
        need = min(need, nbytes / (0.8 * ROOFLINE) * 1e6)
    return need


def judge(tb_s: float, graph_rows: int, ceiling: dict[str, Any]) -> str:
    """Out of reach above the fastest read; up to 4 token rows (the 10-kernel structure) also
    above that structure's measured ceiling; from 5 rows (43 kernels) no ceiling is measured."""
    if tb_s > ceiling["plain"]["tb_s"]:
        return "out of reach: above the fastest read"
    if graph_rows <= SMALL:
        if tb_s > ceiling["structure"]["tb_s"]:
            return "out of reach for the 10-kernel structure"
        return "within reach (under the 10-kernel ceiling)"
    return "within the fastest read (43-kernel ceiling not measured)"


def shape_row(
    context: int,
    shape: str,
    tokens: int,
    graph_rows: int,
    nbytes: float,
    std: float,
    spec: float,
    ceiling: dict[str, Any],
    rel: str,
) -> dict[str, Any]:
    """One shape's row: its bytes, the time its target requires, and how that compares with
    the measured read ceiling and with the specialized layer's time now."""
    need = required(tokens, nbytes, std)
    tb_s = nbytes / need / 1e6
    return {
        "context": context, "shape": shape, "tokens": tokens, "graph_rows": graph_rows,
        "mb": nbytes / 1e6, "roofline_us": nbytes / ROOFLINE * 1e6,
        "standard_us": std, "target": target(tokens), "required_us": need,
        "required_share": tb_s / (ROOFLINE / 1e12),
        "required_tb_s": tb_s, "of_fastest_read": tb_s / ceiling["plain"]["tb_s"],
        "floor_us": nbytes / ceiling["plain"]["tb_s"] / 1e6,
        "verdict": judge(tb_s, graph_rows, ceiling),
        "specialized_us": spec, "speedup_now": std / spec, "miss": spec / need - 1,
        "file": rel,
    }  # fmt: skip


def decode_rows(ceiling: dict[str, Any]) -> list[dict[str, Any]]:
    fast = fastest_standard_4k()
    rows = []
    for context, rel in DECODE.items():
        doc = load(rel)
        for r in doc["rows"] if doc else []:
            b, nbytes, std, spec = r["batch"], r["bytes"], r["standard_us"], r["specialized_us"]
            row = shape_row(context, str(b), b, b, nbytes, std, spec, ceiling, rel)
            if context == 4096 and b in fast and fast[b][0] < std:
                strict = required(b, nbytes, fast[b][0])
                row["fastest_standard_us"], row["fastest_standard_file"] = fast[b]
                row["fastest_required_us"] = strict
                row["fastest_required_share"] = nbytes / strict / 1e6 / (ROOFLINE / 1e12)
                row["fastest_miss"] = spec / strict - 1
            rows.append(row)
    return rows


def verify_rows(ceiling: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Measured verify shapes (bytes as the kernels read them and distinct), and the files
    that are missing."""
    rows, missing = [], []
    for context in DECODE:
        rel = VERIFY.format(context)
        doc = load(rel)
        if doc is None:
            missing.append(rel)
            continue
        for r in doc.get("verify_rows", []):
            if "standard_us" not in r or "specialized_us" not in r:
                continue
            row = shape_row(context, r["shape"], r["tokens"], r["graph_rows"], r["bytes_distinct"],
                            r["standard_us"], r["specialized_us"], ceiling, rel)  # fmt: skip
            row["mb_read"] = r["bytes"] / 1e6
            row["required_share_read"] = r["bytes"] / row["required_us"] / 1e6 / (ROOFLINE / 1e12)
            rows.append(row)
    return rows, missing


def render(ceiling: dict[str, Any], dec: list[dict[str, Any]], ver: list[dict[str, Any]],
           missing: list[str]) -> str:  # fmt: skip
    p, s = ceiling["plain"], ceiling["structure"]
    out = [
        "# The 1-64 token targets against the measured read ceiling (H200, k2-tp8-shard)",
        "",
        "Generated by `python benchmarks/kernels/ceiling_table.py` from committed results.",
        "",
        f"- Fastest read measured: {p['bytes'] / 1e6:.1f} MB in {p['us']:.2f} us = "
        f"**{p['tb_s']:.3f} TB/s ({p['tb_s'] / (ROOFLINE / 1e12):.3f} of 4.3 TB/s)**, "
        f'`{p["file"]}`, "{p["variant"]}".',
        f"- The 10-kernel structure's ceiling (the same bytes read by dependent kernels, no "
        f"arithmetic): {s['us']:.2f} us = **{s['tb_s']:.3f} TB/s "
        f'({s["tb_s"] / (ROOFLINE / 1e12):.3f})**, `{s["file"]}`, "{s["variant"]}". '
        "Measured at 1 token's bytes only; no ceiling is measured for the 43-kernel structure "
        "the decoder runs from 5 token rows.",
        "- Floor: bytes at the fastest read, the least time any kernel design can take.",
        "- Required: standard / target (1.8x at 1 token, 1.3x at 2-32, 1.0x at 64 and at "
        "most bytes / (0.8 x 4.3 TB/s)); share = bytes / required / 4.3 TB/s. Miss: how much "
        "slower the specialized layer is now than required (negative: it meets the target).",
        "",
        "## Decode shapes (one token per sequence)",
        "",
        "| context | tokens | MB | roofline us | floor us | standard us | target | "
        "required us | required share | of fastest read | verdict | specialized us | now | "
        "miss |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in dec:
        out.append(
            f"| {r['context']} | {r['tokens']} | {r['mb']:.1f} | {r['roofline_us']:.1f} | "
            f"{r['floor_us']:.1f} | {r['standard_us']:.1f} | {r['target']:.1f}x | "
            f"{r['required_us']:.1f} | {r['required_share']:.3f} | "
            f"{r['of_fastest_read']:.3f} | {r['verdict']} | {r['specialized_us']:.1f} | "
            f"{r['speedup_now']:.2f}x | {r['miss']:+.1%} |"
        )
    out += ["", "Files: " + ", ".join(f"`{f}` ({c})" for c, f in DECODE.items()) + "."]
    strict = [r for r in dec if "fastest_standard_us" in r]
    if strict:
        out += [
            "",
            "Against the fastest standard time measured at 4096 in a later run of the same "
            "standard layer (the target is then stricter):",
            "",
            "| tokens | standard us (fastest) | file | required us | required share | miss |",
            "|---:|---:|---|---:|---:|---:|",
        ]
        for r in strict:
            out.append(
                f"| {r['tokens']} | {r['fastest_standard_us']:.1f} | "
                f"`{r['fastest_standard_file']}` | {r['fastest_required_us']:.1f} | "
                f"{r['fastest_required_share']:.3f} | {r['fastest_miss']:+.1%} |"
            )
    out += ["", "## Verify shapes (rows x (1 + k) query tokens)", ""]
    if ver:
        out += [
            "Bytes with each cache entry once (MB); `read share`: with the entries as the "
            "attention kernels read them (each query its row's entries).",
            "",
            "| context | shape | graph rows | MB | MB read | standard us | target | "
            "required us | required share | read share | verdict | specialized us | now | "
            "miss |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in ver:
            out.append(
                f"| {r['context']} | {r['shape']} | {r['graph_rows']} | {r['mb']:.1f} | "
                f"{r['mb_read']:.1f} | {r['standard_us']:.1f} | {r['target']:.1f}x | "
                f"{r['required_us']:.1f} | {r['required_share']:.3f} | "
                f"{r['required_share_read']:.3f} | {r['verdict']} | "
                f"{r['specialized_us']:.1f} | {r['speedup_now']:.2f}x | {r['miss']:+.1%} |"
            )
    for rel in missing:
        folder, name = rel.split("/")
        out.append(
            f"- missing: {name.removesuffix('.json')} in {folder} (not measured; "
            "scripts/gpu/verify_shapes.sh writes it)"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, help="also write the table here (Markdown)")
    ap.add_argument("--json", type=Path, help="also write the rows here (JSON)")
    a = ap.parse_args(argv)
    ceiling = read_ceiling()
    dec = decode_rows(ceiling)
    ver, missing = verify_rows(ceiling)
    text = render(ceiling, dec, ver, missing)
    sys.stdout.write(text)
    if a.out:
        a.out.write_text(text)
    if a.json:
        doc = {"ceiling": ceiling, "decode": dec, "verify": ver, "missing": missing}
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

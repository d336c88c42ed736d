# ruff: noqa: E501  (log lines)
"""One device call: read ceilings, the PDL trigger A/B and checks (benchmarks/kernels/NOTES.md).

Run on the GPU machine (repo root):  source .gpu/setup.sh && python3 scripts/gpu/explore.py
  A  read ceilings: one plain streaming read (Triton) of the sizes the layer's kernels read,
     alone and as a chain of nine kernels in one graph (the floor of a nine-kernel layer
     without cross-kernel overlap), against one kernel reading the same 182.6 MB;
  B  the specialized path with the PDL trigger at the end (as measured before) and early
     (right after each kernel's wait), versions 8 and 9, batch 1, 2, 4, 64; the standard path
     at 1 and 64 for the speedup;
  C  `kernels check` semantics for the early trigger (context 512);
  D  the remaining batch sizes for the best early variant.
Writes $OUT/explore.json; prints a short table last. EXPLORE_BUDGET_S (default 420) bounds it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

T0 = time.time()
CONTEXT = 4096
OUT = Path(os.environ.get("OUT", "out"))
BUDGET = float(os.environ.get("EXPLORE_BUDGET_S", "300"))
DOC: dict[str, Any] = {"read": {}, "bench": [], "checks": []}


def ints(name: str, default: str) -> list[int]:
    """A comma-separated list of integers from the environment ("" for none)."""
    return [int(x) for x in os.environ.get(name, default).split(",") if x.strip()]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save() -> None:
    DOC["elapsed_s"] = round(time.time() - T0, 1)
    (OUT / "explore.json").write_text(json.dumps(DOC, indent=1))


def read_ceilings() -> None:
    """Stage A: what one streaming read of N bytes costs in a graph, alone and chained."""
    import torch

    from agentab.kernels.harness import capture, time_replays
    from agentab.kernels.read_ceiling import plain_read as launcher

    out = torch.empty(132 * 64, device="cuda", dtype=torch.float32)
    mb = 1 << 20
    # (a first call measured these sizes with a fully unrolled loop; the 1 GB case then
    # spent the call compiling, so the loop is a plain loop now and the list is short)
    sizes = {"qkv_a 30.3MB": 30_277_632, "moe_up 66MB": 66_060_288}
    for name, nbytes in sizes.items():
        copies = max(2, min(16, (600 * mb) // nbytes + 1))  # > 10x L2 per graph replay
        bufs = [torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        best = None
        for per_sm in (2, 8):
            fns = [launcher(b, out, per_sm) for b in bufs]
            g, _ = capture(lambda fns=fns: [f() for f in fns])
            us = time_replays(g, iters=20, warmup=3)["median"] / copies
            DOC["read"][f"{name} x{per_sm}/SM"] = round(us, 2)
            if best is None or us < best[0]:
                best = (us, per_sm)
        us, per_sm = best
        DOC["read"][name] = {
            "us": round(us, 2),
            "per_sm": per_sm,
            "tb_s": round(nbytes / us / 1e6, 3),
        }
        log(f"read {name:>14}: {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s  ({per_sm} programs/SM)")
        del bufs
        torch.cuda.empty_cache()
    # A chain of the layer's nine weight reads in one graph (4 layer copies rotate).
    parts = [30_277_632, 9_437_184, 2_097_152, 4_718_592, 2_097_152, 29_360_128, 5_505_024,
             66_060_288, 33_030_144]  # fmt: skip
    layers = [
        [torch.randn(p // 2, device="cuda").to(torch.bfloat16) for p in parts] for _ in range(4)
    ]
    fns = [launcher(b, out, 4) for lay in layers for b in lay]
    g, _ = capture(lambda: [f() for f in fns])
    us = time_replays(g, iters=20, warmup=3)["median"] / 4
    DOC["read"]["chain of 9 (182.6MB)"] = {
        "us": round(us, 2),
        "tb_s": round(sum(parts) / us / 1e6, 3),
    }
    log(
        f"read chain of 9 kernels, 182.6 MB: {us:.2f} us per layer ({sum(parts) / us / 1e6:.2f} TB/s)"
    )
    save()


def trace_moe(cfg: Any, weights: list, dev: Any, variant: Any) -> None:
    """%globaltimer stamps of moe_up / moe_down CTAs 0-127 (cute.moe.TRACE) in the
    batch-1 layer graph: when each CTA starts, leaves its PDL wait, has routed / staged its
    list, and ends, in us after moe_up's first CTA started."""
    import torch

    from agentab.kernels import specialized
    from agentab.kernels.cute import moe as cmoe
    from agentab.kernels.harness import capture, time_replays
    from agentab.kernels.paths import make_path
    from agentab.kernels.weights import init_state

    cmoe.TRACE = True
    specialized._compiled.clear()
    variant(int(os.environ.get("EXPLORE_TRACE_VERSION", "14")), "end")
    out: dict[str, Any] = {}
    try:
        for b in ints("EXPLORE_TRACE_BATCHES", "1"):
            states = [init_state(cfg, b, CONTEXT, 10 * i + b, dev) for i in range(len(weights))]
            paths = [make_path("specialized", cfg, w, CONTEXT, b) for w in weights]
            x = torch.randn(b, cfg.hidden, device=dev).to(torch.bfloat16)

            def step(paths=paths, states=states, x=x) -> None:
                h = x
                for p, st in zip(paths, states, strict=True):
                    h = p.step(h, st).out

            g, _ = capture(step)
            t = time_replays(g, iters=30, warmup=5)
            g.replay()
            torch.cuda.synchronize()
            for li in (1, 2):
                mb = paths[li].moe_buf
                up = mb.sorted_a[64:576].view(128, 4).long().cpu() & 0xFFFFFFFF
                down = mb.segs.view(-1)[300:812].view(128, 4).long().cpu() & 0xFFFFFFFF
                base = int(up[:, 0].min())

                def rel(v: Any, base: int = base) -> Any:
                    d = (v - base) % (1 << 32)
                    return torch.where(d > (1 << 31), d - (1 << 32), d).double() / 1000.0

                row: dict[str, Any] = {"us_per_layer_traced": t["median"] / len(paths)}
                for name, arr in (("moe_up", up), ("moe_down", down)):
                    for j, point in enumerate(("start", "after wait", "routed/staged", "end")):
                        v = rel(arr[:, j])
                        row[f"{name} {point}"] = [round(float(v.min()), 2),
                                                  round(float(v.median()), 2),
                                                  round(float(v.max()), 2)]  # fmt: skip
                out[f"b{b} layer{li}"] = row
                log(
                    f"trace b{b} layer {li} (us after moe_up's first start; min/median/max over CTAs 0-127):"
                )
                for k, v in row.items():
                    log(f"    {k:26s} {v}")
    except Exception:
        traceback.print_exc()
    finally:
        cmoe.TRACE = False
        specialized._compiled.clear()
    DOC["trace"] = out
    save()


def main() -> int:
    import torch

    from agentab.kernels.bench import bench_path
    from agentab.kernels.check import check_one
    from agentab.kernels.config import get_preset
    from agentab.kernels.weights import init_weights

    OUT.mkdir(parents=True, exist_ok=True)
    log(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
    if os.environ.get("EXPLORE_READ", "0") == "1":  # measured before (NOTES.md)
        try:
            read_ceilings()
        except Exception:
            traceback.print_exc()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = get_preset("k2-tp8-shard")
    dev = torch.device("cuda")
    weights = [init_weights(cfg, 1000 * i, dev) for i in range(4)]
    w_check = init_weights(cfg, 4242, dev)
    log("weights ready")

    def variant(version: int, pdl: str) -> None:
        os.environ["AGENTAB_KERNELS_VERSION"] = str(version)
        os.environ["AGENTAB_KERNELS_PDL"] = pdl

    def bench(path: str, version: int, pdl: str, batch: int) -> float | None:
        if time.time() - T0 > BUDGET:
            log(f"skip bench {path} v{version} {pdl} b{batch}: budget")
            return None
        variant(version, pdl)
        try:
            r = bench_path(path, cfg, weights, batch, CONTEXT, 100, 0)
        except Exception as exc:
            traceback.print_exc()
            DOC["bench"].append({"path": path, "version": version, "pdl": pdl, "batch": batch,
                                 "error": f"{type(exc).__name__}: {exc}"[:400]})  # fmt: skip
            return None
        torch.cuda.empty_cache()
        row = {"path": path, "version": version, "pdl": pdl, "batch": batch,
               **{k: r[k] for k in ("us_per_layer", "p10_us_per_layer", "p90_us_per_layer", "kernels", "build_s")},
               "breakdown": r["eager_kernel_breakdown"]}  # fmt: skip
        DOC["bench"].append(row)
        save()
        log(f"bench {path:11s} v{version} {pdl:5s} b{batch:3d}: {r['us_per_layer']:8.1f} us/layer "
            f"(p10 {r['p10_us_per_layer']:.1f} p90 {r['p90_us_per_layer']:.1f}) {r['kernels']} kernels")  # fmt: skip
        return r["us_per_layer"]

    def check(version: int, pdl: str, batch: int) -> None:
        if time.time() - T0 > BUDGET:
            return
        variant(version, pdl)
        try:
            r = check_one("specialized", cfg, w_check, batch, 512, 0)
        except Exception as exc:
            traceback.print_exc()
            r = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        DOC["checks"].append({"version": version, "pdl": pdl, "batch": batch, **r})
        save()
        log(f"check v{version} {pdl} b{batch}: {'ok' if r.get('ok') else 'FAIL'} "
            f"out {r.get('out_err', float('nan')):.2e} mism {r.get('expert_mismatches')} written {r.get('all_written')}")  # fmt: skip

    # EXPLORE_VARIANTS: "version:pdl" pairs timed at batch 1, 2, 4, 64 (call 2: 8:end, 8:early,
    # 9:early); EXPLORE_CHECK: versions checked (early trigger when the variant says so);
    # EXPLORE_MORE: versions timed at batch 8, 16, 32 too.
    variants = [(int(v), pdl) for v, pdl in
                (x.split(":") for x in os.environ.get("EXPLORE_VARIANTS", "8:end,13:end,14:end").split(","))]  # fmt: skip
    pdl_of = dict(variants)
    for b in (1, 64):
        bench("standard", 8, "end", b)
    for b in ints("EXPLORE_BATCHES", "1,2,4,64"):
        for v, pdl in variants:
            bench("specialized", v, pdl, b)
    for v in ints("EXPLORE_CHECK", "14"):
        for b in ints("EXPLORE_CHECK_BATCHES", "1,2,3,4,5,8,33,64"):
            check(v, pdl_of.get(v, "end"), b)
    if os.environ.get("EXPLORE_MMA", "0") == "1":
        # moe_mma's plan knobs at batch 64 (version 14), each against the default
        from agentab.kernels import specialized
        from agentab.kernels.cute import moe_mma

        base = {
            k: getattr(moe_mma, k) for k in ("UNROLL", "CTAS_PER_SM", "CONTIGUOUS", "WEIGHTS_NO_L1")
        }
        # (call 7 timed, against unroll 7 / 2 CTAs per SM / contiguous runs: unroll 14 with 1 CTA
        # per SM, unroll 4, round robin, weights via L1; the default now combines two of them)
        for label, over in (("default", {}),
                            ("round robin, unroll 7, 2 CTAs/SM", {"UNROLL": 7, "CTAS_PER_SM": 2}),
                            ("default again", {})):  # fmt: skip
            for key, val in {**base, **over}.items():
                setattr(moe_mma, key, val)
            specialized._compiled.clear()
            us = bench("specialized", 14, "end", 64)
            DOC["bench"][-1]["mma_variant"] = label
            log(f"mma variant {label}: {us}")
        for key, val in base.items():
            setattr(moe_mma, key, val)
        specialized._compiled.clear()
    if os.environ.get("EXPLORE_TRACE", "0") == "1":
        trace_moe(cfg, weights, dev, variant)
    # EXPLORE_KNOBS: "label:module.ATTR=value,...;label2:..." plan knobs (module under
    # agentab.kernels, e.g. cute.moe.UP_WORK=0 or specialized.DOWN_ROWS=8), each timed with EXPLORE_KNOB_VERSION at EXPLORE_KNOB_BATCHES.
    knob_sets = [x for x in os.environ.get("EXPLORE_KNOBS", "").split(";") if x.strip()]
    if knob_sets:
        import importlib

        from agentab.kernels import specialized

        kv = int(os.environ.get("EXPLORE_KNOB_VERSION", "14"))
        for knob_set in knob_sets:
            label, _, assigns = knob_set.partition(":")
            saved = []
            for a in (x for x in assigns.split(",") if x.strip()):
                target, _, val = a.partition("=")
                mod_name, _, attr = target.strip().rpartition(".")
                mod = importlib.import_module(f"agentab.kernels.{mod_name}")
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, type(getattr(mod, attr))(int(val)))
            specialized._compiled.clear()
            for b in ints("EXPLORE_KNOB_BATCHES", "1"):
                bench("specialized", kv, pdl_of.get(kv, "end"), b)
                DOC["bench"][-1]["knobs"] = label
                log(f"knobs {label} b{b}")
            for mod, attr, val in saved:
                setattr(mod, attr, val)
            specialized._compiled.clear()
    for b in ints("EXPLORE_MORE_BATCHES", "8,16,32"):
        bench("standard", 8, "end", b)
        for v in ints("EXPLORE_MORE", "14"):
            bench("specialized", v, pdl_of.get(v, "end"), b)
    save()
    print("\nread ceilings (us, TB/s):")
    for k, v in DOC["read"].items():
        if isinstance(v, dict):
            print(f"  {k:>22}: {v['us']:8.2f} us {v['tb_s']:.2f} TB/s")
    print("bench (us/layer):")
    for r in DOC["bench"]:
        if "us_per_layer" in r:
            print(
                f"  {r['path'][:4]} v{r['version']} {r['pdl']:5s} b{r['batch']:3d}: {r['us_per_layer']:8.1f}"
                f" {r.get('mma_variant', '')}{r.get('knobs', '')}"
            )
    bad = [c for c in DOC["checks"] if not c.get("ok")]
    print(
        f"checks: {len(DOC['checks']) - len(bad)}/{len(DOC['checks'])} ok {[(c['version'], c['batch']) for c in bad]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`kernels check`: the decode paths against the fp32 reference at every batch size, on the GPU.

For each batch size: fresh random weights' inputs and cache (ragged context lengths), the path
captured in a CUDA graph as the bench runs it, every output buffer and the cache rows the step
must write poisoned (NaN / -1) before the replay, then `compare.compare_step` (stage-wise errors
<= 1e-2, identical expert sets except ties, every poisoned element overwritten).

Runnable without click: `python -m agentab.kernels.check --preset k2-tp8-shard --batch 1-64`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agentab.errors import AgentabError
from agentab.kernels.config import get_preset
from agentab.kernels.paths import PATH_NAMES, check_path_names


def parse_batches(text: str) -> list[int]:
    """'1-64' or '1,2,4' (or a mix) -> sorted batch sizes; bad text is a one-line error."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise AgentabError(f"--batch: {part!r} is not a number or a range like 1-64") from None
    if not out or min(out) < 1:
        raise AgentabError("--batch: needs batch sizes >= 1")
    return sorted(out)


def check_one(name: str, cfg: Any, w: Any, batch: int, context: int, seed: int) -> dict[str, Any]:
    import torch

    from agentab.kernels.compare import compare_step
    from agentab.kernels.harness import capture
    from agentab.kernels.paths import make_path
    from agentab.kernels.weights import init_state

    dev = w.w_o.device
    gen = torch.Generator(device=dev).manual_seed(seed * 7919 + batch)
    x = torch.randn(batch, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)
    before = init_state(cfg, batch, context, seed + batch, dev, ragged=True)
    state = before.clone()
    path = make_path(name, cfg, w, context, batch)
    graph, so = capture(lambda: path.step(x, state))
    rows = torch.arange(batch, device=dev)
    for t in (so.out, so.h1, so.weights):
        t.fill_(float("nan"))
    so.ids.fill_(-1)
    state.cache[rows, state.positions.long()] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    c = compare_step(
        cfg, w, x, before, so.out, so.h1, so.ids, so.weights, so.router_in,
        so.router_in_normed, state.cache,
    )  # fmt: skip
    return {"path": name, **c.to_dict()}


def run_check(
    preset: str, batches: list[int], context: int, seed: int = 0, paths: tuple[str, ...] = ()
) -> dict[str, Any]:
    import torch

    from agentab.kernels.weights import init_weights

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = get_preset(preset)
    w = init_weights(cfg, seed + 4242, torch.device("cuda"))
    results = []
    for b in batches:
        for name in paths or PATH_NAMES:
            try:
                r = check_one(name, cfg, w, b, context, seed)
            except Exception as exc:  # report and go on: one broken batch size hides no other
                import traceback

                traceback.print_exc()
                r = {"path": name, "batch": b, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                results.append(r)
                print(f"  FAIL batch {b:3d} {name:14s} {r['error'][:200]}", flush=True)
                continue
            results.append(r)
            flag = "ok " if r["ok"] else "FAIL"
            print(f"  {flag} batch {b:3d} {name:14s} h1 {r['h1_err']:.2e} "
                  f"cache {r['cache_err']:.2e} "
                  f"out {r['out_err']:.2e} w {r['weights_err']:.2e} e2e {r['e2e_err']:.2e} "
                  f"experts mismatched {r['expert_mismatches']} ties {r['tie_excused']} "
                  f"written {r['all_written']}", flush=True)  # fmt: skip
    return {
        "device": torch.cuda.get_device_name(),
        "preset": preset,
        "context": context,
        "ok": all(r["ok"] for r in results),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentab.kernels.check", description=__doc__)
    p.add_argument("--preset", default="k2-tp8-shard")
    p.add_argument("--batch", default="1-64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--paths", default=",".join(PATH_NAMES))
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    paths = tuple(x for x in a.paths.split(",") if x)
    check_path_names(paths)
    res = run_check(a.preset, parse_batches(a.batch), a.context, paths=paths)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    n_fail = sum(not r["ok"] for r in res["results"])
    print(f"check: {len(res['results']) - n_fail} passed, {n_fail} failed", flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

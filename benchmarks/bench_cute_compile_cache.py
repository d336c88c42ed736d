"""Cold vs warm compile of the CuTe DSL kernels a local-engine server compiles at startup.

The specialized decoder's graphs (`agentab serve --engine local`, latency_specialized) cover
padded batch sizes 1, 2, 4, 8, ..., 64; `specialized.compile_all` at each of them is every CuTe
DSL compile of the start (six GEMVs per batch size up to 4, the absorb one with the paged MLA
preparation; the SIMT MoE pair for batch 1..4 and the tensor-core pair above). Each run is a
fresh process over one cache folder: `off` (cache disabled), `cold` (empty folder: compile and
store), `warm` (the same folder again: load). Printed: one JSON line per run and a table.

    python benchmarks/bench_cute_compile_cache.py --preset k2-tp8-shard -o OUT.json

Needs the gpu extra (nvidia-cutlass-dsl), not a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from agentab.kernels.config import PRESETS
from agentab.kernels.cute.cache import stats
from agentab.kernels.specialized import compile_all
imported = time.perf_counter() - t0
a = json.loads(sys.argv[1])
cfg = PRESETS[a["preset"]]
t1 = time.perf_counter()
for b in a["sizes"]:
    compile_all(cfg, b, a["slots"], a["max_pos"], paged=True)
s = stats()
print(json.dumps({"import_s": imported, "compile_all_s": time.perf_counter() - t1,
                  "kernels": s.kernels, "compiled": s.compiled, "from_cache": s.from_cache,
                  "rejected": s.rejected, "line": s.describe()}))
"""


def run(mode: str, cache: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, AGENTAB_CACHE_DIR=cache, CUTE_DSL_ARCH="sm_90a")
    env.pop("CUTE_DSL_KEEP", None)
    if mode == "off":
        env["AGENTAB_CUTE_CACHE"] = "0"
    child = {"preset": args.preset, "sizes": args.sizes, "slots": args.slots,
             "max_pos": args.max_model_len + 1}  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(child)], env=env,
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        sys.exit(f"{mode} run failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"mode": mode, "process_s": time.perf_counter() - start, **res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k2-tp8-shard")
    p.add_argument("--sizes", default="1,2,4,8,16,24,32,40,48,56,64",
                   help="padded batch sizes of the specialized graphs")  # fmt: skip
    p.add_argument("--slots", type=int, default=4096 * 256,
                   help="cache slots of a layer (kv_blocks x block_size)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--modes", default="off,cold,warm,warm")
    p.add_argument("-o", "--out", help="write the runs as JSON here")
    args = p.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="cute-cache-bench-") as cache:
        for mode in args.modes.split(","):
            r = run(mode, cache, args)
            print(json.dumps(r), flush=True)
            runs.append(r)
        entries = sum(1 for _ in Path(cache).rglob("*.o"))
        size = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())
    print(f"\n{args.preset}, batch sizes {args.sizes}: {entries} entries, {size / 1e6:.1f} MB")
    print(f"{'mode':6} {'kernels':>7} {'compiled':>8} {'cached':>6} {'compile s':>9} "
          f"{'import s':>8} {'process s':>9}")  # fmt: skip
    for r in runs:
        print(f"{r['mode']:6} {r['kernels']:7d} {r['compiled']:8d} {r['from_cache']:6d} "
              f"{r['compile_all_s']:9.1f} {r['import_s']:8.1f} {r['process_s']:9.1f}")  # fmt: skip
    if args.out:
        meta = {"preset": args.preset, "sizes": args.sizes, "slots": args.slots,
                "max_model_len": args.max_model_len, "entries": entries, "bytes": size}  # fmt: skip
        Path(args.out).write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

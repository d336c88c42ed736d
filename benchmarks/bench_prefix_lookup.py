"""Cost of the admission's prefix-cache lookup (`BlockPool.lookup_free`) in the AgentX hour.

The lookup probes one hash-table slot per block key of a waiting request's prompt, and the
table (8x the block count, 64 MB for gb300-tp16-kimi-k3) is far larger than the CPU caches, so
its cost is memory latency per key, not instructions. This script says how large that is:
it runs `bench_sim_speed.py`'s `c64-1h-auto` case in this process with `lookup_free` wrapped
(calls, keys probed, hits, seconds inside it), then repeats the run's last `--last` lookups
on the final pool, once cold-ish and `--repeats` more times with the table warm from the
previous pass, and prints nanoseconds per key for each. A lookup kernel is only worth changing
if it lowers the in-run figure, which the warm repeats bound from below.

    PYTHONPATH=. taskset -c 1 python benchmarks/bench_prefix_lookup.py [--last 3000]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--last", type=int, default=3000, help="Lookups repeated after the run.")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import bench_sim_speed

    from agentab.engine.kv_cache import BlockPool

    calls, keys, hits, seconds = 0, 0, 0, 0.0
    kept: list[np.ndarray] = []
    pools: list[BlockPool] = []
    inner = BlockPool.lookup_free

    def counted(self: BlockPool, hashes: np.ndarray) -> tuple[np.ndarray, int]:
        nonlocal calls, keys, hits, seconds
        t = time.perf_counter()
        got = inner(self, hashes)
        seconds += time.perf_counter() - t
        calls, keys, hits = calls + 1, keys + len(hashes), hits + len(got[0])
        kept.append(np.array(hashes))
        del kept[: -args.last]
        pools[:] = [self]
        return got

    BlockPool.lookup_free = counted  # type: ignore[method-assign]
    out = Path(tempfile.mkdtemp(prefix="agentab-lookup-"))
    try:
        bench_sim_speed.worker("c64-1h-auto", out / "run")
    finally:
        BlockPool.lookup_free = inner  # type: ignore[method-assign]
        shutil.rmtree(out, ignore_errors=True)
    print(f"in the run: {calls} lookups, {keys} keys ({keys / max(calls, 1):.0f} a lookup), "
          f"{hits} hits, {seconds:.3f} s, {1e9 * seconds / max(keys, 1):.1f} ns a key")  # fmt: skip
    pool = pools[0]
    print(f"pool: {pool.num_blocks} blocks, table {pool._table_size} slots")
    n = sum(len(h) for h in kept)
    for i in range(1 + args.repeats):
        t = time.perf_counter()
        for h in kept:
            inner(pool, h)
        dt = time.perf_counter() - t
        label = "first pass" if i == 0 else f"warm pass {i}"
        print(f"last {len(kept)} lookups again, {label}: {n} keys, {1e9 * dt / n:.1f} ns a key")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

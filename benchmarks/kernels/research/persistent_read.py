"""The read ceiling of a persistent layer: the layer's nine weight reads as nine phases of ONE
kernel separated by grid barriers, against nine kernels in one graph (NOTES.md: 67.6 us) and
one plain read of the same 182.6 MB (43.2 us).

The question it answers (benchmarks/kernels/NOTES.md): does a persistent design
(one launch, a grid-wide barrier where a kernel boundary was, the next phase's first weights
requested before the barrier) keep HBM busy across the dependencies well enough for the batch-1
goal (75% of 4.3 TB/s = 56.6 us for 182.6 MB)? Plain Triton reads, no math: a ceiling.

Run on the GPU machine (repo root):
  source .gpu/setup.sh && python3 -m benchmarks.kernels.research.persistent_read
Writes $OUT/persistent_read.json.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from agentab.kernels.harness import capture, time_replays
from benchmarks.kernels.research.read_ceiling import record_row

OUT = Path(os.environ.get("OUT", "out"))
PARTS = [30_277_632, 9_437_184, 2_097_152, 4_718_592, 2_097_152, 29_360_128, 5_505_024,
         66_060_288, 33_030_144]  # fmt: skip
BLOCK = 4096  # bf16 elements per program per load round (8 KB)


@triton.jit
def _read_share(x_ptr, n, pid, G, first_block, acc, BLOCK: tl.constexpr):
    """Sum this program's contiguous share of x (elements), from block `first_block` on."""
    chunk = tl.cdiv(tl.cdiv(n, G), BLOCK) * BLOCK
    base = pid.to(tl.int64) * chunk
    for i in tl.range(first_block * BLOCK, chunk, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=(offs < n) & (offs < base + chunk), other=0.0).to(
            tl.float32
        )
    return acc


@triton.jit
def _pre(x_ptr, n, pid, G, BLOCK: tl.constexpr, PRE: tl.constexpr):
    """The first PRE blocks of this program's share, loaded now (summed into one vector)."""
    chunk = tl.cdiv(tl.cdiv(n, G), BLOCK) * BLOCK
    base = pid.to(tl.int64) * chunk
    v = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(PRE):
        offs = base + j * BLOCK + tl.arange(0, BLOCK)
        v += tl.load(x_ptr + offs, mask=(offs < n) & (offs < base + chunk), other=0.0).to(
            tl.float32
        )
    return v


@triton.jit
def one_read(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """One tensor per launch (the nine-kernel chain, same read loop)."""
    pid = tl.program_id(0)
    acc = _read_share(x_ptr, n, pid, tl.num_programs(0), 0, tl.zeros([BLOCK], tl.float32), BLOCK)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def persistent_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8,
                      n0, n1, n2, n3, n4, n5, n6, n7, n8,
                      bar_ptr, exit_ptr, out_ptr,
                      BLOCK: tl.constexpr, PRE: tl.constexpr, SYNC: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    first = 0
    # nine phases, written out (each: own share, then the barrier before the next one)
    acc = _read_share(p0, n0, pid, G, first, acc, BLOCK)
    acc, first = _sync(p1, n1, pid, G, bar_ptr, 1, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p1, n1, pid, G, first, acc, BLOCK)
    acc, first = _sync(p2, n2, pid, G, bar_ptr, 2, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p2, n2, pid, G, first, acc, BLOCK)
    acc, first = _sync(p3, n3, pid, G, bar_ptr, 3, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p3, n3, pid, G, first, acc, BLOCK)
    acc, first = _sync(p4, n4, pid, G, bar_ptr, 4, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p4, n4, pid, G, first, acc, BLOCK)
    acc, first = _sync(p5, n5, pid, G, bar_ptr, 5, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p5, n5, pid, G, first, acc, BLOCK)
    acc, first = _sync(p6, n6, pid, G, bar_ptr, 6, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p6, n6, pid, G, first, acc, BLOCK)
    acc, first = _sync(p7, n7, pid, G, bar_ptr, 7, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p7, n7, pid, G, first, acc, BLOCK)
    acc, first = _sync(p8, n8, pid, G, bar_ptr, 8, acc, BLOCK, PRE, SYNC)
    acc = _read_share(p8, n8, pid, G, first, acc, BLOCK)
    tl.store(out_ptr + pid, tl.sum(acc))
    if SYNC:
        # The last program out resets the counters for the next launch (every program has
        # passed every wait by the time it arrives here).
        old = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
        if old == G - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(exit_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sync(nx_ptr, nn, pid, G, bar_ptr, k, acc, BLOCK: tl.constexpr, PRE: tl.constexpr,
          SYNC: tl.constexpr):  # fmt: skip
    """Barrier k (after phase k - 1): request the next phase's first PRE blocks, arrive, wait.
    Returns the accumulator and the first block the next phase still has to read."""
    first = 0
    if PRE > 0:
        acc += _pre(nx_ptr, nn, pid, G, BLOCK, PRE)
        first = PRE
    if SYNC:
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        target = G * k
        while tl.load(bar_ptr, volatile=True) < target:
            pass
    return acc, first


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    doc: dict = {"parts_bytes": PARTS, "rows": []}
    layers = [
        [torch.randn(p // 2, device="cuda").to(torch.bfloat16) for p in PARTS] for _ in range(4)
    ]
    bar = torch.zeros(2, device="cuda", dtype=torch.int32)
    out = torch.zeros(132 * 8, device="cuda", dtype=torch.float32)
    total = sum(PARTS)
    for label, sync, pre, per_sm in (
        ("nine kernels, one per tensor", None, 0, 2),
        ("no barrier (one read, 9 phases)", False, 0, 2),
        ("barriers, nothing requested early", True, 0, 2),
        ("barriers, next phase's first 2 blocks requested early", True, 2, 2),
        ("barriers, next phase's first 4 blocks requested early", True, 4, 2),
        ("nine kernels, one per tensor, 4 programs/SM", None, 0, 4),
        ("no barrier, 4 programs/SM", False, 0, 4),
        ("barriers, 2 blocks early, 4 programs/SM", True, 2, 4),
        ("nine kernels, one per tensor, 8 programs/SM", None, 0, 8),
        # no barrier variant at 8 programs/SM: 1,056 programs are not all resident, and the
        # grid barrier then waits forever (one device call lost ~150 s to it)
    ):
        t0 = time.time()
        grid = (132 * per_sm,)

        def run(lay, sync=sync, pre=pre, grid=grid):
            if sync is None:
                for t in lay:
                    one_read[grid](t, t.numel(), out, BLOCK=BLOCK, num_warps=8)
                return
            persistent_kernel[grid](*lay, *[t.numel() for t in lay], bar[0:], bar[1:], out,
                                    BLOCK=BLOCK, PRE=pre, SYNC=sync, num_warps=8)  # fmt: skip

        fns = [lambda lay=lay: run(lay) for lay in layers]
        g, _ = capture(lambda fns=fns: [f() for f in fns])
        t = time_replays(g, iters=30, warmup=3)
        record_row(doc, OUT / "persistent_read.json", label, t, len(layers), total, t0)


if __name__ == "__main__":
    main()

"""A plain streaming read of a buffer (Triton): the HBM read ceiling the kernels are measured
against (NOTES.md: 43.2 and 44.7 us for the batch-1 layer's 182.6 MB on two machines).

Each program sums its own contiguous share of the buffer; `per_sm` programs per SM set how
many loads are in flight (2 per SM leaves the HBM half idle, 8 reaches ~95% of 4.3 TB/s).
For the GPU scripts only: it imports triton.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

HBM_TB_S = 4.3  # the roofline the issue measures against
BLOCK = 2048  # bf16 elements per program per loop step (4 KB)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * CHUNK
    for i in tl.range(0, CHUNK, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def plain_read(x: torch.Tensor, out: torch.Tensor, per_sm: int, sms: int = 132) -> Callable:
    """A launch reading all of x (bf16) with `per_sm` programs per SM; `out` takes one fp32
    partial sum per program (at least sms * per_sm entries)."""
    n = x.numel()
    chunk, grid = share(n, per_sm, sms)
    return lambda: _read_kernel[(grid,)](x, out, n, CHUNK=chunk, BLOCK=BLOCK, num_warps=8)


def share(n: int, per_sm: int, sms: int = 132) -> tuple[int, int]:
    """(elements per program, programs) to read n elements with about `per_sm` programs per
    SM, each taking whole BLOCKs of one contiguous share."""
    chunk = triton.cdiv(triton.cdiv(n, sms * per_sm), BLOCK) * BLOCK
    return chunk, triton.cdiv(n, chunk)


def record_row(doc: dict, path: Path, label: str, replay_us: dict, layers: int, total_bytes: int,
               started: float, **extra: object) -> dict:  # fmt: skip
    """Append one timed variant (`time_replays` of a graph of `layers` layers) to doc["rows"],
    print it and rewrite `path`, so a later variant's crash loses nothing measured before."""
    us = replay_us["median"] / layers
    row = {"variant": label, "us_per_layer": round(us, 2),
           "p10": round(replay_us["p10"] / layers, 2), "p90": round(replay_us["p90"] / layers, 2),
           "tb_s": round(total_bytes / us / 1e6, 3),
           "roofline": round(total_bytes / us / 1e6 / HBM_TB_S, 3), **extra,
           "s": round(time.time() - started, 1)}  # fmt: skip
    doc["rows"].append(row)
    print(f"{label:58s} {us:7.2f} us/layer  {row['tb_s']:5.2f} TB/s  ({row['roofline']:.2f} of "
          f"roofline, p10 {row['p10']}, p90 {row['p90']})", flush=True)  # fmt: skip
    path.write_text(json.dumps(doc, indent=1))
    return row

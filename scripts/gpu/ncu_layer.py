"""Run the specialized layer once at batch 1 and once at batch 64 (eager), for Nsight Compute.

On the GPU machine:  ncu --clock-control none -k regex:^kernel_cutlass --section ... \
    python3 scripts/gpu/ncu_layer.py
The CuTe DSL kernels are the only ones named kernel_cutlass_*; ncu flushes the caches between
its replay passes, so each kernel reads its weights from HBM as in the graph-replay benchmark.
"""

from __future__ import annotations

import torch

from agentab.kernels.config import get_preset
from agentab.kernels.paths import make_path
from agentab.kernels.weights import init_state, init_weights


def main() -> None:
    """Everything runs here, not at import, so the file imports on a machine without CUDA."""
    cfg = get_preset("k2-tp8-shard")
    dev = torch.device("cuda")
    w = init_weights(cfg, 0, dev)
    for batch in (1, 64):
        path = make_path("specialized", cfg, w, 4096, batch)
        state = init_state(cfg, batch, 4096, batch, dev)
        x = torch.randn(batch, cfg.hidden, device=dev).to(torch.bfloat16)
        path.step(x, state)
        torch.cuda.synchronize()
        print(f"batch {batch} done", flush=True)


if __name__ == "__main__":
    main()

"""A tensor-parallel worker rank of the local engine: `python -m agentab.engine.local.tp_worker`.

Rank 0 (the engine's process) starts one worker per other rank with the model's options as one
JSON argument. A worker builds the same model and cache as rank 0, keeps its slice of the
weights, joins the process group and then runs whatever step rank 0 broadcasts, taking part in
every collective, until rank 0 says "stop" (or dies, which breaks the group's connections).
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta
from typing import Any

import orjson


def run(spec: dict[str, Any]) -> None:
    # Rank 0 stops the group: a SIGTERM or SIGINT sent to the whole process group (how a
    # server is stopped) must not take a worker away under a collective. If rank 0 dies, the
    # group's connections break and the worker's next collective raises, ending it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    from agentab.engine.local.config import model_config
    from agentab.engine.local.executor import TorchExecutor
    from agentab.engine.local.kv_cache import PagedLatentCache
    from agentab.engine.local.model import build_weights
    from agentab.engine.local.tensor_parallel import TPGroup

    rank, world = int(spec["rank"]), int(spec["world"])
    dist.init_process_group(
        "gloo",
        init_method=spec["init_method"],
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=float(spec.get("timeout_s", 600))),
    )
    try:
        cfg = model_config(spec["preset"], num_layers=spec["num_layers"],
                           weight_sets=spec["weight_sets"], tp=world)  # fmt: skip
        device = torch.device("cpu")
        weights = build_weights(cfg, device, int(spec["seed"]), torch.float32, rank=rank)
        cache = PagedLatentCache(cfg.num_layers, int(spec["kv_blocks"]) + 1,
                                 int(spec["block_size"]), cfg.layer.kv_width, device)  # fmt: skip
        tp = TPGroup(rank, world)
        executor = TorchExecutor(cfg, weights, cache, device=device, dtype=torch.float32,
                                 decoder_impl="cpu-torch",
                                 standard_impl="torch-eager", max_rows=int(spec["max_rows"]),
                                 tp=tp)  # fmt: skip
        while True:
            msg = tp.broadcast(None)
            if msg[0] == "stop":
                break
            _kind, plan, inputs = msg
            executor.collect(executor.launch(plan, inputs))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(orjson.loads(sys.argv[1]))

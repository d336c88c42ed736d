"""build_local_engine: the shared scheduler over a real model (`agentab serve --engine local`).

The scheduler is the simulator's (`engine.scheduler`, vLLM V1 semantics) with one difference:
the output is sampled by the model (`synthetic_output=False`), so block hashes of generated
tokens are computed as they are produced. KV capacity is the paged latent cache's block count,
so the scheduler's admission and preemption act on real memory.
"""

from __future__ import annotations

from typing import Any

from agentab.engine.core import Engine
from agentab.engine.local.config import ModelConfig, model_config
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.paths import BACKENDS
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.errors import AgentabError

OPTIONS = (
    "num_layers",
    "weight_sets",
    "kv_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "device",
)
DEFAULT_KV_BLOCKS = {"cpu": 4096}  # CPU: 65,536 tokens of 16; CUDA: what memory allows
GPU_MEMORY_FRACTION = 0.9


def _available_bytes(device: Any) -> tuple[int, str]:
    """Memory the model may take on `device`, and where that figure comes from."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(
            free * GPU_MEMORY_FRACTION
        ), f"{GPU_MEMORY_FRACTION:.0%} of the GPU's free memory"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable"
    return 1 << 62, "unknown"


def check_fits(cfg: ModelConfig, kv_blocks: int, block_size: int, device: Any) -> dict[str, int]:
    """Refuse, before anything is allocated, a model + cache larger than the device's memory."""
    scale = 2 if device.type == "cpu" else 1  # CPU weights are held in fp32
    weights = cfg.weight_bytes() * scale
    kv = PagedLatentCache.bytes_for(cfg.num_layers, kv_blocks, block_size, cfg.layer.kv_width)
    have, source = _available_bytes(device)
    if weights + kv > have:
        raise AgentabError(
            f"preset {cfg.name}: {weights / 2**30:.1f} GiB of weights ({cfg.weight_sets} weight "
            f"sets) + {kv / 2**30:.1f} GiB of KV cache ({kv_blocks} blocks of {block_size}) do "
            f"not fit {device}: {have / 2**30:.1f} GiB available ({source}); lower weight_sets "
            "or kv_blocks"
        )
    return {"weight_bytes": weights, "kv_cache_bytes": kv}


def build_local_engine(preset: str, decode_backend: str = "auto", **options: Any) -> Engine:
    """An Engine running the local torch model (docs/engine.md, "The local engine")."""
    import torch

    from agentab.engine.local.executor import TorchExecutor
    from agentab.engine.local.model import build_weights

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise AgentabError(
            f"engine options: unknown {', '.join(unknown)} (known: {', '.join(OPTIONS)})"
        )
    if decode_backend not in BACKENDS:
        raise AgentabError(
            f"decode_backend: {decode_backend!r} must be one of {', '.join(BACKENDS)}"
        )
    cfg = model_config(
        preset, num_layers=options.get("num_layers"), weight_sets=options.get("weight_sets")
    )
    device = torch.device(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        raise AgentabError(
            "device: the local engine runs on the CPU only so far (the CUDA decode paths, with "
            'the CuTe DSL decoder, are not wired into it yet); pass device = "cpu"'
        )
    if device.type != "cpu":
        raise AgentabError(f"device: {device} is not supported (cpu)")
    block_size = int(options.get("block_size") or 16)
    kv_blocks = int(options.get("kv_blocks") or DEFAULT_KV_BLOCKS["cpu"])
    sizes = check_fits(cfg, kv_blocks, block_size, device)
    seed = int(options.get("seed") or 0)
    dtype = torch.float32
    weights = build_weights(cfg, device, seed, dtype)
    cache = PagedLatentCache(cfg.num_layers, kv_blocks, block_size, cfg.layer.kv_width, device)
    sched_cfg = SchedulerConfig(
        num_blocks=kv_blocks,
        block_size=block_size,
        max_num_seqs=int(options.get("max_num_seqs") or 256),
        max_num_batched_tokens=int(options.get("max_num_batched_tokens") or 2048),
        specialized=decode_backend == "latency_specialized",
        vocab_size=cfg.vocab_size,
        synthetic_output=False,
    )
    executor = TorchExecutor(
        cfg, weights, cache, device=device, dtype=dtype, decoder_impl="cpu-torch"
    )
    describe = {
        "engine": "agentab-local",
        "model": f"agentab-local-{cfg.name}",
        **cfg.describe(),
        "gpu_name": "none (CPU)",
        "gpu_count": 1,
        "tp": 1,
        "decode_backend": decode_backend,
        "spec": None,
        "scheduler": {
            "max_num_seqs": sched_cfg.max_num_seqs,
            "max_num_batched_tokens": sched_cfg.max_num_batched_tokens,
            "block_size": block_size,
            "kv_blocks": kv_blocks,
            "chunked_prefill": True,
            "prefix_caching": True,
        },
        **sizes,
        "seed": seed,
    }
    return Engine(Scheduler(sched_cfg), executor, describe=describe, fast_forward=False)

"""build_simulator: an Engine whose executor is a HardwareProfile instead of a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentab.engine.core import Engine
from agentab.engine.executor import SimExecutor
from agentab.engine.noise import StepNoise
from agentab.engine.paths import check_engine_args
from agentab.engine.profile import load_profile
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.source import engine_source_digest
from agentab.engine.spec_decode import SpecConfig
from agentab.errors import AgentabError

OPTIONS = (
    "num_draft_tokens",
    "acceptance_length",
    "acceptance_probs",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_blocks",
    "block_size",
    "seed",
    "fast_forward",
    "step_noise",
    "run_noise",
    "noise_seed",
)


def build_simulator(profile: str | Path, decode_backend: str = "auto", **options: Any) -> Engine:
    """An in-process simulated engine (docs/interfaces.md). Unknown options are an error.

    `kv_blocks` overrides the profile's KV capacity (to force cache pressure); `fast_forward`
    (default True) may be turned off to step one at a time on the virtual clock. `step_noise`
    and `run_noise` (log-scale sigmas, default 0) add a real engine's timing noise, drawn from
    `noise_seed` (agentab.engine.noise), so A/A runs of one plan differ as they would on a GPU.
    """
    check_engine_args(decode_backend, options, OPTIONS)
    prof = load_profile(profile)
    k = int(options.get("num_draft_tokens") or 0)
    probs = options.get("acceptance_probs")
    spec = SpecConfig(
        num_draft_tokens=k,
        acceptance_length=options.get("acceptance_length"),
        acceptance_probs=tuple(float(p) for p in probs) if probs is not None else None,
        seed=int(options.get("seed") or 0),
    )
    noise = StepNoise(
        step_sigma=options.get("step_noise", 0.0),
        run_sigma=options.get("run_noise", 0.0),
        seed=options.get("noise_seed", 0),
    )
    if prof.async_scheduling and k:
        raise AgentabError(
            f"num_draft_tokens: {prof.source} models an engine with async scheduling "
            "([engine] async_scheduling), which needs num_draft_tokens = 0"
        )
    if decode_backend == "latency_specialized" and k > 7:
        raise AgentabError(
            f"num_draft_tokens: latency_specialized supports at most 7 draft tokens, got {k}"
        )
    block_size = int(options.get("block_size") or 16)
    kv_blocks = options.get("kv_blocks")
    num_blocks = int(kv_blocks) if kv_blocks is not None else prof.capacity_blocks(block_size)
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=int(options.get("max_num_seqs") or 1024),
        max_num_batched_tokens=int(options.get("max_num_batched_tokens") or 8192),
        spec=spec,
        specialized=decode_backend == "latency_specialized",
        specialized_max_padded=prof.specialized_max_padded_tokens,
        specialized_max_requests_by_q=prof.specialized_max_requests_by_q,
        cuda_graph_max_tokens=prof.cuda_graph_max_tokens,
    )
    describe = {
        "engine": "agentab-sim",
        **prof.identity(),
        "decode_backend": decode_backend,
        "spec": spec.describe(),
        "scheduler": {
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "block_size": cfg.block_size,
            "kv_blocks": cfg.num_blocks,
            "chunked_prefill": True,
            "prefix_caching": True,
        },
        "seed": spec.seed,
        "engine_source": engine_source_digest(),
    }
    if noise.active:
        describe["timing_noise"] = noise.describe()
        describe["noise_seed"] = noise.seed
    return Engine(
        Scheduler(cfg),
        SimExecutor(prof, k, spec, noise),
        describe=describe,
        fast_forward=bool(options.get("fast_forward", True)),
        async_scheduling=prof.async_scheduling,
    )

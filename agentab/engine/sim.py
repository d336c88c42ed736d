"""build_simulator: an Engine whose executor is a HardwareProfile instead of a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentab.engine.core import Engine
from agentab.engine.executor import SimExecutor
from agentab.engine.noise import StepNoise
from agentab.engine.options import SimulatorOptions, decode_options, option_names
from agentab.engine.profile import load_profile
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.source import engine_source_digest
from agentab.engine.spec_decode import SpecConfig
from agentab.errors import AgentabError

# The keyword options `build_simulator` takes besides the profile and the decode backend.
OPTIONS = tuple(
    name for name in option_names(SimulatorOptions) if name not in ("profile", "decode_backend")
)


def build_simulator(profile: str | Path, decode_backend: str = "auto", **options: Any) -> Engine:
    """An in-process simulated engine (docs/interfaces.md): `SimulatorOptions` from keywords.

    Unknown options, wrong types and out-of-range values are one-line errors naming the
    option; None leaves an option at its default.
    """
    opts = decode_options(
        SimulatorOptions,
        {**options, "profile": str(profile), "decode_backend": decode_backend},
        known=OPTIONS,
    )
    return simulator_from(opts)


def simulator_from(opts: SimulatorOptions) -> Engine:
    """The simulator `opts` describe. `kv_blocks` overrides the profile's KV capacity (to
    force cache pressure); `fast_forward` False steps one at a time on the virtual clock;
    `step_noise` and `run_noise` add a real engine's timing noise, drawn from `noise_seed`
    (agentab.engine.noise), so A/A runs of one plan differ as they would on a GPU."""
    profile, decode_backend = opts.profile, opts.decode_backend
    prof = load_profile(profile)
    k = opts.num_draft_tokens
    spec = SpecConfig(
        num_draft_tokens=k,
        acceptance_length=opts.acceptance_length,
        acceptance_probs=opts.acceptance_probs,
        seed=opts.seed,
    )
    noise = StepNoise(step_sigma=opts.step_noise, run_sigma=opts.run_noise, seed=opts.noise_seed)
    if decode_backend.specialized and k > 7:
        raise AgentabError(
            f"num_draft_tokens: latency_specialized supports at most 7 draft tokens, got {k}"
        )
    block_size = opts.block_size
    num_blocks = opts.kv_blocks or prof.capacity_blocks(block_size)
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        spec=spec,
        decode_backend=decode_backend,
        specialized_max_padded=opts.specialized_limit(prof.specialized_max_padded_tokens),
        specialized_max_requests_by_q=prof.specialized_max_requests_by_q,
        cuda_graph_max_tokens=prof.cuda_graph_max_tokens,
    )
    describe = {
        "engine": "agentab-sim",
        **prof.identity(),
        "decode_backend": decode_backend.value,
        "specialized_max_tokens": cfg.specialized_max_padded,
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
        fast_forward=opts.fast_forward,
        async_scheduling=prof.async_scheduling,
    )

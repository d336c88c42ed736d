"""build_local_engine: the shared scheduler over a real model (`agentab serve --engine local`).

The scheduler is the simulator's (`engine.scheduler`, vLLM V1 semantics) with one difference:
the output is sampled by the model (`synthetic_output=False`), so block hashes of generated
tokens are computed as they are produced. KV capacity is the paged latent cache's block count,
so the scheduler's admission and preemption act on real memory.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from agentab.engine.core import Engine
from agentab.engine.local.config import ModelConfig, model_config
from agentab.engine.local.dispatch import specialized_limit
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.tensor_parallel import TPGroup
from agentab.engine.options import (
    DecodeBackend,
    LocalOptions,
    SpeculativeConfig,
    decode_options,
    option_names,
)
from agentab.engine.scheduler import Scheduler, SchedulerConfig
from agentab.engine.source import engine_source_digest
from agentab.engine.spec_decode import SpecConfig
from agentab.errors import AgentabError

if TYPE_CHECKING:
    import subprocess

CPU_KV_BLOCKS = 4096  # 65,536 tokens of 16; on the GPU, what memory allows
GPU_MEMORY_FRACTION = 0.9
GPU_RESERVE_BYTES = 8 << 30  # graphs' pools, activations, per-batch-size kernel buffers
DEFAULT_MAX_MODEL_LEN = {"cpu": 16384, "cuda": 131072}
DEFAULT_MAX_NUM_SEQS = {"cpu": 256, "cuda": 64}  # the GPU captures a graph per padded size


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


def check_fits(
    cfg: ModelConfig, kv_blocks: int | None, block_size: int, device: Any
) -> dict[str, int]:
    """Refuse, before anything is allocated, a model + cache larger than the device's memory.

    `kv_blocks` None (the GPU's default) takes what is left after the weights and a reserve.
    """
    scale = 2 if device.type == "cpu" else 1  # CPU weights are held in fp32
    weights = cfg.weight_bytes() * scale
    per_block = PagedLatentCache.bytes_for(cfg.num_layers, 1, block_size, cfg.layer.kv_width)
    have, source = _available_bytes(device)
    if kv_blocks is None:  # rounded down, so two starts on the same GPU agree
        kv_blocks = max(1, (have - weights - GPU_RESERVE_BYTES) // per_block // 4096 * 4096)
    kv = kv_blocks * per_block
    if weights + kv > have:
        raise AgentabError(
            f"preset {cfg.name}: {weights / 2**30:.1f} GiB of weights ({cfg.weight_sets} weight "
            f"sets) + {kv / 2**30:.1f} GiB of KV cache ({kv_blocks} blocks of {block_size}) do "
            f"not fit {device}: {have / 2**30:.1f} GiB available ({source}); lower weight_sets "
            "or kv_blocks"
        )
    return {"weight_bytes": weights, "kv_cache_bytes": kv, "kv_blocks": kv_blocks}


def default_prefill_graphs(kind: str, tp: int) -> bool:
    """`prefill_graphs` left unset: on for one GPU, where an eager prefill or mixed step waits on
    its ~5,000 kernel launches (docs/engine.md, "Piecewise graphs for prefill and mixed steps":
    a 32-token step after 8,192 cached tokens 151 ms eager, 81 ms in the pieces, on the H200);
    off on the CPU (no launches to save: the pieces would run eagerly) and under tensor
    parallelism (not supported there yet)."""
    return kind == "cuda" and tp == 1


# The keyword options `build_local_engine` takes besides the preset and the decode backend.
OPTIONS = tuple(
    name for name in option_names(LocalOptions) if name not in ("preset", "decode_backend")
)


def build_local_engine(preset: str, decode_backend: str = "auto", **options: Any) -> Engine:
    """An Engine running the local torch model (docs/engine.md, "The local engine"):
    `LocalOptions` from keywords (None leaves an option at its default)."""
    opts = decode_options(
        LocalOptions, {**options, "preset": preset, "decode_backend": decode_backend}, known=OPTIONS
    )
    return local_engine_from(opts)


def local_engine_from(opts: LocalOptions, *, graphs_on_cpu: bool = False) -> Engine:
    """The local engine `opts` describe. `graphs_on_cpu`: run the CPU's decode and verify
    steps through the GPU's graph step logic, replayed eagerly with the eager standard layer
    (tests of that logic on a machine without a GPU; the GPU always uses graphs)."""
    import torch

    from agentab.engine.local.executor import TorchExecutor
    from agentab.engine.local.model import build_weights
    from agentab.engine.local.piecewise import PiecewiseGraphs, token_buckets
    from agentab.engine.local.spec import EarlyExitDrafter

    preset, decode_backend, tp = opts.preset, opts.decode_backend, opts.tp
    cfg = model_config(preset, num_layers=opts.num_layers, weight_sets=opts.weight_sets, tp=tp)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AgentabError("device: cuda was asked for, but torch sees no GPU")
    kind = device.type
    block_size = opts.block_size
    asked = opts.kv_blocks or (CPU_KV_BLOCKS if kind == "cpu" else None)
    sizes = check_fits(cfg, asked, block_size, device)
    kv_blocks = sizes.pop("kv_blocks")
    seed = opts.seed
    max_model_len = opts.max_model_len or DEFAULT_MAX_MODEL_LEN[kind]
    max_num_seqs = opts.max_num_seqs or DEFAULT_MAX_NUM_SEQS[kind]
    dtype = torch.float32 if kind == "cpu" else torch.bfloat16
    if tp > 1 and kind == "cuda":
        raise AgentabError(
            f"tp: {tp} ranks on the GPU are not supported yet (tensor parallelism runs on the "
            "CPU over gloo); use tp = 1 on the GPU"
        )
    drafting = spec_config(opts, cfg.num_layers)
    if opts.prefill_graphs and tp > 1:
        raise AgentabError(f"prefill_graphs: not with tensor parallelism yet (tp = {tp})")
    prefill_graphs = (
        default_prefill_graphs(kind, tp) if opts.prefill_graphs is None else opts.prefill_graphs
    )
    group = TPGroup()
    workers: list[subprocess.Popen[bytes]] = []
    if tp > 1:
        spec = {"preset": preset, "num_layers": cfg.num_layers, "weight_sets": cfg.weight_sets,
                "seed": seed, "kv_blocks": kv_blocks, "block_size": block_size,
                "max_rows": max_num_seqs}  # fmt: skip
        group, workers = start_ranks(tp, spec)
    _say(f"weights: {cfg.weight_bytes() / 2**30:.1f} GiB ({cfg.weight_sets} sets) on {device}")
    weights = build_weights(cfg, device, seed, dtype)
    # one block past the scheduler's: the scratch block that graph padding rows write
    cache = PagedLatentCache(cfg.num_layers, kv_blocks + 1, block_size, cfg.layer.kv_width, device)
    gpu_name = torch.cuda.get_device_name(device) if kind == "cuda" else None
    limit = specialized_limit(
        opts.specialized_max_tokens, gpu_name, preset, SchedulerConfig.specialized_max_padded
    )
    if decode_backend.specialized:
        _say(f"specialized path: steps of up to {limit.max_tokens} padded tokens ({limit.reason})")
    sched_cfg = SchedulerConfig(
        num_blocks=kv_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        decode_backend=decode_backend,
        specialized_max_padded=limit.max_tokens,
        vocab_size=cfg.vocab_size,
        synthetic_output=False,
        spec=drafting,
    )
    drafter = None
    if opts.speculative_config is not None:
        drafter = EarlyExitDrafter(cfg, weights, cache, opts.speculative_config.draft_layers,
                                   dtype)  # fmt: skip
    buckets = token_buckets(sched_cfg.max_num_batched_tokens) if prefill_graphs else None
    if kind == "cpu" and not graphs_on_cpu:
        pieces = None
        if buckets is not None:  # the same pieces, run eagerly (tests of the step logic)
            pieces = PiecewiseGraphs(cfg, weights, cache, dtype, buckets,
                                     kv_blocks * block_size, None, capture=False)  # fmt: skip
        executor = TorchExecutor(cfg, weights, cache, device=device, dtype=dtype,
                                 decoder_impl="cpu-torch", standard_impl="torch-eager",
                                 max_rows=max_num_seqs, tp=group, workers=workers,
                                 drafter=drafter, spec=drafting, piecewise=pieces)  # fmt: skip
    else:
        executor = _graph_executor(cfg, weights, cache, device, decode_backend, sched_cfg,
                                   max_model_len, kv_blocks, drafter, buckets)  # fmt: skip
    describe = {
        "engine": "agentab-local",
        "model": f"agentab-local-{cfg.name}",
        **cfg.describe(),
        "gpu_name": gpu_name or "none (CPU)",
        "max_model_len": max_model_len,
        "gpu_count": tp,  # one device per rank
        "tp": tp,
        "decode_backend": decode_backend.value,
        "specialized_max_tokens": sched_cfg.specialized_max_padded,
        "specialized_max_tokens_source": limit.source,
        "specialized_max_tokens_reason": limit.reason,
        # prefill and mixed steps in piecewise graphs, and the token counts they pad up to
        "prefill_graphs": prefill_graphs,
        "prefill_graphs_source": "default" if opts.prefill_graphs is None else "option",
        "prefill_graph_tokens": buckets,
        "spec": _describe_spec(opts.speculative_config, drafting),
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
        "engine_source": engine_source_digest(),
    }
    return Engine(Scheduler(sched_cfg), executor, describe=describe, fast_forward=False)


def spec_config(opts: LocalOptions, num_layers: int) -> SpecConfig:
    """The scheduler's `SpecConfig` of the options' `speculative_config` (none: k = 0), with
    the rules that need the model or the device, each naming its field."""
    sc = opts.speculative_config
    if sc is None:
        return SpecConfig()
    name = "speculative_config"
    k = sc.num_speculative_tokens
    if sc.draft_layers > num_layers:
        raise AgentabError(
            f"{name}.draft_layers: {sc.draft_layers} is more than the model's {num_layers} layers"
        )
    if opts.decode_backend.specialized and k > 7:
        raise AgentabError(
            f"{name}.num_speculative_tokens: latency_specialized supports at most 7 draft "
            f"tokens, got {k}"
        )
    if opts.tp > 1:
        raise AgentabError(f"{name}: not with tensor parallelism yet (tp = {opts.tp}); use tp = 1")
    return SpecConfig(
        num_draft_tokens=k,
        acceptance_length=sc.synthetic_acceptance_length,
        acceptance_probs=sc.synthetic_acceptance_rates,
        seed=opts.seed,
        rejection_sample_method=sc.rejection_sample_method,
    )


def _describe_spec(sc: SpeculativeConfig | None, spec: SpecConfig) -> dict[str, Any] | None:
    """The manifest's record: the config as given, and the per-position rates synthetic
    rejection runs on (a length resolved by vLLM's schedule)."""
    if sc is None:
        return None
    out = sc.describe()
    if spec.synthetic:
        out["synthetic_rates_resolved"] = list(spec.rates)
    return out


def _say(line: str) -> None:
    """Startup progress on stderr (the server's log)."""
    import sys

    print(f"agentab local engine: {line}", file=sys.stderr, flush=True)


def _cute_stats(path: str) -> Any:
    """The CuTe DSL compile counters before a specialized path's graphs (None otherwise)."""
    if path != "specialized":
        return None
    from agentab.kernels.cute.cache import stats

    return stats()


def _graph_executor(
    cfg: ModelConfig,
    weights: Any,
    cache: PagedLatentCache,
    device: Any,
    decode_backend: DecodeBackend,
    sched_cfg: SchedulerConfig,
    max_model_len: int,
    scratch_block: int,
    drafter: Any,
    buckets: list[int] | None = None,
) -> Any:
    """The graph executor: decode graphs for every padded token count the scheduler's
    pure-decode and verify steps can form, and with speculative decoding the drafter's graphs.

    Under `latency_specialized` the specialized decoder's graphs cover the sizes its path
    serves (at most 64 token rows); any larger pure-decode or verify step falls back to
    standard graphs. The standard decode graphs run the compiled standard layer
    (`standard_torch_compile`, vLLM's design); prefill and mixed steps run eager, their routed
    experts through the eager path's grouped GEMM (`standard.StandardPath.moe`). The drafter's
    graphs run the standard layer in both arms, so its work is the same in each.

    On the CPU (tests of this logic) nothing is captured: each replay runs eagerly, the eager
    standard layer in place of the compiled one, and no specialized graphs (the CuTe DSL
    kernels need the GPU).

    With `buckets` (the `prefill_graphs` option), prefill and mixed steps of up to the
    largest bucket's tokens run in piecewise graphs (engine.local.piecewise), captured here,
    after the decode graphs, for every bucket: at start-up rather than on a bucket's first
    step, so no step the engine times pays a capture or an autotune, and the decode graphs'
    memory is taken first."""
    from agentab.engine.local.cuda import DecodeGraphs, TokenPool, graph_sizes
    from agentab.engine.local.executor import TorchExecutor
    from agentab.engine.local.piecewise import PiecewiseGraphs
    from agentab.kernels.standard import StandardPath

    on_gpu = device.type == "cuda"
    standard = [StandardPath(cfg.layer, w, max_model_len) for w in weights.sets]
    compiled: list[Any] = standard  # the decode graphs' standard layer
    standard_impl = StandardPath.impl
    if on_gpu:
        from agentab.kernels import standard_torch_compile as tc

        compiled = [tc.TorchCompileStandardPath(cfg.layer, w, max_model_len) for w in weights.sets]
        standard_impl = tc.IMPL
    spec = sched_cfg.spec
    rows = sched_cfg.max_num_seqs
    step_tokens = rows * (1 + spec.num_draft_tokens)  # a verify step's token rows
    pool = TokenPool(max(step_tokens, sched_cfg.max_num_batched_tokens, 512), device)
    sizes = graph_sizes(step_tokens, sched_cfg.cuda_graph_max_tokens)
    limit = sched_cfg.specialized_max_padded if decode_backend.specialized and on_gpu else 0
    by_path = {"specialized": [b for b in sizes if b <= limit]}
    by_path["standard"] = [b for b in sizes if b > limit]
    if not on_gpu:
        by_path["standard"] = sizes
    graphs = {}
    for path, path_sizes in by_path.items():
        if path_sizes:
            _say(f"capturing {path} decode graphs for token rows {path_sizes}")
            start, kernels = time.perf_counter(), _cute_stats(path)
            graphs[path] = DecodeGraphs(cfg, weights, cache, path, path_sizes, max_model_len,
                                        scratch_block, compiled, pool,
                                        capture=on_gpu)  # fmt: skip
            built = "captured" if on_gpu else "built"
            done = f"{path} decode graphs {built} in {time.perf_counter() - start:.1f} s"
            if kernels is not None:  # what of it was the CuTe DSL kernels' compiles
                done += f"; {_cute_stats(path).since(kernels).describe()}"
            _say(done)
    draft_graphs = None
    if drafter is not None:
        draft_sizes = graph_sizes(rows, sched_cfg.cuda_graph_max_tokens)
        _say(f"capturing the drafter's graphs ({drafter.layers} layers) for rows {draft_sizes}")
        draft_graphs = DecodeGraphs(cfg, weights, cache, "standard", draft_sizes, max_model_len,
                                    scratch_block, compiled, pool, num_layers=drafter.layers,
                                    draft_steps=spec.num_draft_tokens,
                                    capture=on_gpu)  # fmt: skip
        drafter.grouped = standard
    pieces = None
    if buckets is not None:
        _say(f"capturing piecewise prefill graphs ({cfg.num_layers + 1} pieces) for tokens "
             f"{buckets}")  # fmt: skip
        start = time.perf_counter()
        pieces = PiecewiseGraphs(cfg, weights, cache, weights.embed.dtype, buckets,
                                 scratch_block * cache.block_size, standard if on_gpu else None,
                                 capture=on_gpu)  # fmt: skip
        _say(f"piecewise prefill graphs built in {time.perf_counter() - start:.1f} s")
    _say("ready")
    decoder_impl = "cute-dsl" if on_gpu else "cpu-torch"
    return TorchExecutor(cfg, weights, cache, device=device, dtype=weights.embed.dtype,
                         decoder_impl=decoder_impl, standard_impl=standard_impl,
                         max_rows=rows, graphs=graphs, grouped=standard if on_gpu else None,
                         pool=pool, drafter=drafter, spec=spec,
                         draft_graphs=draft_graphs, piecewise=pieces)  # fmt: skip


def start_ranks(tp: int, spec: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Start ranks 1..tp-1 as worker processes and join them as rank 0 (gloo, loopback)."""
    import subprocess
    import sys
    from datetime import timedelta

    import orjson
    import torch.distributed as dist

    from agentab.engine.local.tensor_parallel import TPGroup
    from agentab.engine.vllm.process import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    module = "agentab.engine.local.tp_worker"
    workers = []
    for r in range(1, tp):
        arg = orjson.dumps({**spec, "rank": r, "world": tp, "init_method": init}).decode()
        workers.append(
            subprocess.Popen([sys.executable, "-m", module, arg], stdin=subprocess.DEVNULL)
        )
    _say(f"tensor parallel: {tp} ranks (gloo), workers {[p.pid for p in workers]}")
    dist.init_process_group(
        "gloo", init_method=init, rank=0, world_size=tp, timeout=timedelta(seconds=600)
    )
    return TPGroup(0, tp), workers

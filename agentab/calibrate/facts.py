"""What an engine says about itself, as far as calibration needs it.

A profile's cost terms come from timing the load; its configuration (KV block size and
capacity, GPU count, CUDA-graph padding) and the scheduler limits a simulation must copy to
replay like the engine (max_num_seqs, max_num_batched_tokens) are facts the engine states.
Sources, per engine: agentab's own servers answer `GET /agentab/describe`; vLLM answers
`/server_info` (with VLLM_SERVER_DEV_MODE=1), the `vllm:cache_config_info` metric, `/version`
and `/v1/models`. Each fact keeps its source; a fact nobody stated is None, and the profile
writer then names the field it could not fill.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agentab.engine.vllm.introspect import describe_server, get_json, http_get
from agentab.errors import AgentabError

# The step counters an agentab engine exports (GET /metrics), by decode path.
STEP_SECONDS = "agentab:step_seconds_{path}_total"
STEPS = "agentab:steps_{path}_total"
DECODE_STEPS = "agentab:decode_steps_{path}_total"
# the local engine's drafter, where it drafts (speculative decoding): its time and its steps
DRAFT_SECONDS = "agentab:draft_device_seconds_total"
DRAFT_STEPS = "agentab:draft_steps_total"
# vLLM's histograms timed with the engine core's own timestamps (not the frontend's): the gap
# between a request's tokens, its prefill (scheduled to first token), and tokens per step.
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_PREFILL = "vllm:request_prefill_time_seconds"
VLLM_STEP_TOKENS = "vllm:iteration_tokens_total"


@dataclass
class EngineFacts:
    engine: str  # agentab-sim | agentab-local | vllm | unknown
    url: str
    model: str | None = None
    version: str | None = None
    device: str | None = None
    decode_backend: str | None = None
    gpu_count: int | None = None
    tp: int | None = None
    block_size: int | None = None
    kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    cuda_graph_max_tokens: int | None = None
    # the token counts of the engine's prefill graphs (the local engine's piecewise graphs),
    # which a step with prefill tokens is padded up to
    prefill_graph_tokens: list[int] | None = None
    # schedules step k+1 while step k runs (vLLM's async scheduling; the local engine on a GPU)
    async_scheduling: bool | None = None
    # the engine's own step clock on /metrics: "agentab" (agentab:step_seconds_*_total),
    # "vllm" (engine-core timestamped histograms), or None (client timing only)
    engine_clock: str | None = None
    # agentab's engines: the digest of the engine code that served (agentab.engine.source), so
    # a profile says which engine it describes and `fidelity` can name a change of engine
    engine_source: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def set(self, name: str, value: Any, source: str) -> None:
        if value is None or getattr(self, name) is not None:
            return
        setattr(self, name, value)
        self.sources[name] = source

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("raw")
        return d


def engine_facts(url: str) -> EngineFacts:
    """Ask the server at `url` about itself; an unreachable server is a one-line error."""
    url = url.rstrip("/")
    try:
        http_get(f"{url}/health", timeout_s=10.0)
    except OSError as exc:
        raise AgentabError(f"{url}/health does not answer: {exc}") from None
    try:
        described = get_json(f"{url}/agentab/describe")
    except (OSError, ValueError):
        described = None
    if isinstance(described, dict) and str(described.get("engine", "")).startswith("agentab"):
        facts = _agentab_facts(url, described)
    else:
        facts = _vllm_facts(url)
    try:
        metrics = http_get(f"{url}/metrics").decode(errors="replace")
    except OSError:
        metrics = ""
    if "agentab:step_seconds_standard_total" in metrics:
        facts.engine_clock = "agentab"
    elif all(f"{h}_sum" in metrics for h in (VLLM_ITL, VLLM_PREFILL, VLLM_STEP_TOKENS)):
        facts.engine_clock = "vllm"
    return facts


def _agentab_facts(url: str, d: dict[str, Any]) -> EngineFacts:
    src = "/agentab/describe"
    f = EngineFacts(engine=str(d["engine"]), url=url, raw=d)
    sched = d.get("scheduler") or {}
    f.set("model", d.get("model"), src)
    f.set("version", _agentab_version(), "agentab package")
    f.set("device", d.get("device") or d.get("gpu_name"), src)
    f.set("decode_backend", d.get("decode_backend"), src)
    f.set("gpu_count", d.get("gpu_count"), src)
    f.set("tp", d.get("tp"), src)
    f.set("block_size", sched.get("block_size"), src)
    f.set("kv_blocks", sched.get("kv_blocks"), src)
    f.set("max_num_seqs", sched.get("max_num_seqs"), src)
    f.set("max_num_batched_tokens", sched.get("max_num_batched_tokens"), src)
    f.set("max_model_len", d.get("max_model_len"), src)
    f.set("engine_source", d.get("engine_source"), src)
    sizes = d.get("prefill_graph_tokens")
    f.set("prefill_graph_tokens", list(sizes) if sizes else None, src)
    ahead = d.get("async_scheduling")
    f.set("async_scheduling", ahead if isinstance(ahead, bool) else None, src)
    if f.engine == "agentab-local":
        # the local engine captures CUDA graphs for every padded batch up to max_num_seqs on a
        # GPU and runs eagerly (no padding) on the CPU (docs/engine.md, "The local engine")
        on_cpu = str(d.get("device", "")).startswith("cpu")
        f.set("cuda_graph_max_tokens", 1 if on_cpu else sched.get("max_num_seqs"), src)
    return f


def _vllm_facts(url: str) -> EngineFacts:
    d = describe_server(url)
    f = EngineFacts(engine="vllm" if d.get("version") else "unknown", url=url, raw=d)
    models = d.get("models") or []
    f.set("model", models[0] if models else None, "/v1/models")
    f.set("version", d.get("version"), "/version")
    f.set("max_model_len", d.get("max_model_len"), "/v1/models")
    cache = d.get("cache_config") or {}
    f.set("block_size", _int(cache.get("block_size")), "vllm:cache_config_info")
    f.set("kv_blocks", _int(cache.get("num_gpu_blocks")), "vllm:cache_config_info")
    f.set(
        "decode_backend", (d.get("additional_config") or {}).get("decode_backend"), "/server_info"
    )
    try:
        info = get_json(f"{url}/server_info?config_format=json")
    except (OSError, ValueError):
        info = None
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(config, dict):
        src = "/server_info"
        sc = config.get("scheduler_config") or {}
        f.set("max_num_seqs", sc.get("max_num_seqs"), src)
        f.set("max_num_batched_tokens", sc.get("max_num_batched_tokens"), src)
        ahead = sc.get("async_scheduling")
        f.set("async_scheduling", ahead if isinstance(ahead, bool) else None, src)
        pc = config.get("parallel_config") or {}
        tp, pp = pc.get("tensor_parallel_size"), pc.get("pipeline_parallel_size")
        if isinstance(tp, int) and isinstance(pp, int):
            f.set("tp", tp, src)
            f.set("gpu_count", tp * pp * int(pc.get("data_parallel_size", 1)), src)
        dc = config.get("device_config")
        f.set("device", _device(dc), src)
        mc = config.get("model_config") or {}
        cc = config.get("compilation_config") or {}
        if mc.get("enforce_eager"):
            f.set("cuda_graph_max_tokens", 1, src + " (enforce_eager: no CUDA graphs)")
        else:
            f.set("cuda_graph_max_tokens", cc.get("max_cudagraph_capture_size"), src)
        f.raw["server_info"] = {k: config.get(k) for k in ("scheduler_config", "parallel_config")}
    return f


def _device(dc: Any) -> str | None:
    if isinstance(dc, dict):
        return str(dc.get("device_type") or dc.get("device") or "") or None
    return str(dc) if dc else None


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _agentab_version() -> str:
    from agentab import __version__

    return __version__


def local_engine_schedules_ahead(f: EngineFacts) -> None:
    """Fill `async_scheduling` of an agentab-local engine recorded before its describe stated
    it: the local engine schedules one step ahead exactly when it runs on a GPU (its executor
    launches work without waiting for it there), which its recorded device says."""
    if f.async_scheduling is None and f.engine == "agentab-local" and f.device:
        f.set("async_scheduling", f.device.startswith("cuda"), "device (agentab-local on a GPU)")

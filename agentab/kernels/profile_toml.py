"""Turn a `kernels bench` results document into the simulator's HardwareProfile TOML.

The format is the engine's (docs/engine.md, agentab/engine/profile.py). Only the decode tables
are measured: the simulator adds context reads separately (context tokens x KV bytes / HBM
bandwidth), so the KV bytes the bench's attention read at its context are taken out of each
measured layer time with that same formula. Everything else keeps the values (and [A] labels) of
the placeholder this replaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KV_BYTES_PER_TOKEN = 1152  # bf16 latent: (512 + 64) x 2 bytes
HBM_READ_BYTES_PER_S = 4.5e12


def decode_tables(results: dict[str, Any]) -> dict[str, tuple[list[int], list[float]]]:
    """(batch_tokens, layer_time_us) per path, KV reads at the bench context taken out."""
    ctx = results["context"]
    out: dict[str, tuple[list[int], list[float]]] = {}
    for path in ("standard", "specialized"):
        pts = [(r["batch"], r[f"{path}_us"]) for r in results["rows"] if f"{path}_us" in r]
        if path == "standard":
            pts += [(r["batch"], r["standard_us"]) for r in results.get("standard_extra_rows", [])]
        pts.sort()
        toks, times = [], []
        for b, us in pts:
            kv_us = b * ctx * KV_BYTES_PER_TOKEN / HBM_READ_BYTES_PER_S * 1e6
            toks.append(int(b))
            times.append(round(max(us - kv_us, 1.0), 2))
        out[path] = (toks, times)
    return out


def _fmt(xs: list[Any]) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


def render_profile(results: dict[str, Any]) -> str:
    t = decode_tables(results)
    std_b, std_t = t["standard"]
    spc_b, spc_t = t["specialized"]
    cmd = results.get("command", "agentab kernels bench")
    return f"""# MEASURED decode tables: one NVIDIA H200 running one TP8 rank's shard of a
# Kimi-K2-shaped decoder layer (agentab.kernels, preset {results["preset"]}), written by
# `agentab kernels bench`:
#   {cmd}
# Device: {results["device"]}, torch {results.get("torch", "?")}.
# [M] measured: per-layer time of each decode path, CUDA-graph replays of
#     {results["layers_per_graph"]} layers with their own weights, median of {results["iters"]};
#     context {results["context"]} tokens per sequence.
#     The simulator adds context reads itself (context x bytes_per_token_per_layer /
#     hbm_read_bytes_per_s), so that amount at the bench context is subtracted from each time.
#     The standard path beyond batch 64 is measured too (profile only).
#   [H] this H200, measured (docs/kernels.md).
#   [A] assumption (not measured; kept from the placeholder).
format_version = 1  # profile file format (docs/engine.md)
name = "h200-tp1-kimi-shard"  # identity, recorded in run manifests with the file hash
status = "measured"  # the decode tables are measured; fields marked [A] are not
model = "Kimi-K2-shaped shard (TP8 rank)"  # [H]
gpu_name = "{results["device"]}"  # [M]
gpu_count = 1  # one GPU serves the whole (shard) model
tp = 1  # no tensor parallelism across GPUs
num_layers = 30  # [A] as many layers of the shard as fit one H200 with room for KV
kv_layers = 30  # [A] every layer is MLA

[kv_cache]
block_size_tokens = 16  # vLLM default
capacity_blocks = 50130  # [A] 27.7 GB of bf16 latent for 30 layers
bytes_per_token_per_layer = {KV_BYTES_PER_TOKEN}  # bf16 MLA latent: (512 + 64) x 2 bytes
hbm_read_bytes_per_s = {HBM_READ_BYTES_PER_S:.1e}  # [H] read-only streaming: about 4.5 TB/s

[decode]
cuda_graph_max_tokens = 512  # [A] vLLM default capture sizes

[decode.standard]
batch_tokens = {_fmt(std_b)}  # [M]
layer_time_us = {_fmt(std_t)}  # [M] minus KV reads
step_fixed_us = 90.0  # [A] LM head shard (293 MB at 4.3 TB/s = 68 us) + sampling 22 us

[decode.specialized]
batch_tokens = {_fmt(spc_b)}  # [M]
layer_time_us = {_fmt(spc_t)}  # [M] minus KV reads
step_fixed_us = 90.0  # [A] same LM head and sampling
max_padded_tokens = 64  # vLLM's latency_specialized limit (docs/engine.md, "Decode paths")
max_requests_by_q = [64, 32, 19, 16, 12, 10, 8, 8]  # for q = 1..8 (same source)

[spec_decode]
drafter_step_us = 500.0  # [A] no drafter measured

[prefill]
# [A] 8 GFLOP per token (4B active params of the shard) at 40% of 989 TFLOP/s
tokens_per_s_per_gpu = 49000
attention_flops_per_token_pair = 3.07e5  # [A] 16 heads x 320 x 2 FLOPs x 30 layers
attention_flops_per_s_per_gpu = 3.96e14  # [A] 40% of 989 TFLOP/s BF16
"""


def write_profile(results: dict[str, Any], path: Path) -> None:
    path.write_text(render_profile(results))

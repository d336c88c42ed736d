"""Real vLLM arms (`agentab ab` engine kind `vllm`, `agentab replay` against a launched server).

- `VllmLaunch`: how an arm's server is started (model, command, shared server args, parallel
  sizes, prefix caching, timeouts); `VllmLaunch.from_mapping(table, name)` for experiment files.
- `launched_server(launch, decode_backend=..., gpus=..., log_dir=...)`: context manager that starts
  the server (own process group, free port, `CUDA_VISIBLE_DEVICES` from `gpus`), waits for health
  and yields a `RunningServer` (`url`, `model`, `manifest`); stops the group and frees the port.
- `attached_server(url, gpu_count)`: the same for a server someone else runs.
- `TINY_MOE`: the shipped tiny Qwen3-MoE config (`agentab:tiny-qwen3-moe` as a model name).
"""

from agentab.engine.vllm.args import DECODE_BACKENDS, MODELS_DIR, VllmLaunch, build_args
from agentab.engine.vllm.server import RunningServer, attached_server, launched_server

TINY_MOE = "agentab:tiny-qwen3-moe"
TINY_MOE_PATH = MODELS_DIR / "tiny-qwen3-moe"

__all__ = [
    "DECODE_BACKENDS",
    "TINY_MOE",
    "TINY_MOE_PATH",
    "RunningServer",
    "VllmLaunch",
    "attached_server",
    "build_args",
    "launched_server",
]

"""What a vLLM server says about itself, for the manifest the A/B guard compares.

Sources, most specific first: `/server_info?config_format=json` (only when the server runs with
VLLM_SERVER_DEV_MODE=1: the whole engine config), the engine's startup log line
("Initializing a V1 LLM engine (vX) with config: ...", launch mode only), `/version`,
`/v1/models` and the `vllm:cache_config_info` metric. Each fact records where it came from.
Plain urllib: these are a handful of blocking GETs around server start, outside any event loop.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PARALLEL_KEYS: tuple[str, ...] = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "decode_context_parallel_size",
)
# Engine facts from the startup line worth comparing across arms (raw strings as vLLM prints them).
ENGINE_KEYS: tuple[str, ...] = (
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "max_seq_len",
    "load_format",
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "device_config",
    "speculative_config",
    "seed",
)
_CONFIG_LINE = re.compile(r"Initializing a V1 LLM engine \(v([^)]*)\) with config: (.*)$")


def http_get(
    url: str, *, timeout_s: float = 5.0, headers: Mapping[str, str] | None = None
) -> bytes:
    """GET `url`; raises urllib's errors (callers decide what a failure means)."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


def get_json(url: str, *, timeout_s: float = 5.0, headers: Mapping[str, str] | None = None) -> Any:
    return json.loads(http_get(url, timeout_s=timeout_s, headers=headers))


def _try_json(url: str, headers: Mapping[str, str] | None) -> Any | None:
    try:
        return get_json(url, headers=headers)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def split_config_items(text: str) -> dict[str, str]:
    """Split vLLM's `key=value, key=value(...)` config dump at top-level commas."""
    items: dict[str, str] = {}
    depth = 0
    quote: str | None = None
    start = 0
    for i, ch in enumerate(text + ","):
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            part = text[start:i].strip()
            start = i + 1
            if "=" in part:
                key, value = part.split("=", 1)
                items[key.strip()] = value.strip().strip("'")
    return items


def parse_startup_log(log_path: Path) -> dict[str, Any] | None:
    """Version, parallel sizes and engine facts from the engine's startup config line."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        match = _CONFIG_LINE.search(line)
        if not match:
            continue
        items = split_config_items(match.group(2))
        parallel = {k: int(items[k]) for k in PARALLEL_KEYS if items.get(k, "").isdigit()}
        engine = {k: items[k] for k in ENGINE_KEYS if k in items}
        return {"version": match.group(1), "parallel": parallel, "engine": engine}
    return None


def parse_info_metric(metrics_text: str, name: str) -> dict[str, str] | None:
    """Labels of an `*_info` gauge such as `vllm:cache_config_info` (the engine label dropped)."""
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body = line[len(name) + 1 : line.rindex("}")]
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body))
        labels.pop("engine", None)
        return labels
    return None


def describe_server(
    url: str, *, headers: Mapping[str, str] | None = None, log_path: Path | None = None
) -> dict[str, Any]:
    """Everything the server reports about itself, with each fact's source."""
    facts: dict[str, Any] = {}
    version = _try_json(f"{url}/version", headers)
    facts["version"] = version.get("version") if isinstance(version, dict) else None
    models = _try_json(f"{url}/v1/models", headers)
    data = models.get("data", []) if isinstance(models, dict) else []
    facts["models"] = [m.get("id") for m in data if isinstance(m, dict)]
    facts["max_model_len"] = data[0].get("max_model_len") if data else None
    facts["model_root"] = data[0].get("root") if data else None
    try:
        metrics = http_get(f"{url}/metrics", headers=headers).decode(errors="replace")
    except (urllib.error.URLError, OSError):
        metrics = ""
    facts["cache_config"] = parse_info_metric(metrics, "vllm:cache_config_info")

    parallel: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    additional: dict[str, Any] | None = None
    info = _try_json(f"{url}/server_info?config_format=json", headers)
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(config, dict):
        pc = config.get("parallel_config") or {}
        parallel = {k: pc[k] for k in PARALLEL_KEYS if k in pc}
        parallel["source"] = "/server_info"
        additional = config.get("additional_config")
        mc = config.get("model_config") or {}
        engine = {k: mc.get(k) for k in ("dtype", "max_model_len", "quantization") if k in mc}
        cc = config.get("cache_config") or {}
        engine["kv_cache_dtype"] = cc.get("cache_dtype")
        engine["speculative_config"] = config.get("speculative_config")
        engine["source"] = "/server_info"
    if parallel is None and log_path is not None:
        parsed = parse_startup_log(log_path)
        if parsed:
            parallel = {**parsed["parallel"], "source": "startup log"}
            engine = {**parsed["engine"], "source": "startup log"}
            facts["version"] = facts["version"] or parsed["version"]
    facts["parallel_config"] = parallel
    facts["engine_config"] = engine
    facts["additional_config"] = additional
    return facts

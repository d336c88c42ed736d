"""Where a measured replay's time to first token went, as the server saw it and the client did.

Why: the simulator prices steps; a TTFT gap between the simulated and the measured replay is
either in the steps (queue, prefill) or outside them (the server's intake and output, the
network). agentab's server exports per-request histograms (agentab.engine.request_metrics);
/metrics is read before and after the measured replay, and the means over the requests in
between are set beside the client's mean TTFT and the simulator's. A server without those
histograms (vLLM exports queue and prefill but not the intake and output) gives no breakdown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentab.engine.request_metrics import BREAKDOWN, TTFT
from agentab.replay.metrics import parse_prometheus

PARTS = ("intake", "queue", "prefill", "output")


def read_histograms(url: str) -> dict[str, float] | None:
    """`_sum` and `_count` of the server's per-request histograms (summed over labels), or
    None when the server does not export them or does not answer."""
    from agentab.engine.vllm.introspect import http_get

    try:
        text = http_get(url.rstrip("/") + "/metrics", timeout_s=10.0).decode(errors="replace")
    except OSError:
        return None
    wanted = {f"{name}_{s}" for name in (*BREAKDOWN, TTFT) for s in ("sum", "count")}
    values: dict[str, float] = {}
    for name, _labels, value in parse_prometheus(text):
        if name in wanted:
            values[name] = values.get(name, 0.0) + value
    return values if len(values) == len(wanted) else None


def client_ttft_mean(run_dir: Path) -> tuple[float | None, int]:
    """Mean TTFT (seconds) over a run dir's requests that got a first chunk, and their count."""
    import polars as pl

    from agentab.rundir import scan_records

    first = (
        scan_records(run_dir)
        .filter(pl.col("error_class").is_null())
        .select(pl.col("chunk_times_s").list.first().alias("ttft"))
        .drop_nulls()
        .collect()
    )
    n = first.height
    return (float(first["ttft"].mean()) if n else None), n  # type: ignore[arg-type]


def ttft_breakdown(
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    measured_dir: Path,
    simulated_dir: Path,
) -> dict[str, Any] | None:
    """Means in milliseconds: the server's parts, their sum, the client's and the simulator's
    TTFT, and what the client saw beyond the server's parts (the network, both processes'
    loops). None when the server exports no per-request histograms."""
    if before is None or after is None:
        return None

    def mean_ms(name: str) -> tuple[float | None, int]:
        n = int(after[f"{name}_count"] - before[f"{name}_count"])
        total = after[f"{name}_sum"] - before[f"{name}_sum"]
        return (total / n * 1e3 if n else None), n

    server = {part: mean_ms(name)[0] for part, name in zip(PARTS, BREAKDOWN, strict=True)}
    engine_ttft, n_server = mean_ms(TTFT)
    client, n_client = client_ttft_mean(measured_dir)
    simulated, n_sim = client_ttft_mean(simulated_dir)
    parts = [v for v in server.values() if v is not None]
    server_ttft = sum(parts) if len(parts) == len(PARTS) else None
    client_ms = client * 1e3 if client is not None else None
    return {
        "server_ms": server,
        "server_ttft_ms": server_ttft,
        "engine_ttft_ms": engine_ttft,  # vllm:time_to_first_token_seconds: arrival -> first token
        "client_ttft_ms": client_ms,
        "simulated_ttft_ms": simulated * 1e3 if simulated is not None else None,
        "beyond_server_ms": (
            client_ms - server_ttft if client_ms is not None and server_ttft is not None else None
        ),
        "requests": {"server": n_server, "client": n_client, "simulated": n_sim},
    }


def render_breakdown(b: dict[str, Any]) -> list[str]:
    """Markdown lines: one table of means."""

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.2f}"

    s = b["server_ms"]
    n = b["requests"]
    return [
        f"TTFT breakdown (means, ms; {n['server']} requests on the server, {n['client']} "
        f"measured, {n['simulated']} simulated):",
        "",
        "| intake | queue | prefill | output | server TTFT | beyond the server | client TTFT "
        "| simulated TTFT |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {ms(s['intake'])} | {ms(s['queue'])} | {ms(s['prefill'])} | {ms(s['output'])} "
        f"| {ms(b['server_ttft_ms'])} | {ms(b['beyond_server_ms'])} | {ms(b['client_ttft_ms'])} "
        f"| {ms(b['simulated_ttft_ms'])} |",
    ]

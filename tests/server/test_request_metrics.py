"""The server's per-request latency histograms (agentab.engine.request_metrics): vLLM's names
and buckets, one observation per request, and values that add up to what the engine did.

The simulator is served with async scheduling, so a step's tokens are handed out exactly when
it was priced to end: a request alone on the engine has a prefill time of exactly its first
step's price, which the step records give."""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentab.engine import build_simulator
from agentab.engine.request_metrics import HISTOGRAMS
from agentab.engine.server import EngineServer, start_server
from agentab.replay.metrics import parse_prometheus

PROMPT = list(range(1, 41))


def async_profile(tmp_path: Path) -> Path:
    text = (resources.files("agentab.engine") / "profiles" / "h200-tp1-kimi-shard.toml").read_text()
    path = tmp_path / "async.toml"
    path.write_text(text + "\n[engine]\nasync_scheduling = true\n")
    return path


def test_each_request_is_observed_once_and_the_parts_add_up(tmp_path: Path) -> None:
    engine = build_simulator(async_profile(tmp_path), max_num_batched_tokens=64)
    records: list[dict[str, Any]] = []
    engine.step_observer = records.append  # the server reads the records beside this one
    server = EngineServer(engine, model="m", record_emissions=True)

    async def body() -> tuple[str, dict[str, Any]]:
        runner, port = await start_server(server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for i, stream in enumerate((True, True, False)):  # one at a time: alone
                    req = {"prompt": [*PROMPT, i + 100], "max_tokens": 4, "stream": stream}
                    async with http.post(
                        url + "/v1/completions", json=req, headers={"X-Request-Id": f"r{i}"}
                    ) as r:
                        assert r.status == 200
                        await r.read()
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                async with http.get(url + "/agentab/timings") as r:
                    timings = await r.json()
        finally:
            await runner.cleanup()
        return text, timings

    text, timings = asyncio.run(body())
    samples = parse_prometheus(text)
    values = {(n, labels.get("le")): v for n, labels, v in samples}
    for name, (_, bounds) in HISTOGRAMS.items():
        want = 2.0 if name == "agentab:first_token_output_seconds" else 3.0  # streams only
        assert values[(f"{name}_count", None)] == want, name
        buckets = [values[(f"{name}_bucket", repr(float(b)))] for b in bounds]
        assert buckets == sorted(buckets)  # cumulative
        assert values[(f"{name}_bucket", "+Inf")] == want
        assert f"# TYPE {name} histogram" in text
    assert all(labels["model_name"] == "m" for _, labels, _ in samples)

    # each 41-token prompt is one step of its own: its prefill time is that step's price
    firsts: dict[str, float] = {}
    for rec in records:
        for row in rec["requests"]:
            firsts.setdefault(row["id"].rsplit("-", 1)[-1], rec["duration_s"])
    prefill = values[("vllm:request_prefill_time_seconds_sum", None)]
    assert prefill == pytest.approx(sum(firsts.values()), abs=1e-9)

    assert sorted(timings) == ["r0", "r1", "r2"]
    order = ("received", "arrival", "scheduled", "token", "seen", "written", "finished")
    for rid, t in timings.items():
        stamps = [t[k] for k in order if t[k] is not None]
        assert stamps == sorted(stamps), rid
        assert (t["written"] is None) == (rid == "r2")  # the whole answer is not a stream
    ttft = values[("vllm:time_to_first_token_seconds_sum", None)]
    assert ttft == pytest.approx(sum(t["seen"] - t["arrival"] for t in timings.values()))
    intake = values[("agentab:request_intake_seconds_sum", None)]
    assert intake == pytest.approx(sum(t["arrival"] - t["received"] for t in timings.values()))


def test_timings_need_recording_switched_on() -> None:
    server = EngineServer(build_simulator("h200-tp1-kimi-shard"))

    async def body() -> int:
        runner, port = await start_server(server, "127.0.0.1", 0)
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/agentab/timings") as r,
            ):
                return r.status
        finally:
            await runner.cleanup()

    assert asyncio.run(body()) == 404

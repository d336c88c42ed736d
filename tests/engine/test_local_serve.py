"""The local engine behind real HTTP: `agentab serve --engine local`, replay, and `agentab ab`.

Each server is its own process (as each A/B arm is), serving the tiny preset on the CPU.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import polars as pl
import pytest

pytest.importorskip("torch")

from agentab.replay import replay_to_dir
from agentab.replay.options import ReplayOptions
from agentab.workloads.generator import apply_overrides, generate, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-tiny-cpu.toml"
pytestmark = pytest.mark.slow


def small_workload(sessions: int = 3, seed: int = 7):
    """The CPU example's AgentX-style generator settings (short contexts)."""
    gen = tomllib.loads(EXAMPLE.read_text())["workload"]["generate"]
    config = apply_overrides(load_config("agentx-coding"), gen["config"], "test")
    return generate(config, sessions, seed)


class Served:
    """`agentab serve --engine local` in a subprocess; its port from the listening line."""

    def __init__(self, backend: str) -> None:
        args = [sys.executable, "-m", "agentab", "serve", "--engine", "local", "--preset", "tiny"]
        args += ["--device", "cpu", "--decode-backend", backend, "--port", "0"]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("agentab serve: listening on http://127.0.0.1:"), line
        assert f"decoder cpu-torch, decode_backend {backend}" in line
        self.url = "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0]

    def stop(self) -> str:
        self.proc.terminate()
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err
        return out


async def completion_ids(url: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    async def one(http: aiohttp.ClientSession, p: list[int]) -> list[int]:
        body = {"prompt": p, "max_tokens": n, "stream": True, "ignore_eos": True}
        ids: list[int] = []
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    for choice in orjson.loads(line[6:])["choices"]:
                        ids.extend(choice["token_ids"])
        return ids

    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(one(http, p) for p in prompts)))


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


@pytest.fixture(scope="module")
def served_runs(tmp_path_factory: pytest.TempPathFactory):
    """Per backend: a replay of a generated workload, fixed-prompt tokens, the counters."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 32000, size=n).tolist() for n in (23, 48, 70)]
    workload = small_workload()
    results = {}
    for backend in ("auto", "latency_specialized"):
        server = Served(backend)
        try:
            out = tmp_path_factory.mktemp(backend)
            run_dir = replay_to_dir(
                workload,
                url=server.url,
                replay=ReplayOptions(
                    concurrency=2, duration_s=None, max_requests=16, warmup_requests=1, seed=3
                ),
                out_dir=out / "run",
                progress=False,
            )
            ids = asyncio.run(completion_ids(server.url, prompts, 9))
            counters = asyncio.run(metrics(server.url))
        finally:
            stopped = server.stop()
        results[backend] = (run_dir, ids, counters, stopped)
    return results


def test_replays_of_both_backends_succeed_over_http(served_runs) -> None:
    for backend, (run_dir, _ids, _c, stopped) in served_runs.items():
        records = pl.read_ipc(f"{run_dir}/records/*.arrow")
        assert len(records) >= 16, backend
        assert records["error_class"].null_count() == len(records), backend
        assert (records["completion_tokens"] == records["osl"]).all()
        manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
        assert manifest["decoder_impl"] == "cpu-torch"
        assert manifest["decode_backend"] == backend and manifest["engine"] == "agentab-local"
        assert "stopped" in stopped


def test_greedy_tokens_are_identical_across_backends_over_http(served_runs) -> None:
    auto, special = served_runs["auto"][1], served_runs["latency_specialized"][1]
    assert [len(x) for x in auto] == [9, 9, 9]
    assert auto == special


def test_decode_steps_are_counted_by_path(served_runs) -> None:
    a = served_runs["auto"][2]
    b = served_runs["latency_specialized"][2]
    assert a["agentab:decode_steps_specialized_total"] == 0
    assert a["agentab:decode_steps_standard_total"] > 0
    assert b["agentab:decode_steps_specialized_total"] > 0
    # under latency_specialized every pure-decode step here is within the path's limits
    assert b["agentab:decode_steps_standard_total"] == 0
    assert b["agentab:steps_standard_total"] > 0  # prefill and mixed steps fall back


def test_ab_experiment_of_kind_local_produces_a_report(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    text = text.replace("repeats = 2", "repeats = 1").replace(
        "duration_s = 20.0", "duration_s = 6.0"
    )
    path = tmp_path / "exp.toml"
    path.write_text(text)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "agentab", "ab", str(path), "-o", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr
    report = (out / "report.md").read_text()
    assert "engine agentab-local; specialized decoder implementation cpu-torch" in report
    assert (
        "serving steps of up to 64 padded tokens (vLLM's rule; no dispatch measured for this "
        "device)" in report
    )
    assert "| decode steps on the specialized path (server) | 0.0% | 100.0% |" in report
    logs = sorted(out.glob("*/run-*/local-server.log"))
    assert [p.parent.parent.name for p in logs] == ["auto", "latency_specialized"]
    for log in logs:  # each arm had its own server process, stopped after its run
        assert log.read_text().count("agentab serve: stopped") == 1

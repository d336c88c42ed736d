"""`agentab serve` / EngineServer: the OpenAI-compatible surface over the simulator (loopback)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from agentab.clock import run_virtual
from agentab.engine import build_simulator
from agentab.engine.server import EngineServer, start_server, tokenize_text
from agentab.engine.types import EngineRequest
from agentab.replay.metrics import parse_prometheus

PROFILE = "h200-tp1-kimi-shard"
PROMPT = list(range(1, 41))  # 40 tokens: two full 16-token blocks


@asynccontextmanager
async def served(**kw: Any) -> AsyncIterator[tuple[str, EngineServer]]:
    server = EngineServer(build_simulator(PROFILE), **kw)
    runner, port = await start_server(server, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        await runner.cleanup()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())


async def _sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data: "):
            payload = line[6:]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def test_completions_stream_usage_and_cached_tokens() -> None:
    async def body() -> None:
        async with served() as (url, _), aiohttp.ClientSession() as http:
            req = {
                "prompt": PROMPT,
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for expected_cached in (0, 32):  # the second time, both full blocks hit
                async with http.post(url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    events = await _sse(resp)
                assert events[-1] == "[DONE]"
                usage = events[-2]["usage"]
                assert events[-2]["choices"] == []
                assert usage == {
                    "prompt_tokens": 40,
                    "completion_tokens": 5,
                    "total_tokens": 45,
                    "prompt_tokens_details": {"cached_tokens": expected_cached},
                }
                chunks = events[:-2]
                assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            # Without include_usage there is no usage chunk.
            req["stream_options"] = {}
            async with http.post(url + "/v1/completions", json=req) as resp:
                events = await _sse(resp)
            assert all("usage" not in e for e in events[:-1])

    run(body)


def test_completions_non_streaming_and_text_prompt() -> None:
    async def body() -> None:
        async with served() as (url, _), aiohttp.ClientSession() as http:
            text = " ".join(f"w{i}" for i in range(20))
            async with http.post(
                url + "/v1/completions", json={"prompt": text, "max_tokens": 3}
            ) as resp:
                out = await resp.json()
            assert out["object"] == "text_completion"
            assert out["usage"]["prompt_tokens"] == 20 == len(tokenize_text(text))
            assert out["usage"]["completion_tokens"] == 3
            assert len(out["choices"][0]["text"].split()) == 3

    run(body)


def test_chat_stream_opens_with_role_then_content() -> None:
    async def body() -> None:
        async with served() as (url, _), aiohttp.ClientSession() as http:
            req = {
                "messages": [{"role": "user", "content": "one two three"}],
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with http.post(url + "/v1/chat/completions", json=req) as resp:
                events = await _sse(resp)
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert events[0]["object"] == "chat.completion.chunk"
            content = events[1:-2]
            assert sum(len(e["choices"][0]["token_ids"]) for e in content) == 4
            assert events[-2]["usage"]["prompt_tokens"] == 3
            req["stream"] = False
            async with http.post(url + "/v1/chat/completions", json=req) as resp:
                out = await resp.json()
            assert out["choices"][0]["message"]["role"] == "assistant"
            assert out["usage"]["completion_tokens"] == 4

    run(body)


@pytest.mark.parametrize(
    ("payload", "status", "fragment"),
    [
        (b"{not json", 400, "invalid JSON body"),
        (b'{"max_tokens": 2}', 400, "'prompt' must be"),
        (b'{"prompt": [1, 2], "max_tokens": 0}', 400, "max_tokens must be at least 1"),
        (b'{"prompt": [1, 99999999], "max_tokens": 1}', 400, "token ids must be in"),
        (b'{"prompt": [[1, 2]], "max_tokens": 1}', 400, "batched prompts"),
        (b'{"prompt": [1, 2], "max_tokens": 1, "model": "nope"}', 404, "`nope` does not exist"),
        (
            b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_tokens": 100}',
            400,
            "maximum context length is 64 tokens. However, you requested 110 tokens",
        ),
    ],
)
def test_bad_requests_get_vllm_shaped_errors(payload: bytes, status: int, fragment: str) -> None:
    async def body() -> None:
        async with served(max_model_len=64) as (url, _), aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", data=payload) as resp:
                assert resp.status == status
                err = await resp.json()
            assert err["object"] == "error" and err["code"] == status
            assert fragment in err["message"]

    run(body)


def test_prompt_beyond_kv_capacity_is_a_400() -> None:
    async def body() -> None:
        server = EngineServer(build_simulator(PROFILE, kv_blocks=4))  # 64 tokens of KV
        runner, port = await start_server(server, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as http:
                req = {"prompt": list(range(1, 101)), "max_tokens": 1}
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=req) as r:
                    assert r.status == 400
                    assert "KV blocks" in (await r.json())["message"]
        finally:
            await runner.cleanup()

    run(body)


def test_models_health_metrics_describe_emissions() -> None:
    async def body() -> None:
        async with (
            served(model="m1", record_emissions=True) as (url, _),
            aiohttp.ClientSession() as http,
        ):
            async with http.get(url + "/health") as r:
                assert r.status == 200
            async with http.get(url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["m1"]
            req = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
            async with http.post(
                url + "/v1/completions", json=req, headers={"X-Request-Id": "r-1"}
            ) as r:
                await _sse(r)
            async with http.get(url + "/metrics") as r:
                samples = parse_prometheus(await r.text())
            names = {name: (labels, value) for name, labels, value in samples}
            assert names["vllm:prefix_cache_queries_total"] == ({"model_name": "m1"}, 40.0)
            assert "vllm:spec_decode_num_accepted_tokens_total" in names
            assert names["vllm:generation_tokens_total"][1] == 3.0
            async with http.get(url + "/agentab/describe") as r:
                facts = await r.json()
            assert facts["engine"] == "agentab-sim" and facts["model"] == "m1"
            async with http.get(url + "/agentab/emissions") as r:
                em = await r.json()
            assert list(em) == ["r-1"] and len(em["r-1"]) == 3

    run(body)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--profile", PROFILE, "--max-num-seqs", "0"], "--max-num-seqs: expected int >= 1, got 0"),
        (
            ["--profile", PROFILE, "--step-noise", "2"],
            "Invalid value for '--step-noise': 2.0 is not in the range 0.0<=x<=1.0.",
        ),
        (
            ["--engine", "local", "--preset", "tiny", "--tp", "0"],
            "--tp: expected int >= 1, got 0",
        ),
        (
            ["--engine", "local", "--preset", "tiny", "--device", "tpu"],
            "--device: expected str matching regex '^(cpu|cuda(:[0-9]+)?)$', got 'tpu'",
        ),
    ],
)
def test_serve_refuses_a_bad_engine_option_in_one_line(args: list[str], error: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentab", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(f"agentab: error: {error}")
    assert "Traceback" not in proc.stderr


def test_serve_cli_binds_loopback_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "serve", "--profile", PROFILE, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agentab serve: listening on http://127.0.0.1:"), line
        port = int(line.split("127.0.0.1:")[1].split()[0])

        async def probe() -> None:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/health") as r,
            ):
                assert r.status == 200

        asyncio.run(probe())
        proc.terminate()
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SPEC = {"num_draft_tokens": 3, "acceptance_probs": [0.8, 0.6, 0.4], "seed": 3}


async def _chunk_tokens(http: aiohttp.ClientSession, url: str, client_id: str | None) -> list[int]:
    """Tokens per streamed chunk of one request (PROMPT, 64 tokens out)."""
    headers = {"X-Request-Id": client_id} if client_id else {}
    req = {"prompt": PROMPT, "max_tokens": 64, "stream": True}
    async with http.post(url + "/v1/completions", json=req, headers=headers) as r:
        events = await _sse(r)
    return [len(e["choices"][0]["token_ids"]) for e in events if e != "[DONE]" and e["choices"]]


def test_acceptance_draws_follow_the_clients_request_id_not_the_arrival_order() -> None:
    """The server names a request by its arrival counter, which differs between the arms of an
    A/B and from the simulator's in-process replay; the synthetic acceptance draws are keyed on
    the client's `X-Request-Id`, so the same request accepts the same drafts in every case."""

    async def in_process() -> list[int]:
        eng = build_simulator(PROFILE, **SPEC)
        eng.start()
        tl = eng.submit(EngineRequest("r-7", np.array(PROMPT), 64))
        await tl.finished
        await eng.stop()
        return tl.chunks()[1]

    reference = run_virtual(in_process())
    assert sum(reference) == 64 and len(set(reference[1:-1])) > 1  # the draws vary by step

    async def served_after(others: int) -> list[int]:
        server = EngineServer(build_simulator(PROFILE, **SPEC))
        runner, port = await start_server(server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for i in range(others):  # other requests first: a later arrival counter
                    await _chunk_tokens(http, url, f"other-{i}")
                return await _chunk_tokens(http, url, "r-7")
        finally:
            await runner.cleanup()

    assert asyncio.run(served_after(0)) == reference
    assert asyncio.run(served_after(2)) == reference

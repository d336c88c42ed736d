"""`agentab serve` under clients that go away, stall or send too much: bounded, one line each."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import orjson
import pytest

from agentab.engine import build_simulator
from agentab.engine.server import EngineServer, start_server
from agentab.replay.metrics import parse_prometheus
from tests.serving import serve_process

from .test_server import PROFILE, run, served

LONG = {"max_tokens": 4000, "stream": True}


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return {name: v for name, _labels, v in parse_prometheus(await resp.text())}


async def drop_after_first_chunk(url: str, prompt: list[int]) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url + "/v1/completions", json={"prompt": prompt, **LONG})
        async for line in resp.content:
            if line.startswith(b"data: "):
                break
        assert resp.connection is not None
        resp.connection.transport.abort()  # type: ignore[union-attr]
        resp.release()


async def settled(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    for _ in range(200):
        m = await metrics(http, url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        await asyncio.sleep(0.05)
    raise AssertionError(f"requests still in the engine: {m}")


def test_each_dropped_stream_is_aborted_and_logged_in_one_line() -> None:
    with serve_process("--profile", PROFILE) as (url, proc):

        async def body() -> None:
            prompts = [[k + 1, *range(2, 3000)] for k in range(8)]
            await asyncio.gather(*(drop_after_first_chunk(url, p) for p in prompts))
            async with aiohttp.ClientSession() as http:
                m = await settled(http, url)
            assert m["agentab:request_abort_total"] == 8
            assert m["vllm:request_success_total"] == 0

        run(body)
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    lines = err.splitlines()
    assert "Traceback" not in err
    assert len(lines) == 8, err
    assert all(
        line.startswith("agentab serve: client 127.0.0.1 went away during cmpl-")
        and line.endswith(" of 4000 tokens; request aborted")
        for line in lines
    ), lines


def test_a_client_gone_while_queued_is_aborted_before_its_first_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One sequence slot, held by a long stream: the queued request of a client that leaves
    must leave the queue at once, not when the slot frees and its first token finds it gone."""
    caplog.set_level("INFO", logger="agentab.serve")

    async def body() -> None:
        server = EngineServer(build_simulator(PROFILE, max_num_seqs=1))
        runner, port = await start_server(server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                holder = await http.post(url + "/v1/completions", json={"prompt": [1, 2], **LONG})
                await holder.content.readline()  # streaming: it holds the only slot
                queued = asyncio.ensure_future(
                    http.post(url + "/v1/completions", json={"prompt": [7, 8, 9], **LONG})
                )
                for _ in range(100):
                    if (await metrics(http, url))["vllm:num_requests_waiting"] == 1:
                        break
                    await asyncio.sleep(0.02)
                queued.cancel()  # its connection closes with it
                for _ in range(100):
                    m = await metrics(http, url)
                    if m["vllm:num_requests_waiting"] == 0:
                        break
                    await asyncio.sleep(0.05)
                assert m["vllm:num_requests_waiting"] == 0
                assert m["vllm:num_requests_running"] == 1  # the holder still streams
                assert m["agentab:request_abort_total"] == 1
                holder.close()
                m = await settled(http, url)
                assert m["agentab:request_abort_total"] == 2
                assert server.disconnects == 2
        finally:
            await runner.cleanup()

    run(body)
    gone = [r.getMessage() for r in caplog.records if r.name == "agentab.serve"]
    assert len(gone) == 2 and " after 0 of 4000 tokens;" in gone[0]


def lifetime(port: int, first_bytes: bytes, limit_s: float = 10.0) -> float:
    """Seconds until the server closes a socket that sent `first_bytes`, then nothing."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(first_bytes)
        sock.settimeout(limit_s)
        t0 = time.monotonic()
        while sock.recv(65536):
            pass
        return time.monotonic() - t0


@pytest.mark.parametrize(
    "first_bytes",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
    ids=["nothing", "half-a-header"],
)
def test_a_connection_without_a_complete_request_is_closed(first_bytes: bytes) -> None:
    with serve_process("--profile", PROFILE, "--idle-timeout", "0.5") as (url, _proc):
        port = int(url.rsplit(":", 1)[1])
        assert lifetime(port, first_bytes) < 5.0  # closed, not held until the 10 s watch ends


def test_a_body_over_the_limit_gets_a_413_before_it_is_read() -> None:
    async def body() -> None:
        async with served(max_request_bytes=1000) as (url, _), aiohttp.ClientSession() as http:
            big = orjson.dumps({"prompt": list(range(1, 400)), "max_tokens": 4})
            assert len(big) > 1000
            for data in (big, _chunks(big)):  # with a Content-Length, and chunked
                async with http.post(url + "/v1/completions", data=data) as resp:
                    assert resp.status == 413
                    err = await resp.json()
                assert err["type"] == "RequestTooLarge" and err["code"] == 413
                assert err["message"].startswith(
                    "the request body exceeds the server's limit of 1,000 bytes "
                    "(agentab serve --max-request-bytes)"
                )
            small = {"prompt": [1, 2, 3], "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=small) as resp:
                assert resp.status == 200  # the server goes on serving

    run(body)


async def _chunks(data: bytes):  # type: ignore[no-untyped-def]
    for i in range(0, len(data), 256):
        yield data[i : i + 256]


def test_a_body_that_stalls_gets_a_408() -> None:
    async def body() -> None:
        async with served(read_timeout_s=0.3) as (url, _):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": [1'
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
            assert head.startswith(b"HTTP/1.1 408 ")
            assert b"did not arrive within 0.3 s (agentab serve --read-timeout)" in head

    run(body)


def test_a_large_body_is_parsed_off_the_loop_with_the_same_answers() -> None:
    async def body() -> None:
        async with (
            served(max_model_len=1000) as (url, _),
            aiohttp.ClientSession() as http,
        ):
            text = " ".join(["word"] * 300_000)  # 1.4 MiB: parsed in a thread
            cases = [
                (orjson.dumps({"prompt": text, "max_tokens": 2}), "maximum context length is 1000"),
                (orjson.dumps({"prompt": text})[:-2], "invalid JSON body: "),
            ]
            for data, fragment in cases:
                assert len(data) > 1024 * 1024
                headers = {"Content-Type": "application/json"}
                async with http.post(url + "/v1/completions", data=data, headers=headers) as r:
                    assert r.status == 400
                    assert fragment in (await r.json())["message"]

    run(body)

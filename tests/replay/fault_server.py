"""A small OpenAI-style streaming server on 127.0.0.1 that misbehaves on purpose.

Each request's behaviour comes from its `X-Request-Id` (the replay sends `L<lane>-P<pass>-N<node>`):
`mode_for(request_id)` picks one of MODES. The server runs in a thread with its own event loop,
so a test can drive a blocking replay (real clock) against it from the main thread. It logs, per
request id, the monotonic time at which it finished writing a successful response.

`hold_after(request_id)` > 0 makes an "ok" response stop after that many chunks, once they have
left the server's buffers, and wait until the server stops; `held` maps each such request id to
the client's port, so a test can check (with `client_drained`) that the client has read them.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from aiohttp import web

MODES = (
    "ok",
    "500",
    "reset",
    "stall",
    "malformed",
    "overflow",
    "empty",  # 200, usage with 0 tokens, [DONE]: not one content chunk
    "short",  # 200, a third of max_tokens, usage saying so, [DONE]
    "no_usage",  # 200, every token, [DONE], but no usage chunk
    "keepalive",  # 200, then only ": keep-alive" comments until the client gives up
    "keepalive_done",  # 200, a few keep-alive comments, [DONE]
    "404",  # a wrong model name, as vLLM answers it
)
HUGE_ERROR = "500_endless"  # a 500 whose body streams "boom " until the client leaves (or stall_s)
# The connection closed once the request has been read, before one response byte (FIN): what a
# client sees when the server's idle timer closes a pooled connection as a request arrives.
DROP = "drop"
# Faults a replay once recorded as success (n = max_tokens; served by mode, not in MODES' cycle).
SERVER_FAULT_MODES = (
    "usage_over_ids",  # n/2 chunks with one token id each, usage claiming n
    "over_generation",  # n + 3 chunks, usage saying so: max_tokens ignored
    "empty_text",  # n chunks, every other one (the first included) with text "", usage n
    "abort",  # n chunks, the last with finish_reason "abort", usage n, [DONE]
    "abort_early",  # as "abort" after n/2 chunks, usage n/2 (aborted, not short_output)
    "usage_over_chunks",  # n/2 chunks without token ids, usage claiming n
)
HUGE = "huge"  # one chunk, then one data line of `huge_bytes` (n - 1 more and usage if read)
# n chunks with token ids, each event's JSON split over data lines (CRLF line ends, an `id:`
# field and a comment inside the event), usage n, [DONE]: what the SSE spec lets a server send
MULTILINE = "multiline"
# n chunks, usage n, and `data: [DONE]` with no line end at all before the server closes
UNTERMINATED = "unterminated"
_NODE = re.compile(r"N(\d+)$")


def node_of(request_id: str) -> int:
    m = _NODE.search(request_id)
    return int(m.group(1)) if m else 0


def chunk(
    i: int, text: str = " tok", *, token_ids: list[int] | None = None, finish: str | None = None
) -> bytes:
    choice: dict[str, object] = {"index": 0, "text": text, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": "cmpl-x", "object": "text_completion", "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def split_chunk(i: int) -> bytes:
    """`chunk(i)` with token ids as one SSE event of three data lines, CRLF line ends."""
    body = chunk(i, token_ids=[100 + i])[len(b"data: ") : -2]
    head, rest = body.split(b",", 1)
    middle, tail = rest.split(b'"choices"', 1)
    return (
        b"data: " + head + b",\r\nid: " + str(i).encode() + b"\r\n: inside the event\r\n"
        b"data:" + middle + b"\r\ndata: " + b'"choices"' + tail + b"\r\n\r\n"
    )


def huge_line(size: int) -> bytes:
    """One `data:` line of `size` bytes (newline included) holding a valid text chunk, and the
    blank line that ends its event."""
    head = b'data: {"id":"cmpl-x","choices":[{"index":0,"text":"'
    tail = b'"}]}\n'
    return head + b"x" * (size - len(head) - len(tail)) + tail + b"\n"


def usage_chunk(prompt: int, completion: int, cached: int | None) -> bytes:
    usage: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return b"data: " + orjson.dumps({"id": "cmpl-x", "choices": [], "usage": usage}) + b"\n\n"


class FaultServer:
    """`with FaultServer(mode_for) as srv:` serves on `srv.url` until the block ends."""

    def __init__(
        self,
        mode_for: Callable[[str], str] = lambda rid: "ok",
        *,
        token_interval_s: float = 0.002,
        stall_s: float = 30.0,
        hold_after: Callable[[str], int] = lambda rid: 0,
        huge_bytes: int = 0,
        keepalive_s: float = 75.0,
    ) -> None:
        self.mode_for = mode_for
        self.keepalive_s = keepalive_s  # how long an idle connection stays open
        self.token_interval_s = token_interval_s
        self.stall_s = stall_s
        self.finished: dict[str, float] = {}  # request id -> monotonic end of a full response
        self.seen: list[str] = []
        self.client_ports: dict[str, int] = {}  # request id -> the client's port that sent it
        self.hold_after = hold_after
        self.huge_bytes = huge_bytes
        self.held: dict[str, int] = {}  # request id -> client port, for held responses
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultServer:
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        assert self._thread is not None
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, shutdown_timeout=0.1, keepalive_timeout=self.keepalive_s)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = sock.getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fault-model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        body = orjson.loads(await request.read())
        self.seen.append(rid)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer:
            self.client_ports[rid] = int(peer[1])
        mode = self.mode_for(rid)
        n = int(body.get("max_tokens", 1))
        prompt = len(body.get("prompt", []))
        if mode == DROP:
            assert request.transport is not None
            request.transport.close()
            raise web.HTTPInternalServerError  # never written: the transport is closed
        if mode == "500":
            return web.Response(status=500, text="internal boom")
        if mode == HUGE_ERROR:
            endless = web.StreamResponse(status=500)
            await endless.prepare(request)
            until = time.monotonic() + self.stall_s
            try:
                while time.monotonic() < until:
                    await endless.write(b"boom " * 13_000)
                    await asyncio.sleep(0.001)
            except ConnectionError:  # the client took its excerpt and left, as it should
                pass
            return endless
        if mode == "404":
            msg = f"The model `{body.get('model')}` does not exist."
            return web.json_response(
                {"object": "error", "message": msg, "type": "NotFoundError", "code": 404},
                status=404,
            )
        if mode == "overflow":
            msg = (
                "This model's maximum context length is 1024 tokens. However, you requested "
                f"{prompt + n} tokens. Please reduce the length of the messages or completion."
            )
            return web.json_response(
                {"object": "error", "message": msg, "type": "BadRequestError", "code": 400},
                status=400,
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "malformed":
            await resp.write(chunk(0))
            await resp.write(b"data: {not json at all\n\n")
            await resp.write_eof()
            return resp
        if mode in ("empty", "keepalive_done", "keepalive"):
            beats = 3 if mode != "keepalive" else int(self.stall_s / 0.05)
            try:
                for _ in range(beats if mode != "empty" else 0):
                    await resp.write(b": keep-alive\n\n")
                    await asyncio.sleep(0.05)
            except ConnectionResetError:  # the client gave up, as it should
                return resp
            if mode == "keepalive":
                return resp
            await resp.write(usage_chunk(prompt, 0, None))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if mode in ("short", "no_usage"):
            sent = n // 3 if mode == "short" else n
            for i in range(sent):
                await resp.write(chunk(i))
            if mode == "short":
                await resp.write(usage_chunk(prompt, sent, None))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if mode in ("reset", "stall"):
            await resp.write(chunk(0))
            await resp.write(chunk(1))
            if mode == "stall":
                await asyncio.sleep(self.stall_s)
                return resp
            transport = request.transport
            assert transport is not None
            sock = transport.get_extra_info("socket")
            if sock is not None:  # RST instead of FIN
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            transport.abort()
            return resp
        if mode in SERVER_FAULT_MODES:
            await self._server_fault(resp, mode, n, prompt)
            return resp
        if mode in (MULTILINE, UNTERMINATED):
            for i in range(n):
                await resp.write(split_chunk(i) if mode == MULTILINE else chunk(i))
            await resp.write(usage_chunk(prompt, n, None))
            await resp.write(b"data: [DONE]\r\n\r\n" if mode == MULTILINE else b"data: [DONE]")
            await resp.write_eof()
            return resp
        if mode == HUGE:
            try:
                await resp.write(chunk(0))
                await resp.write(huge_line(self.huge_bytes))
                for i in range(1, n):
                    await resp.write(chunk(i))
                await resp.write(usage_chunk(prompt, n, None))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionError:  # the client refused the line and closed, as it should
                pass
            return resp
        hold = self.hold_after(rid)
        for i in range(n):
            await resp.write(chunk(i))
            if i + 1 == hold:
                await self._hold(request, rid)
                return resp
            if self.token_interval_s:
                await asyncio.sleep(self.token_interval_s)
        await resp.write(usage_chunk(prompt, n, None))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.finished[rid] = time.monotonic()
        return resp

    async def _server_fault(self, resp: web.StreamResponse, mode: str, n: int, prompt: int) -> None:
        """A 200 stream that ends properly but misreports or misdelivers its tokens."""
        half = n // 2
        if mode == "usage_over_ids":
            body = [chunk(i, token_ids=[7]) for i in range(half)] + [usage_chunk(prompt, n, None)]
        elif mode == "over_generation":
            body = [chunk(i) for i in range(n + 3)] + [usage_chunk(prompt, n + 3, None)]
        elif mode == "empty_text":
            texts = ["" if i % 2 == 0 else " tok" for i in range(n)]
            body = [chunk(i, t) for i, t in enumerate(texts)] + [usage_chunk(prompt, n, None)]
        elif mode in ("abort", "abort_early"):
            sent = n if mode == "abort" else half
            body = [chunk(i, finish="abort" if i == sent - 1 else None) for i in range(sent)]
            body.append(usage_chunk(prompt, sent, None))
        else:  # usage_over_chunks
            body = [chunk(i) for i in range(half)] + [usage_chunk(prompt, n, None)]
        for part in body:
            await resp.write(part)
            await asyncio.sleep(self.token_interval_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async def _hold(self, request: web.Request, rid: str) -> None:
        transport = request.transport
        assert transport is not None and self._stop is not None
        while transport.get_write_buffer_size():  # every byte handed to the kernel
            await asyncio.sleep(0.001)
        self.held[rid] = transport.get_extra_info("peername")[1]
        await self._stop.wait()

    def client_drained(self, client_port: int) -> bool:
        """True once every byte this server sent on the connection from `client_port` has
        reached the client's socket (acknowledged) and the client process has read it."""
        ours = theirs = None
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            if local.endswith(f":{self.port:04X}") and remote.endswith(f":{client_port:04X}"):
                ours = tx  # bytes sent and not yet acknowledged
            elif local.endswith(f":{client_port:04X}") and remote.endswith(f":{self.port:04X}"):
                theirs = rx  # bytes received and not yet read by the client
        return ours == 0 and theirs == 0

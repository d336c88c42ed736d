"""An OpenAI-compatible HTTP server over any Engine (`agentab serve`).

Why: the same replay client that measures vLLM must be able to measure agentab's own engines
(the simulator on the real clock now, the local torch engine later), so results are comparable
end to end, HTTP included. The server speaks the subset of vLLM's API that replay and common
benchmark clients use:
- `POST /v1/completions` (prompt as token ids or text) and `POST /v1/chat/completions`,
  streaming (SSE, `stream_options.include_usage`) or not; usage carries
  `prompt_tokens_details.cached_tokens` (the prefix-cache hit, as vLLM reports it);
- `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text with vLLM's metric names:
  the engine's counters and gauges, and the server's per-request latency histograms, which
  split a request's time to first token into intake, queue, prefill and output; see
  agentab.engine.request_metrics);
- `GET /agentab/describe` (the engine facts replay copies into its run manifest);
- with `record_emissions`, `GET /agentab/emissions`: per `X-Request-Id`, the loop times at which
  each content chunk was written (tests compare them with what the client measured), and
  `GET /agentab/timings`: per `X-Request-Id`, the stamps the latency histograms are made of.
Bad requests get vLLM-shaped errors: `{"object": "error", "message", "type", "param", "code"}`.

What one client may cost is bounded: a request body over `max_request_bytes` is refused (413)
before it is read, a body that does not arrive within `read_timeout_s` gets a 408, and a
connection that sends no complete request for `idle_timeout_s` (nothing at all, half a header,
or an idle keep-alive) is closed. A client that goes away ends its request in the engine at
once, queued or streaming (aiohttp cancels the handler), and costs one log line (the
`agentab.serve` logger, INFO), not a traceback.

Text prompts are tokenized one token per whitespace-separated word (a stable hash of the word),
so identical text prefixes are identical token prefixes and hit the prefix cache; generated
tokens are the ids the engine produced (a real model's samples, or the simulator's synthetic
ids), streamed as `token_ids` and rendered as short words.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import zlib
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from agentab.engine.metric_keys import split_series
from agentab.engine.request_metrics import RequestMetrics, RequestTimes
from agentab.engine.types import EngineRequest, FinalUsage, TokenEvent
from agentab.errors import AgentabError

VOCAB_SIZE = 32000
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
_CONTEXT_HINTS = ("kv blocks", "context", "too long")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""32 MiB: a 1M-token prompt as JSON ids is about 7 MiB, as chat text about 6 MiB."""
PARSE_IN_THREAD_BYTES = 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
log = logging.getLogger("agentab.serve")
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
}


class BadRequest(Exception):
    """A client error: becomes a vLLM-shaped JSON error response."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.err_type = err_type


def error_response(
    message: str, status: int = 400, err_type: str = "BadRequestError"
) -> web.Response:
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def tokenize_text(text: str, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """One id per whitespace-separated word: crc32(word) mapped into [1, vocab_size)."""
    words = text.split()
    return np.fromiter(
        (zlib.crc32(w.encode()) % (vocab_size - 1) + 1 for w in words),
        dtype=np.int64,
        count=len(words),
    )


def detokenize(ids: np.ndarray) -> str:
    """Render generated ids as short words (one leading space each)."""
    return "".join(" " + _SYLLABLES[int(i) % len(_SYLLABLES)] for i in ids)


class EngineServer:
    """Holds the engine and the request state; `app` is the aiohttp application."""

    def __init__(
        self,
        engine: Any,
        *,
        model: str = "agentab-sim",
        max_model_len: int | None = None,
        record_emissions: bool = False,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        for name, value in (
            ("max_request_bytes", max_request_bytes),
            ("read_timeout_s", read_timeout_s),
            ("idle_timeout_s", idle_timeout_s),
        ):
            if not value > 0:
                raise AgentabError(f"serve: {name} must be > 0, got {value!r}")
        self.engine = engine
        self.model = model
        self.max_model_len = max_model_len
        self.record_emissions = record_emissions
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.emissions: dict[str, list[float]] = {}
        self.requests = RequestMetrics(record=record_emissions)
        self._observe_steps(engine)
        self.disconnects = 0
        self._ids = itertools.count()
        self.app = web.Application(client_max_size=max_request_bytes)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/agentab/describe", self.describe)
        self.app.router.add_get("/agentab/emissions", self.get_emissions)
        self.app.router.add_get("/agentab/timings", self.get_timings)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    def _observe_steps(self, engine: Any) -> None:
        """Read the engine's step records for each request's first scheduled step (its queue
        and prefill times), alongside an observer already installed."""
        if not hasattr(engine, "step_observer"):
            return
        before = engine.step_observer
        if before is None:
            engine.step_observer = self.requests.observe_step
            return
        observe = self.requests.observe_step

        def both(record: dict[str, Any]) -> None:
            observe(record)
            before(record)

        engine.step_observer = both

    async def _on_startup(self, app: web.Application) -> None:
        self.engine.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.engine.stop()

    # -- simple endpoints -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        card: dict[str, Any] = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "agentab",
            "root": self.model,
        }
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def describe(self, request: web.Request) -> web.Response:
        facts = dict(self.engine.describe())
        facts["model"] = self.model
        return web.Response(body=orjson.dumps(facts, default=str), content_type="application/json")

    async def get_emissions(self, request: web.Request) -> web.Response:
        if not self.record_emissions:
            return error_response("emission recording is off (--record-emissions)", 404, "NotFound")
        return web.Response(body=orjson.dumps(self.emissions), content_type="application/json")

    async def get_timings(self, request: web.Request) -> web.Response:
        if not self.record_emissions:
            return error_response("timing recording is off (--record-emissions)", 404, "NotFound")
        return web.Response(
            body=orjson.dumps(self.requests.timings), content_type="application/json"
        )

    async def metrics(self, request: web.Request) -> web.Response:
        inside = 'model_name="' + self.model.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines = []
        typed: set[str] = set()
        for key, value in self.engine.metrics().items():
            name, labels = split_series(key)  # (a labelled series: one TYPE line per family)
            if name not in typed:
                typed.add(name)
                kind = "counter" if name.endswith("_total") else "gauge"
                lines.append(f"# TYPE {name} {kind}")
            more = "".join(f',{k}="{v}"' for k, v in labels.items())
            lines.append(f"{name}{{{inside}{more}}} {float(value)!r}")
        lines.extend(self.requests.lines(inside))
        return web.Response(
            text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8"
        )

    # -- generation -------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _load(self, raw: bytes, chat: bool) -> tuple[Any, tuple[np.ndarray, int, bool, bool]]:
        """The JSON body and what `_parse` makes of it, or BadRequest."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from None
        return body, self._parse(body, chat)

    def _parse(self, body: Any, chat: bool) -> tuple[np.ndarray, int, bool, bool]:
        """(prompt ids, max_tokens, stream, include_usage) or BadRequest."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(
                f"The model `{model}` does not exist.", status=404, err_type="NotFoundError"
            )
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            parts = []
            for i, m in enumerate(messages):
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # content parts: keep the text ones
                    content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                if not isinstance(content, str):
                    raise BadRequest(f"messages[{i}].content must be a string")
                parts.append(content)
            ids = tokenize_text(" ".join(parts))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = tokenize_text(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt)
            ):
                ids = np.asarray(prompt, dtype=np.int64)
                if ids.min() < 0 or ids.max() >= VOCAB_SIZE:
                    raise BadRequest(f"token ids must be in [0, {VOCAB_SIZE})")
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                raise BadRequest("batched prompts are not supported; send one prompt per request")
            else:
                raise BadRequest("'prompt' must be a string or a non-empty list of token ids")
        if len(ids) == 0:
            raise BadRequest("the prompt is empty")
        raw_max = body.get("max_completion_tokens", body.get("max_tokens", 16))
        if not isinstance(raw_max, int) or isinstance(raw_max, bool) or raw_max < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {raw_max!r}.")
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("only n=1 is supported")
        if self.max_model_len is not None and len(ids) + raw_max > self.max_model_len:
            raise BadRequest(_context_message(self.max_model_len, len(ids), raw_max))
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage", False)) if isinstance(opts, dict) else False
        return ids, raw_max, stream, include_usage

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, within the size and time bounds (BadRequest otherwise)."""
        limit = self.max_request_bytes
        too_big = (
            f"the request body exceeds the server's limit of {limit:,} bytes "
            "(agentab serve --max-request-bytes)"
        )
        length = request.content_length
        if length is not None and length > limit:
            raise BadRequest(
                f"{too_big}: Content-Length is {length:,}", status=413, err_type="RequestTooLarge"
            )
        try:
            async with asyncio.timeout(self.read_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(too_big, status=413, err_type="RequestTooLarge") from None
        except TimeoutError:
            raise BadRequest(
                f"the request body did not arrive within {self.read_timeout_s:g} s "
                "(agentab serve --read-timeout)",
                status=408,
                err_type="RequestTimeout",
            ) from None

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        times = RequestTimes(received=loop.time())
        try:
            raw = await self._read_body(request)
            if len(raw) > PARSE_IN_THREAD_BYTES:
                # Parsing and tokenizing megabytes takes a second or more: in a thread the loop
                # keeps serving the other streams meanwhile (the GIL is handed over every 5 ms).
                body, parsed = await asyncio.to_thread(self._load, raw, chat)
            else:
                body, parsed = self._load(raw, chat)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.err_type)
        ids, max_tokens, stream, include_usage = parsed
        del raw
        client_id = request.headers.get("X-Request-Id")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        engine_id = f"{rid}-{client_id}" if client_id else rid
        gen = self.engine.generate(EngineRequest(engine_id, ids, max_tokens, draw_id=client_id))
        self.requests.handed(times, engine_id, loop.time())
        try:
            try:
                first = await gen.__anext__()
            except AgentabError as exc:
                text = str(exc)
                if any(h in text.lower() for h in _CONTEXT_HINTS):
                    limit = self.max_model_len or 0
                    msg = _context_message(limit, len(ids), max_tokens) if limit else text
                    return error_response(f"{msg} ({text})" if limit else text)
                return error_response(text)
            except asyncio.CancelledError:  # the client went away while the request was queued
                self._client_gone(request, rid, 0, max_tokens)
                raise  # leaving the generator aborted the request in the engine
            self._seen(times, first, loop)
            meta = {"id": rid, "created": int(time.time()), "model": self.model}
            del body, ids  # a long prompt is not kept alive for the whole generation
            if stream:
                return await self._stream(
                    request, gen, first, max_tokens, meta, chat, include_usage, client_id, times
                )
            return await self._whole(request, gen, first, meta, chat, max_tokens, times)
        finally:
            self.requests.close(times, engine_id, client_id)

    def _seen(self, times: RequestTimes, item: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Stamp the handler's receipt of a stream item: its first token, or its end."""
        if isinstance(item, FinalUsage):
            self.requests.finished(times, loop.time())
        elif times.token is None:
            self.requests.first_token(times, item.t, loop.time())

    def _client_gone(self, request: web.Request, rid: str, sent: int, max_tokens: int) -> None:
        self.disconnects += 1
        peer = request.remote or "?"
        log.info(
            "client %s went away during %s after %d of %d tokens; request aborted",
            peer,
            rid,
            sent,
            max_tokens,
        )

    async def _whole(
        self,
        request: web.Request,
        gen: Any,
        first: Any,
        meta: dict[str, Any],
        chat: bool,
        max_tokens: int,
        times: RequestTimes,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        usage: FinalUsage | None = None
        parts: list[np.ndarray] = []
        item = first
        done = 0
        while True:
            if isinstance(item, FinalUsage):
                usage = item
                break
            parts.append(_event_ids(item))
            done += item.num_tokens
            try:
                item = await gen.__anext__()
            except asyncio.CancelledError:  # the client went away: nobody reads the answer
                await gen.aclose()
                self._client_gone(request, meta["id"], done, max_tokens)
                raise
            self._seen(times, item, loop)
        text = detokenize(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        finish = usage.finish_reason
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        body = {**meta, "object": obj, "choices": [choice], "usage": _usage(usage)}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        gen: Any,
        first: Any,
        max_tokens: int,
        meta: dict[str, Any],
        chat: bool,
        include_usage: bool,
        client_id: str | None,
        times: RequestTimes,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = orjson.dumps({**meta, "object": obj})[:-1]  # reused prefix of every chunk
        emitted: list[float] | None = None
        if self.record_emissions and client_id:
            emitted = self.emissions.setdefault(client_id, [])
        done = 0
        item = first
        try:
            await resp.prepare(request)
            if chat:  # vLLM opens a chat stream with the assistant role
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await resp.write(_sse(head, [role]))
            while True:
                if isinstance(item, TokenEvent):
                    ids = _event_ids(item)
                    done += item.num_tokens
                    finish = "length" if done >= max_tokens else None
                    text = detokenize(ids)
                    if chat:
                        choice: dict[str, Any] = {
                            "index": 0,
                            "delta": {"content": text},
                            "logprobs": None,
                            "finish_reason": finish,
                            "token_ids": ids.tolist(),
                        }
                    else:
                        choice = {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": finish,
                            "token_ids": ids.tolist(),
                        }
                    if emitted is not None:
                        emitted.append(loop.time())
                    await resp.write(_sse(head, [choice]))
                    if times.written is None:
                        self.requests.first_written(times, loop.time())
                elif isinstance(item, FinalUsage):
                    if include_usage:
                        await resp.write(_sse(head, [], _usage(item)))
                    await resp.write(b"data: [DONE]\n\n")
                    break
                item = await gen.__anext__()
                self._seen(times, item, loop)
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away (aiohttp's ClientConnectionResetError is one): end the
            # request in the engine and say so in one line; the response is over.
            await gen.aclose()
            self._client_gone(request, meta["id"], done, max_tokens)
        except asyncio.CancelledError:  # the client went away between two writes
            await gen.aclose()  # aborts the request in the engine
            self._client_gone(request, meta["id"], done, max_tokens)
            raise
        return resp


def _event_ids(event: TokenEvent) -> np.ndarray:
    """The ids an event carries (every agentab engine sets them; a bare count is a bug)."""
    if event.token_ids is None or len(event.token_ids) != event.num_tokens:
        raise RuntimeError("the engine emitted a token event without its token ids")
    return event.token_ids


def _sse(head: bytes, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
    tail = b',"choices":' + orjson.dumps(choices)
    if usage is not None:
        tail += b',"usage":' + orjson.dumps(usage)
    return b"data: " + head + tail + b"}\n\n"


def _usage(u: FinalUsage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _context_message(limit: int, prompt: int, max_tokens: int) -> str:
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


async def start_server(server: EngineServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start `server` on host:port (0 picks a free port): (runner to cleanup(), bound port)."""
    runner = web.AppRunner(
        server.app,
        access_log=None,
        shutdown_timeout=1.0,
        # aiohttp arms this when a connection opens and again after each response; it closes a
        # connection still waiting for a complete request then: one that sent nothing, half a
        # header, or an idle keep-alive.
        keepalive_timeout=server.idle_timeout_s,
        # A client that disconnects cancels its handler, so a request still queued or in
        # prefill is aborted at once instead of at its first write.
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server_obj = site._server
    assert isinstance(server_obj, asyncio.Server)  # what a TCPSite starts (loop.create_server)
    bound = int(server_obj.sockets[0].getsockname()[1])
    return runner, bound

"""HttpTarget: OpenAI-compatible servers (vLLM, `agentab serve`) over aiohttp, streaming.

Why the details matter: the analysis derives TTFT, ITL and interactivity from the arrival time
of every chunk, so the client must (1) never queue requests behind a connection limit (the pool
is unbounded; idle connections are kept alive and reused, so it settles at the peak number of
concurrent streams, but never past `CLIENT_KEEPALIVE_S`, below the servers' own idle limit),
(2) timestamp each read from the monotonic loop clock as soon as bytes arrive, and (3) classify
failures precisely instead of dropping them.

Prompts: `/v1/completions` gets the exact token ids (default; prefix-cache hits are then exact);
`/v1/chat/completions` gets the same content rendered as words. Both ask for `max_tokens` = the
recorded output length with `ignore_eos`, streaming with usage in the last chunk.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from agentab.errors import AgentabError
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.replay.targets.sse import (
    MAX_LINE_ENV,
    EventAssembler,
    LineSplitter,
    LineTooLong,
    max_line_bytes_from_env,
)
from agentab.workloads.tokens import prompt_text, prompt_token_ids

_CONTEXT_MARKERS = (
    "maximum context length",
    "maximum model length",
    "context length",
    "longer than the maximum",
    "too long",
)
_REASONING_KEYS = ("reasoning_content", "reasoning")
# How long an idle connection is kept for reuse. It must stay below the server's own idle limit:
# uvicorn (vLLM, SGLang) closes an idle connection after 5 s, and a client that reuses one just
# as the server closes it (a GC pause or a busy core is enough) writes its request into a closed
# socket and records a broken stream the server never saw. httpx, the OpenAI SDK's client, keeps
# idle connections 5 s; a second below that leaves room for the time between taking a
# connection from the pool and the server reading the request.
CLIENT_KEEPALIVE_S = 4.0
# aiohttp >= 3.10 tells a connect timeout apart from a read timeout.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,) + (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)


def redact_url(url: str) -> str:
    """`url` with any user name and password replaced: a URL is written into manifests,
    reports and error messages, and `http://user:key@host` would carry the key along."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"<redacted>@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def api_key_from_env(name: str | None) -> str | None:
    """The API key held in environment variable `name` (never stored anywhere else)."""
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise AgentabError(f"--api-key-env {name}: environment variable {name} is not set")
    return value


class HttpTarget:
    """Streams requests to an OpenAI-compatible server at `url` (scheme://host:port)."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        endpoint: str = "completions",
        api_key: str | None = None,
        timeout_s: float = 600.0,
        vocab_size: int = 32000,
        max_line_bytes: int | None = None,
        keepalive_s: float = CLIENT_KEEPALIVE_S,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise AgentabError(f"--url {url}: expected http://HOST:PORT or https://HOST:PORT")
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.model = model
        self.endpoint = endpoint
        self.path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        self._api_key = api_key
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        # the longest SSE line taken (agentab.replay.targets.sse): default, or the environment's
        self.max_line_bytes = max_line_bytes or max_line_bytes_from_env()
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._resend_session: aiohttp.ClientSession | None = None
        self._server_facts: dict[str, Any] = {}

    async def start(self) -> None:
        self._session = self._new_session(reuse=True)
        self._resend_session = self._new_session(reuse=False)
        if self.model is None:
            self.model = await self._discover_model()
        self._server_facts = await self._describe_server()

    def _new_session(self, *, reuse: bool) -> aiohttp.ClientSession:
        """The pooled session every request takes, or (`reuse=False`) the one a resend takes: it
        opens a new connection each time, since the pool may hold more connections the server
        has closed meanwhile."""
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        trace = None
        if reuse:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=self.keepalive_s
            )
            trace = aiohttp.TraceConfig()  # tells `_post` whether a connection was pooled
            trace.on_connection_reuseconn.append(_note_reuse)
        else:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s
        )
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            headers=headers,
            auto_decompress=False,
            trace_configs=[trace] if trace is not None else None,
        )

    async def close(self) -> None:
        for session in (self._session, self._resend_session):
            if session is not None:
                await session.close()
        self._session = self._resend_session = None

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "target": "http",
            "url": redact_url(self.url),
            "endpoint": self.endpoint,
            "model": self.model,
        }
        if self._server_facts:
            facts["server"] = self._server_facts
        return facts

    async def _get_json(self, path: str) -> Any:
        assert self._session is not None
        try:
            async with self._session.get(
                self.url + path, timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                if resp.status != 200:
                    return None
                return orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None

    async def _discover_model(self) -> str:
        assert self._session is not None
        try:
            async with self._session.get(
                self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise AgentabError(
                        f"{redact_url(self.url)}/v1/models: HTTP {resp.status}: {body[:200]!r} "
                        "(pass --model to skip discovery)"
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AgentabError(f"{redact_url(self.url)}: cannot reach the server: {exc}") from None
        try:
            return str(orjson.loads(body)["data"][0]["id"])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise AgentabError(
                f"{redact_url(self.url)}/v1/models: no model listed (pass --model NAME)"
            ) from None

    async def probe(self) -> None:
        """Refuse, in one line naming the URL, a server that accepts no connection (any HTTP
        answer to GET /v1/models will do)."""
        assert self._session is not None
        try:
            async with self._session.get(
                self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AgentabError(
                f"--url {redact_url(self.url)}: cannot reach the server: {exc}"
            ) from None

    async def _describe_server(self) -> dict[str, Any]:
        """Engine facts from `agentab serve` (GET /agentab/describe); {} for other servers."""
        data = await self._get_json("/agentab/describe")
        return data if isinstance(data, dict) else {}

    def warm(self, spec: RequestSpec) -> None:
        """Build one request's body and drop it: the prompt builder compiles on first use (about
        0.2-1 s), which would otherwise hold up the run's first dispatches."""
        self._body(spec)

    def _body(self, spec: RequestSpec) -> bytes:
        req: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if self.endpoint == "completions":
            req["prompt"] = prompt_token_ids(
                spec.session, spec.request, salt=spec.salt, vocab_size=self.vocab_size
            )
        else:
            text = prompt_text(
                spec.session, spec.request, salt=spec.salt, vocab_size=self.vocab_size
            )
            req["messages"] = [{"role": "user", "content": text}]
        return orjson.dumps(req, option=orjson.OPT_SERIALIZE_NUMPY)

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        assert self._session is not None, "start() first"
        loop = asyncio.get_running_loop()
        body = self._body(spec)
        headers = {"X-Request-Id": spec.request_id}
        out.sent = loop.time()
        try:
            async with await self._post(body, headers, out, loop) as resp:
                if resp.status != 200:
                    text = (await _read_head(resp, 2000)).decode("utf-8", "replace")
                    out.end = loop.time()
                    _classify_status(out, resp.status, text)
                    return
                deadline = None
                protocol = resp.connection.protocol if resp.connection is not None else None
                if self.timeout_s and protocol is not None:
                    # From here on the silence limit is a lazy deadline (_ReadDeadline): aiohttp's
                    # sock_read would cancel and re-create a loop timer on every chunk.
                    protocol.read_timeout = None
                    deadline = _ReadDeadline(loop, resp.content, self.timeout_s)
                try:
                    await self._read_stream(resp, out, loop, deadline)
                    if out.error_class is None:
                        _check_complete(out, spec.max_tokens)
                finally:
                    if deadline is not None:
                        deadline.cancel()
        except _CONNECT_ERRORS as exc:
            out.fail("connect", f"{type(exc).__name__}: {exc}")
        except (TimeoutError, aiohttp.ServerTimeoutError):
            out.fail("timeout", f"no bytes for {self.timeout_s:g} s")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            out.fail("broken_stream", f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientError as exc:
            out.fail("broken_stream", f"{type(exc).__name__}: {exc}")
        except OSError as exc:  # a reset surfacing below aiohttp
            out.fail("broken_stream", f"{type(exc).__name__}: {exc}")
        if out.end is None:
            out.end = loop.time()

    async def _post(
        self, body: bytes, headers: dict[str, str], out: Outcome, loop: asyncio.AbstractEventLoop
    ) -> aiohttp.ClientResponse:
        """POST and return the response once its head has arrived.

        A pooled connection the server closes before answering (zero response bytes) is the
        race `CLIENT_KEEPALIVE_S` narrows but cannot remove: the server's idle timer fired as the
        request was written into it (the client's loop or the server's late by a second or more
        under load). The server never read that request, so it is sent once more, on a new
        connection (RFC 9112 9.3.1 allows a retry where the request is known not to have been
        processed); `sent` becomes the resend's time and the record is flagged `resent`. A
        failure on a new connection, or after the head, is recorded as it is."""
        assert self._session is not None and self._resend_session is not None
        pooled = _PoolUse()
        try:
            return await self._session.post(
                self.url + self.path, data=body, headers=headers, trace_request_ctx=pooled
            )
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not pooled.reused:
                raise
            first = out.sent
            assert first is not None
            out.sent = loop.time()
            out.warn(
                "resent",
                f"the server closed the pooled connection before answering ({type(exc).__name__}:"
                f" {exc}, {out.sent - first:.2f} s after the first send); sent again on a new one",
            )
        return await self._resend_session.post(self.url + self.path, data=body, headers=headers)

    async def _read_stream(
        self,
        resp: aiohttp.ClientResponse,
        out: Outcome,
        loop: asyncio.AbstractEventLoop,
        deadline: _ReadDeadline | None,
    ) -> None:
        """Parse SSE events (`EventAssembler`: data lines joined, dispatched at the blank line
        that ends the event); time every content chunk at the read that completed its event.

        A content chunk carries output: text, token ids, reasoning or a tool call. A chunk with
        none of them (chat's role-only opening chunk, a closing chunk that only has the finish
        reason, or an empty one) is not timed: it shows the user nothing, and timing it would
        let an empty first chunk stand in for the first token.
        """
        chat = self.endpoint == "chat"
        sent = out.sent
        assert sent is not None
        times = out.chunk_times
        assert isinstance(times, list)  # a fresh outcome's; arrays come from in-process engines
        tokens: list[int] | None = []
        reasoning = 0
        empty = 0
        blank: list[float] = []  # when the text-less chunks came (completions)
        finish: object = None
        splitter = LineSplitter(self.max_line_bytes)
        assembler = EventAssembler(self.max_line_bytes)
        done = False
        ended = False
        content = resp.content
        while not done and not ended:
            try:
                data = await content.readany()
            except aiohttp.ServerTimeoutError:
                if assembler.comments and not times:
                    out.fail(
                        "keepalive_timeout",
                        f"only {assembler.comments} keep-alive line(s), no data, for "
                        f"{self.timeout_s:g} s",
                    )
                    out.end = loop.time()
                    return
                raise
            now = loop.time()
            stamp = now
            now -= sent
            try:
                if data:
                    events, saw_data = assembler.feed(splitter.feed(data))
                else:
                    ended = True
                    events, saw_data = assembler.feed(splitter.end())
                    events += assembler.end()
            except LineTooLong as exc:
                out.fail("line_too_long", f"{exc} (limit: {MAX_LINE_ENV})")
                out.end = loop.time()
                resp.close()  # the rest of the line is not read
                return
            if saw_data and deadline is not None:
                # a data line is progress against the silence limit; a keep-alive comment is not
                deadline.last = stamp
            for payload in events:
                if payload.strip() == b"[DONE]":
                    done = True
                    break
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    out.fail("malformed_stream", f"undecodable SSE data: {payload[:120]!r}")
                    out.end = loop.time()
                    return
                if type(obj) is not dict:
                    out.fail("malformed_stream", f"SSE data is not an object: {payload[:120]!r}")
                    out.end = loop.time()
                    return
                choices = obj.get("choices")
                if not choices:
                    if "error" in obj:
                        err = obj["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        out.fail("stream_error", str(msg))
                        out.end = loop.time()
                        return
                    usage = obj.get("usage")
                    if usage:
                        _take_usage(out, usage)
                    continue
                usage = obj.get("usage")
                if usage:
                    _take_usage(out, usage)
                choice = choices[0]
                reason = choice.get("finish_reason")
                if reason is not None:
                    finish = reason
                ids = choice.get("token_ids")
                if chat:
                    delta = choice.get("delta") or {}
                    is_reasoning = any(delta.get(k) for k in _REASONING_KEYS)
                    if not (is_reasoning or delta.get("content") or delta.get("tool_calls") or ids):
                        # the role-only opening chunk and a closing chunk are expected
                        empty += reason is None and "role" not in delta
                        continue
                    reasoning += is_reasoning
                elif not (choice.get("text") or ids):
                    empty += reason is None
                    blank.append(now)  # a tokenizer-less server's last token carries the reason
                    continue
                if tokens is not None:
                    if ids is None:
                        tokens = None
                    else:
                        tokens.append(len(ids))
                times.append(now)
        out.end = loop.time()
        if blank and not times:
            # Not one chunk with text: a server that streams tokens without detokenizing them
            # (vLLM with --skip-tokenizer-init and no return_token_ids). Its chunks are the
            # tokens, as they arrived; nothing to warn about.
            times.extend(blank)
            tokens, empty = None, 0
        out.chunk_tokens = tokens if tokens else None
        if chat:
            out.reasoning_chunks = reasoning
        if empty:
            out.warn(
                "empty_chunks",
                f"{empty} chunk(s) without text or token ids, not timed as tokens",
            )
        if finish == "abort":
            out.fail(
                "aborted",
                f'finish_reason "abort" after {len(times)} content chunk(s)',
            )
        if not done:
            out.fail("broken_stream", "the stream ended without data: [DONE]")

    async def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        assert self._session is not None
        try:
            async with self._session.get(
                self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    return []
                text = (await resp.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError):
            return []
        from agentab.replay.metrics import parse_prometheus, scrape_worker

        # Off the loop: pure-Python parsing of a large exposition would hold up every dispatch
        # and chunk read due meanwhile (agentab.replay.metrics says by how much).
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(scrape_worker(), parse_prometheus, text)


class _ReadDeadline:
    """The stream body's silence limit (`timeout_s` without bytes), checked lazily.

    The reader only stores the time of each read in `last`; one loop timer per stream fires at
    `last + timeout_s` and re-arms itself at the new `last + timeout_s` while bytes keep coming,
    so a healthy stream costs one timer per `timeout_s` instead of one per chunk (aiohttp's
    sock_read cancels and re-creates a timer on every read; at 20k chunks/s those handles were
    most of the cyclic GC's work). On silence the reader's next `readany` raises the same
    ServerTimeoutError that sock_read raises, so the error class stays `timeout`.
    """

    __slots__ = ("_content", "_handle", "_loop", "_timeout", "last")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, content: aiohttp.StreamReader, timeout_s: float
    ) -> None:
        self._loop = loop
        self._content = content
        self._timeout = timeout_s
        self.last = loop.time()
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.last + timeout_s, self._check)

    def _check(self) -> None:
        due = self.last + self._timeout
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        self._content.set_exception(
            aiohttp.ServerTimeoutError("Timeout on reading data from socket")
        )

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _check_complete(out: Outcome, max_tokens: int) -> None:
    """A 200 stream that ended properly but did not deliver what was asked is a failure.

    Every request asks for `max_tokens` with `ignore_eos` and usage in the last chunk, so an
    honest server delivers exactly `max_tokens` tokens and says so. A stream with no content,
    without usage, with fewer or more tokens than asked, or whose usage counts tokens its
    chunks' token ids do not hold, did not measure the request that was planned: its TTFT, ITL
    and OSL would enter the metrics as if it had (docs/replay.md, "Error classes"). Where the
    chunks do not say how many tokens each carried, usage above the chunk count is only a
    warning: servers stream several tokens per chunk (speculative decoding, merged outputs).
    """
    chunks = len(out.chunk_times)
    if not chunks:
        out.fail("empty_response", "HTTP 200 and [DONE] without a content chunk")
        return
    usage = out.completion_tokens
    if usage is None:
        out.fail("no_usage", "the stream ended without the usage chunk include_usage asks for")
        return
    if usage < max_tokens:
        out.fail("short_output", f"{usage} of {max_tokens} tokens with ignore_eos")
        return
    ids = out.chunk_tokens
    delivered = None if ids is None else int(sum(ids))
    if usage > max_tokens or chunks > max_tokens or (delivered or 0) > max_tokens:
        held = "" if delivered is None else f", {delivered} token ids"
        out.fail(
            "over_generation",
            f"usage {usage} tokens, {chunks} content chunks{held}, for max_tokens {max_tokens}",
        )
        return
    if delivered is not None and delivered < usage:
        out.fail(
            "usage_above_delivered",
            f"usage claims {usage} tokens, the chunks' token ids hold {delivered}",
        )
        return
    if delivered is None and chunks < usage:
        out.warn(
            "usage_above_chunks",
            f"usage claims {usage} tokens over {chunks} content chunks without token ids",
        )


async def _read_head(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most `limit` bytes of the body: an error's excerpt needs no more, and reading a
    server's whole error body would let it make the client hold any amount (the connection,
    left with unread bytes, is closed instead of reused)."""
    head = b""
    while len(head) < limit:
        part = await resp.content.read(limit - len(head))
        if not part:
            break
        head += part
    return head


def _take_usage(out: Outcome, usage: dict[str, Any]) -> None:
    out.prompt_tokens = usage.get("prompt_tokens")
    out.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        out.cached_tokens = details["cached_tokens"]


def _classify_status(out: Outcome, status: int, text: str) -> None:
    excerpt = " ".join(text.split())[:300]
    lowered = text.lower()
    if status == 400 and any(m in lowered for m in _CONTEXT_MARKERS):
        out.fail("context_overflow", f"HTTP 400: {excerpt}")
    else:
        out.fail("http", f"HTTP {status}: {excerpt}")


class _PoolUse:
    """A request's trace context: whether its connection came from the pool."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _note_reuse(
    session: aiohttp.ClientSession, context: Any, params: aiohttp.TraceConnectionReuseconnParams
) -> None:
    if isinstance(context.trace_request_ctx, _PoolUse):
        context.trace_request_ctx.reused = True

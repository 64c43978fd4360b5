"""Any OpenAI-compatible server as a :class:`~backends.base.Backend`.

vLLM, SGLang, llama.cpp, TGI, the built-in engine's server and ``headrace
mock`` all speak ``POST /v1/completions`` and ``/v1/chat/completions`` with
SSE streaming. This adapter drives one of them over HTTP/2 (prior knowledge
on ``http://``, ALPN on ``https://``; :mod:`backends.h2client`) or HTTP/1.1
(httpx), chosen per backend or found out once (``http = "auto"``). It asks
for token ids (``return_token_ids``, vLLM's extension, honoured by the engine
and the mock) and reads ``token_ids`` / ``prompt_token_ids`` / ``seed`` when
offered, and works on text alone when not.

What ``/v1/models`` says beyond names is kept in :meth:`~OpenAIHTTPBackend.info`:
``max_model_len`` (vLLM), and the engine's ``block_size``, ``kv_events`` and
``tokenizer`` (the path of its model file, or "bytes" for the mock), which
the router's cache-aware routing reads, and ``token_ids`` / ``exact_resume``,
which stream migration reads (a resumed request, ``resumed_tokens`` next to a
token-id prompt, continues exactly). :meth:`~OpenAIHTTPBackend.kv_events`
streams ``GET /v1/kv_events?since=SEQ`` (SSE: ``id: SEQ`` + ``data: <KVEvent>``)
over a connection of its own, since it stays open for as long as the router runs.

Every transport, TLS and JSON failure is translated once (the mapping and the
chunk parser are sans-I/O, in :mod:`backends.openai_wire`)::

    connect refused, DNS, reset before the response   BackendUnavailable
    HTTP 429 (+ Retry-After)                           UpstreamRateLimited(retry_after)
    HTTP 503 (+ Retry-After)                           BackendUnavailable(retry_after)
    HTTP 400 context length / 404 / other 4xx          ContextLengthExceeded / ModelNotFound / ClientError
    HTTP 5xx                                           UpstreamError
    no bytes for ``stall_timeout`` (or headers late)   BackendTimeout
    reset or EOF before the final event                StreamBroken (migratable)
    an in-band ``{"error": ...}`` after the first event StreamBroken (migratable)
    a chunk that is not the OpenAI shape               BackendProtocolError
    anything else (a bug)                              StreamBroken / BackendUnavailable

The final event is complete once its finish reason and the usage chunk have
both come: a stream that then ends (EOF, a reset, or no ``[DONE]`` within
``stall_timeout``) without ``data: [DONE]`` is a complete answer and ends
normally. Without the usage chunk it is StreamBroken, and its final event
(with the last tokens in it) is never delivered.

A stream refused by the server (GOAWAY raced it, REFUSED_STREAM) was not
processed and is sent again at once on a new connection. Cancelling the
consumer closes the HTTP stream at once: RST_STREAM(CANCEL) over HTTP/2, the
connection over HTTP/1.1. Health probes have an HTTP/2 connection of their
own, so they never queue behind the streams. Each request carries the
client request's id as ``x-request-id``, and the request's
``traceparent`` when it has one (the router's span for the attempt).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Annotated, Any, Literal, TypeVar, cast

import h2.exceptions
import httpx
import msgspec
import trio

from backends.base import (
    SAMPLING_FIELDS,
    BackendInfo,
    Event,
    GenerateRequest,
    Health,
    KVEvent,
)
from backends.errors import (
    BackendProtocolError,
    BackendStalled,
    BackendTimeout,
    BadRequest,
    HeadraceError,
    StreamBroken,
    drop_tracebacks,
)
from backends.h2client import H2Error, H2Pool, H2Response, H2Unsupported, RefusedStream
from backends.openai_wire import (
    ChunkParser,
    KVEventParser,
    engine_fields,
    status_error,
    transport_error,
)
from backends.tally import Outcome, StreamTally
from frontend import loop_lag
from frontend.sse import SSEParser

__all__ = ["HTTPBackendStatistics", "HTTPOptions", "OpenAIHTTPBackend", "status_error"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_ERROR_BODY = 64 * 1024
# A stall or first-token verdict waits once more for the router's own recent
# loop lag (frontend/loop_lag.py) when that lag is at least this long.
LAG_GRACE_MIN = 0.05
_TRANSPORT_ERRORS = (
    httpx.TransportError,
    h2.exceptions.H2Error,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


class HTTPBackendStatistics(msgspec.Struct, frozen=True):
    in_flight: int
    started: int
    completed: int
    failed: int
    cancelled: int


# ---------------------------------------------------------------- SSE framing


# ---------------------------------------------------------------- transports


class _Reply:
    """A response head and its body chunks, whichever transport carried it."""

    __slots__ = ("chunks", "headers", "ready", "status", "within")

    def __init__(self, status: int, headers: Any, chunks: AsyncIterator[bytes],
                 ready: Callable[[], bool] | None = None,
                 within: Callable[[float], Awaitable[bytes | None]] | None = None) -> None:
        self.status, self.headers, self.chunks = status, headers, chunks
        self.ready = ready  # True when the next chunk needs no wait (None: unknown, always time it)
        # The next chunk, or None if none by the deadline given (trio's clock),
        # timed by the transport itself (None: time it with a cancel scope)
        self.within = within


class _H2:
    """HTTP/2 through :class:`~backends.h2client.H2Pool`: requests on one
    pool, health probes and ``/v1/models`` on a pool of their own, so a
    probe never waits behind (or wedges with) the streams."""

    version = "2"

    def __init__(
        self,
        url: httpx.URL,
        headers: list[tuple[str, str]],
        *,
        tls: ssl.SSLContext | None,
        connect_timeout: float,
        max_connections: int,
    ) -> None:
        port = url.port or (443 if url.scheme == "https" else 80)
        authority = url.host if url.port is None else f"{url.host}:{url.port}"

        def pool(n: int) -> H2Pool:
            return H2Pool(
                url.host, port, ssl_context=tls, authority=authority, headers=headers,
                connect_timeout=connect_timeout, max_connections=n,
            )  # fmt: skip

        self.pool, self.probes = pool(max_connections), pool(1)

    async def get(self, path: str) -> tuple[int, bytes]:
        reply = await _resend_if_refused(lambda: self.probes.request("GET", path, limit=4 * 1024 * 1024))
        return reply.status, reply.body

    def open(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> AbstractAsyncContextManager[_Reply]:
        return _H2Opened(partial(self._start, path, body, headers))

    async def _start(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> H2Response:
        response = self.pool.stream("POST", path, headers=headers, body=body)
        return await response.__aenter__()  # a failed start closes its stream itself

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.probes.aclose()


class _H2Opened:
    """One upstream stream over HTTP/2, started (again if the server refused
    it unprocessed) on entry and closed on the way out. A class, not an
    ``@asynccontextmanager``: one async generator less a request."""

    __slots__ = ("_response", "_start")

    def __init__(self, start: Callable[[], Awaitable[H2Response]]) -> None:
        self._start = start
        self._response: H2Response | None = None

    async def __aenter__(self) -> _Reply:
        response = self._response = await _resend_if_refused(self._start)
        return _Reply(response.status, response.headers, response, response.ready, response.next_within)

    async def __aexit__(self, *exc_info: object) -> None:
        response, self._response = self._response, None
        if response is not None and not response.close_if_finished():  # a finished stream's close needs no cancel scope
            with trio.CancelScope(shield=True):
                await response.aclose()


class _H1:
    """HTTP/1.1 (cleartext or TLS) through httpx. Leaving a response early
    closes its connection, which is how HTTP/1.1 cancels. Probes and model
    lists (``get``) have their own small pool, so streams stuck on slow
    clients (every request connection busy) never make a healthy backend's
    probe time out."""

    version = "1.1"

    def __init__(
        self,
        base_url: str,
        headers: list[tuple[str, str]],
        *,
        verify: ssl.SSLContext | bool,
        connect_timeout: float,
        max_connections: int,
    ) -> None:
        def client(connections: int) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=base_url,
                http1=True,
                http2=False,
                headers=headers,
                timeout=httpx.Timeout(
                    connect=connect_timeout, read=None, write=connect_timeout, pool=connect_timeout
                ),
                limits=httpx.Limits(max_connections=connections, keepalive_expiry=30.0),
                verify=verify,
                trust_env=False,
            )

        self.client = client(max_connections)
        self.probes = client(2)

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await self.probes.get(path)
        return response.status_code, response.content

    def open(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> AbstractAsyncContextManager[_Reply]:
        return self._open(path, body, headers)

    @asynccontextmanager
    async def _open(self, path: str, body: bytes, headers: list[tuple[str, str]]) -> AsyncIterator[_Reply]:
        async with self.client.stream("POST", path, content=body, headers=headers) as response:
            chunks = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
            yield _Reply(response.status_code, response.headers, chunks)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.probes.aclose()


async def _resend_if_refused(send: Callable[[], Awaitable[T]]) -> T:
    """``send()``, and once more if the server refused it unprocessed (a
    GOAWAY raced it, or REFUSED_STREAM): the pool then uses a new connection."""
    try:
        return await send()
    except RefusedStream:
        return await send()


_Transport = _H1 | _H2
_POST_HEADERS = [("content-type", "application/json"), ("accept", "text/event-stream")]
_HEADER_SAFE = re.compile(r"[!-~]{1,128}")  # a tenant name sent as a header value: visible ASCII, bounded
_ERRORS = (*_TRANSPORT_ERRORS, H2Error)


# ---------------------------------------------------------------- the backend


def _tls_context(verify: ssl.SSLContext | str | bool) -> ssl.SSLContext | bool:
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return verify


def _ssl_context(verify: ssl.SSLContext | str | bool) -> ssl.SSLContext:
    """An SSLContext of our own for the HTTP/2 pool (it sets ALPN on it)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if verify is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


HTTPVersion = Literal["auto", "1.1", "2"]
PriorityOrder = Literal["higher_first", "lower_first", "off"]
_Seconds = Annotated[float, msgspec.Meta(gt=0)]


class HTTPOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of :class:`OpenAIHTTPBackend` a config file can give
    (``[[backends]] options = {...}``); see the class for their meaning."""

    http: HTTPVersion = "auto"
    model: str | None = None
    api_key: str | None = None
    api_key_env: str | None = None  # read the key from this environment variable
    token_ids: bool | Literal["auto"] = "auto"
    connect_timeout: _Seconds = 5.0
    stall_timeout: _Seconds = 60.0
    first_token_timeout: _Seconds | None = None
    health_timeout: _Seconds = 5.0
    verify: bool | str = True  # False, or a CA bundle path
    max_connections: Annotated[int, msgspec.Meta(gt=0)] = 100
    send_tenant: bool = False  # x-headrace-tenant on each request (on for kind = "engine": its GPU accounting)
    # the engine priority upstream: "higher_first" (headrace; the default for
    # kind = "engine"), "lower_first" (vLLM --scheduling-policy priority), "off"
    priority: PriorityOrder = "off"

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`OpenAIHTTPBackend`."""
        out = msgspec.structs.asdict(self)
        env = out.pop("api_key_env")
        if env is not None and out["api_key"] is None:
            out["api_key"] = os.environ.get(env)
            if not out["api_key"]:
                raise ValueError(f"api_key_env: environment variable {env} is not set")
        return out


class OpenAIHTTPBackend:
    """One OpenAI-compatible server.

    ``http``: "2" (prior knowledge on ``http://``, ALPN on ``https://``),
    "1.1", or "auto": the first exchange tries HTTP/2 (prior knowledge on
    ``http://``, ALPN on ``https://``) and falls back to HTTP/1.1 if the
    server does not speak it (vLLM's, SGLang's and llama.cpp's servers, most
    hosted providers); the answer is remembered. HTTP/2 runs on
    :mod:`backends.h2client`, HTTP/1.1 on httpx. ``token_ids``: True (the
    server honours ``return_token_ids``), False (never ask), "auto" (ask, and
    report what the answers show). ``stall_timeout``: the longest gap without
    a byte once streaming; ``first_token_timeout``: the longest wait for the
    response and its first event (default: the same)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        http: HTTPVersion = "auto",
        api_key: str | None = None,
        token_ids: bool | Literal["auto"] = "auto",
        connect_timeout: float = 5.0,
        stall_timeout: float = 60.0,
        first_token_timeout: float | None = None,
        health_timeout: float = 5.0,
        verify: ssl.SSLContext | str | bool = True,
        max_connections: int = 100,
        name: str | None = None,
        send_tenant: bool = False,
        priority: PriorityOrder = "higher_first",
    ) -> None:
        url = httpx.URL(base_url.rstrip("/").removesuffix("/v1"))
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url must be http(s)://host[:port], got {base_url!r}")
        if token_ids not in (True, False, "auto"):
            raise ValueError("token_ids must be True, False or 'auto'")
        if http not in ("auto", "1.1", "2"):
            raise ValueError(f"http must be 'auto', '1.1' or '2', got {http!r}")
        self.base_url, self.model, self.token_ids = str(url), model, token_ids
        self.name = name or f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
        self.stall_timeout = stall_timeout
        self.first_token_timeout = (
            first_token_timeout if first_token_timeout is not None else stall_timeout
        )
        self.health_timeout = health_timeout
        self.http = http
        self.send_tenant = send_tenant  # the request's tenant in x-headrace-tenant (headrace's engine accounts by it)
        # How the engine priority (higher runs first) goes upstream: as is
        # (headrace), negated (vLLM's priority scheduling runs lower first),
        # or not at all (a server without priority scheduling: vLLM's FCFS
        # refuses a non-zero one with a 400).
        self.priority = priority
        headers = [("authorization", f"Bearer {api_key}")] if api_key else []
        tls = url.scheme == "https"
        self._headers, self._verify, self._connect_timeout = headers, verify, connect_timeout
        self._kv_ssl: ssl.SSLContext | None = None  # built on the first subscription (see kv_events)
        # Both transports while ``auto`` has not heard back; the one that
        # answered once it has.
        self._transports: dict[str, _Transport] = {}
        if http != "1.1":
            self._transports["2"] = _H2(
                url, headers, tls=_ssl_context(verify) if tls else None,
                connect_timeout=connect_timeout, max_connections=max_connections,
            )  # fmt: skip
        if http != "2":
            self._transports["1.1"] = _H1(
                self.base_url, headers, verify=_tls_context(verify),
                connect_timeout=connect_timeout, max_connections=max_connections,
            )  # fmt: skip
        self._transport: _Transport | None = (
            None if http == "auto" else self._transports[http]
        )
        self._negotiating = trio.Lock()
        self._models: tuple[str, ...] | None = None
        self._max_context: int | None = None
        self._engine: dict[str, Any] = {}  # block_size, kv_events, tokenizer... from /v1/models
        self._saw_ids = False
        self._tally = StreamTally()

    @property
    def protocol(self) -> str | None:
        """"1.1" or "2"; None while ``auto`` has not heard back yet."""
        return self._transport.version if self._transport is not None else None

    async def _use(self) -> _Transport:
        """The transport to use; settles ``auto`` on the first call."""
        if self._transport is None:
            async with self._negotiating:
                if self._transport is None:
                    await self._negotiate()
        return self._transport or self._transports["2"]

    async def _negotiate(self) -> None:
        """Try HTTP/2 with an idempotent GET; if the server does not speak it,
        HTTP/1.1. Remember whichever answered; nothing is remembered while
        neither does (connection refused), so a later call tries again."""
        h2, h1 = self._transports["2"], self._transports["1.1"]
        try:
            await h2.get("/health")
        except H2Unsupported as exc:  # ALPN chose http/1.1, or an HTTP/1.1 answer to the preface
            try:
                await h1.get("/health")
            except Exception:  # neither answered: decide on a later try
                return
            log.info("backend %s speaks HTTP/1.1, not HTTP/2 (%s)", self.name, exc)
            self._transport = self._transports.pop("1.1")
            del self._transports["2"]
            await h2.aclose()
        except Exception:  # nothing answered (refused, timed out)
            return
        else:
            self._transport = self._transports.pop("2")
            del self._transports["1.1"]
            await h1.aclose()
        self._transports[self._transport.version] = self._transport

    # ------------------------------------------------------------ Backend

    def info(self) -> BackendInfo:
        """``token_ids``: as configured; with "auto", once an answer carried
        them or ``/v1/models`` says so. ``exact_resume`` (from ``/v1/models``)
        only with token ids: it is a promise about resuming by them."""
        models = self._models if self._models is not None else ((self.model,) if self.model else ())
        engine = dict(self._engine)
        advertised = engine.pop("token_ids", False)
        ids = self.token_ids if isinstance(self.token_ids, bool) else self._saw_ids or advertised
        engine["exact_resume"] = ids and engine.get("exact_resume", False)
        return BackendInfo(
            name=self.name, models=models, max_context=self._max_context, token_ids=ids, **engine
        )

    def statistics(self) -> HTTPBackendStatistics:
        t = self._tally
        return HTTPBackendStatistics(t.in_flight, t.started, t.completed, t.failed, t.cancelled)

    async def aclose(self) -> None:
        for transport in self._transports.values():
            await transport.aclose()

    async def health(self) -> Health:
        """``GET /health``, falling back to ``GET /v1/models`` where the
        server has no health route."""
        try:
            with trio.fail_after(self.health_timeout):
                transport = await self._use()
                status, _ = await transport.get("/health")
                if status == 404:
                    status, _ = await transport.get("/v1/models")
        except trio.TooSlowError:
            return Health(ok=False, detail=f"no answer within {self.health_timeout}s")
        except Exception as exc:  # a probe reports, it never raises
            drop_tracebacks(exc)
            return Health(ok=False, detail=f"unreachable: {exc!r}")
        ok = status == 200
        return Health(ok=ok, detail="" if ok else f"HTTP {status}")

    async def refresh(self) -> BackendInfo:
        """Read ``/v1/models`` (names, ``max_model_len`` where vLLM gives it,
        the engine's ``block_size``, ``kv_events`` and ``tokenizer``, and
        ``token_ids`` / ``exact_resume``) into the cache behind :meth:`info`."""
        try:
            with trio.fail_after(self.health_timeout):
                status, content = await (await self._use()).get("/v1/models")
        except trio.TooSlowError:
            raise BackendTimeout(f"/v1/models: no answer within {self.health_timeout}s") from None
        except _ERRORS as exc:
            raise transport_error(exc, started=False) from exc
        if status != 200:
            raise status_error(status, content)
        try:
            data = msgspec.json.decode(content)["data"]
            self._models = tuple(str(m["id"]) for m in data)
            lengths = [m["max_model_len"] for m in data if isinstance(m.get("max_model_len"), int)]
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
            raise BackendProtocolError(f"malformed /v1/models answer: {content[:200]!r}") from None
        self._max_context = min(lengths) if lengths else None
        self._engine = engine_fields(data)
        return self.info()

    async def kv_events(self, since: int = -1) -> AsyncIterator[KVEvent]:
        """The server's KV events with ``seq > since``, then new ones as they
        happen, over an HTTP/1.1 connection of its own (one long stream: not
        the request pool's, not the probes'). It never ends well: the server
        closing it is :class:`StreamBroken`; refused, :class:`BackendUnavailable`;
        a line that is not the engine's SSE, :class:`BackendProtocolError`."""
        parser = KVEventParser()
        timeout = httpx.Timeout(connect=self._connect_timeout, read=None,
                                write=self._connect_timeout, pool=self._connect_timeout)  # fmt: skip
        # One SSLContext per backend for every (re)subscription: httpx would
        # build one per client, loading the CA bundle with the event loop
        # held (25-35 ms each, more on the first), at every reconnect to a
        # restarted backend, just when its broken streams are migrating.
        if self._kv_ssl is None:
            self._kv_ssl = httpx.create_ssl_context(verify=_tls_context(self._verify), trust_env=False)
        client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=timeout,
                                   verify=self._kv_ssl, trust_env=False)  # fmt: skip
        try:
            async with client, client.stream(
                "GET", "/v1/kv_events", params={"since": since}, headers={"accept": "text/event-stream"}
            ) as response:
                if response.status_code != 200:
                    raise status_error(response.status_code, await _head(response.aiter_bytes()),
                                       response.headers.get("retry-after"))  # fmt: skip
                content_type = response.headers.get("content-type", "")
                if not content_type.startswith("text/event-stream"):
                    raise BackendProtocolError(f"/v1/kv_events: expected SSE, got {content_type or 'no content type'!r}")
                async for chunk in response.aiter_bytes():
                    for event in parser.feed(chunk):
                        yield event
        except HeadraceError:
            raise
        except _ERRORS as exc:
            raise transport_error(exc, started=parser.events > 0) from exc
        raise StreamBroken(f"/v1/kv_events ended after {parser.events} events")

    # The router may hand each stream a tighter stall timeout (its watchdog,
    # from the backend's measured inter-token latency) instead of timing the
    # events itself: this adapter already times every read.
    watches_stalls = True

    def stream(self, request: GenerateRequest, *, stall_timeout: float | None = None) -> AsyncIterator[Event]:
        """``stall_timeout``: this stream's longest silence once started, when
        tighter than the backend's own (:class:`BackendStalled` after it)."""
        path, payload = self._payload(request)
        stall = self.stall_timeout if stall_timeout is None else min(self.stall_timeout, stall_timeout)
        tenant = request.tenant if self.send_tenant and _HEADER_SAFE.fullmatch(request.tenant) else None
        return self._stream(path, payload, request.request_id, stall, request.traceparent, tenant)

    # ------------------------------------------------------------ internals

    def _payload(self, req: GenerateRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = dict(req.extra)
        chat = req.prompt_token_ids is None and req.messages is not None
        if chat:
            body["messages"] = [msgspec.to_builtins(m) for m in req.messages or []]
        else:
            body["prompt"] = (
                req.prompt_token_ids if req.prompt_token_ids is not None else (req.prompt or "")
            )
        model = req.model or self.model or (self._models[0] if self._models else None)
        if model:
            body["model"] = model
        body.update(stream=True, stream_options={"include_usage": True})
        # Sampling fields the client left unset stay unset upstream, so the
        # backend applies its model's defaults.
        for name, default in _SAMPLING_DEFAULTS:
            value = getattr(req, name)
            if value is not None and value != default:
                body[name] = value
        if req.logprobs is not None:
            body.update({"logprobs": True, "top_logprobs": req.logprobs} if chat else {"logprobs": req.logprobs})
        if req.priority and self.priority != "off":
            body["priority"] = req.priority if self.priority == "higher_first" else -req.priority
        if req.resumed_tokens:
            if req.prompt_token_ids is None:
                raise BadRequest("resumed_tokens needs a token-id prompt", param="resumed_tokens")
            body["resumed_tokens"] = req.resumed_tokens
        if self.token_ids is not False:
            body["return_token_ids"] = True
        return ("/v1/chat/completions" if chat else "/v1/completions"), body

    async def _stream(
        self, path: str, payload: dict[str, Any], request_id: str = "", stall: float | None = None,
        traceparent: str | None = None, tenant: str | None = None,
    ) -> AsyncGenerator[Event, None]:
        """POST and relay the SSE stream as events. Every failure leaves as
        one of our errors; the tokens so far tell a broken stream (after the
        first event: migratable) from an unavailable backend (before it).
        Timeouts cover the waits only, never a ``yield`` (the consumer's
        time is not the backend's)."""
        tally = self._tally
        tally.begin()
        outcome: Outcome = "cancelled"  # the consumer left, unless it ends otherwise
        try:
            parser = ChunkParser(chat=path.endswith("/chat/completions"))
            body = _json.encode(payload)
            stall = self.stall_timeout if stall is None else stall
            try:
                opened: AbstractAsyncContextManager[_Reply] | None = None  # the upstream stream, once open
                try:
                    with trio.move_on_after(self.first_token_timeout) as opening:
                        transport = await self._use()
                        headers = [*_POST_HEADERS, ("x-request-id", request_id)] if request_id else _POST_HEADERS
                        if traceparent:  # the router's span for this attempt (W3C trace context)
                            headers = [*headers, ("traceparent", traceparent)]
                        if tenant:
                            headers = [*headers, ("x-headrace-tenant", tenant)]
                        opening_stream = transport.open(path, body, headers)
                        reply = await opening_stream.__aenter__()
                        opened = opening_stream
                    if opening.cancelled_caught:
                        raise BackendTimeout(f"no response within {self.first_token_timeout}s")
                    if reply.status != 200:
                        raise await _status_error(reply)
                    content_type = reply.headers.get("content-type", "")
                    if not content_type.startswith("text/event-stream"):
                        raise BackendProtocolError(
                            f"expected an SSE stream, got {content_type or 'no content type'!r}"
                        )
                    decoder = SSEParser(strict=True)
                    chunks, ready, within = reply.chunks, reply.ready, reply.within
                    grace = 0.0  # more time for this silence: the router's own loop ran late
                    while not parser.done:  # after [DONE], the server may be slow to end
                        limit = stall if parser.events else self.first_token_timeout
                        chunk: bytes | None = None
                        try:
                            if ready is not None and ready():
                                # Already here: no silence to time, so no cancel
                                # scope (~6 us each on a slow core, one a read).
                                chunk = await chunks.__anext__()
                            elif within is not None:  # HTTP/2: the connection's reader keeps the time
                                chunk = await within(trio.current_time() + (grace or limit))
                            else:
                                with trio.move_on_after(grace or limit):
                                    chunk = await chunks.__anext__()
                        except StopAsyncIteration:
                            break
                        if chunk is None:
                            if parser.complete:
                                break  # everything came but [DONE]
                            if not grace and (grace := min(loop_lag.current(), limit)) >= LAG_GRACE_MIN:
                                continue  # once per silence, for as long as the loop was late
                            error = BackendStalled if parser.events else BackendTimeout
                            silent = limit + grace if grace >= LAG_GRACE_MIN else limit
                            raise error(f"no bytes from the backend for {silent:.3g}s (after {parser.events} events)")
                        grace = 0.0
                        try:
                            sse_events = decoder.feed(chunk)
                        except UnicodeDecodeError:
                            raise BackendProtocolError("stream data is not UTF-8") from None
                        # The events of this read, each but the last marked
                        # ``more_ready``, and the last too when the stream ends
                        # with it. Not before an error in the read's rest: what
                        # follows it (a migration) may wait. The stream's first
                        # event leaves alone, before the rest of its read is
                        # parsed: the first token is the one a client waits on.
                        rest, lone = iter(sse_events), not parser.events
                        while True:
                            batch: list[Event] = []
                            failure: HeadraceError | None = None
                            try:
                                for sse in rest:
                                    batch += parser.feed(sse.data)
                                    self._saw_ids = self._saw_ids or parser.saw_ids
                                    if lone and batch:
                                        break
                            except HeadraceError as exc:
                                failure = exc
                            last, ends = len(batch) - 1, parser.done and failure is None
                            for k, event in enumerate(batch):
                                event.more_ready = k < last or ends
                                if event.finish_reason is not None:
                                    outcome = "completed"
                                yield event
                            if failure is not None:
                                raise failure
                            if not (lone and batch):
                                break
                            lone = False
                finally:
                    if opened is not None:  # closed however the stream ends (an exit stack, without one)
                        await opened.__aexit__(*sys.exc_info())
            except HeadraceError:
                raise
            except _ERRORS as exc:
                if parser.done:
                    return  # broke after [DONE]: everything arrived
                if not parser.complete:
                    raise transport_error(exc, started=parser.events > 0) from exc
                # broke after the final event and usage: complete but for [DONE]
            except Exception as exc:
                # Anything untranslated (a bug, an error type a library let
                # through): the stream did not end well, so say so.
                log.warning("backend %s: stream failed with %r", self.name, exc)
                raise transport_error(exc, started=parser.events > 0) from exc
            if not parser.done:
                final = parser.end()  # the final event, or StreamBroken without one
                outcome = "completed"
                yield final
        except HeadraceError:
            outcome = "failed"
            raise
        finally:
            tally.end(outcome)


_json = msgspec.json.Encoder()
# Each sampling field but logprobs (spelt per endpoint) with its default.
_SAMPLING_DEFAULTS = [
    (f.name, f.default_factory() if f.default is msgspec.NODEFAULT else f.default)
    for f in SAMPLING_FIELDS
    if f.name != "logprobs"
]


async def _head(chunks: AsyncIterator[bytes]) -> bytes:
    """At most MAX_ERROR_BODY bytes of an error answer's body."""
    body = b""
    try:
        with trio.move_on_after(5.0):
            async for chunk in chunks:
                body += chunk
                if len(body) > MAX_ERROR_BODY:
                    break
    except Exception:  # the status says enough
        pass
    return body[:MAX_ERROR_BODY]


async def _status_error(reply: _Reply) -> HeadraceError:
    """The error for a non-200 answer, from (at most 64 KiB of) its body."""
    return status_error(reply.status, await _head(reply.chunks), reply.headers.get("retry-after"))

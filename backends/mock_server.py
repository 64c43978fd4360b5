"""``headrace mock``: the deterministic mock backend as an OpenAI-compatible
server, with faults injected at the HTTP level.

The wire format is the shared frontend's (``frontend.server``), so the
mock speaks exactly what the router and the engine speak. Faults live in a
small ASGI middleware around that app, :class:`FaultInjector`, which watches
the SSE chunks the frontend sends and, on a request drawn to fail (a
deterministic draw at ``--fault-rate``), breaks the response the way a real
server breaks::

    status=500|503[:retry-after=S], 429[:retry-after=S]  refuse before the app runs
    cut-after=N        after N tokens, end the app without finishing the body:
                       HTTP/1.1 closes the connection, HTTP/2 resets the stream
    stall-after=N      after N tokens, stop sending; keep the connection open
    malformed-after=N  after N tokens, send a garbage ``data:`` line and end
    no-done            send the final chunk (and the usage chunk, when asked
                       for), then end the body without ``data: [DONE]``: a
                       complete answer
    no-final           end the body cleanly right before the chunk with the
                       finish reason (and the last token in it): a broken one
    slow-first-token=MS  delay the response head (and so the first token)

One fault is the backend's, not the HTTP layer's: ``diverge`` (``MockConfig.faults``)
mixes the request counter into the seed, so two identical requests (the same
prompt and seed) get different text, as from a server whose output is not a
function of the request; replay-and-verify has to notice. And ``--no-token-ids``
(``MockConfig.token_ids=False``) makes an ordinary OpenAI server of it: chunks
never carry ``token_ids``, ``prompt_token_ids`` or ``seed`` (``return_token_ids``
is dropped from the request before the frontend reads it), ``/v1/generate`` (the
native route, all token ids) is a 404, and ``/v1/models`` says ``token_ids:
false``.

Each ``/v1/models`` entry says ``token_ids`` and ``exact_resume`` (true unless
one of those two is on: the mock's output is a function of the request, and a
request resumed with ``resumed_tokens`` continues it exactly).

``GET /stats`` reports the backend's counters (in flight, cancelled...) so a
test in another process can see a cancellation arrive.

With the prefix-cache model on (``--block-size N``; ``backends.mock_cache``),
``GET /v1/kv_events`` streams the replica's KV events as the engine's server
does (SSE ``id: SEQ`` / ``data: <KVEvent json>``; ``?since=SEQ`` or
``Last-Event-ID`` resumes; the last 10,000 kept), and each ``/v1/models``
entry adds ``block_size``, ``kv_events: true`` and ``tokenizer: "bytes"`` (the
mock's token ids are the prompt's UTF-8 bytes, chat rendered by
``backends.mock.render_chat``), so a router can compute the same block hashes.

``headrace mock`` serves on its own lean HTTP/1.1 + h2c server
(``backends.mock_http``; ``--server hypercorn`` for TLS or the shared stack),
which hands each zero-delay generation to :meth:`FaultInjector.answer_now`
before any task starts for it. CPU per streamed 20-chunk request (h2load /
wrk closed loop, 8 connections, ``--tpot-ms 0 --max-tokens 20``): 0.19 ms over
h2c, 0.14 ms over HTTP/1.1 (3.5 and 2.6 ms on hypercorn before); ~0.35 ms
behind ``headrace serve`` at ~350 req/s, where each request wakes the mock on
its own (``headrace bench router`` prints it as "mocks ms/req").

The mock is a benchmarking tool, so a streamed generation request that no
fault touches takes a fast path, :class:`FastPath`: the events of
:meth:`MockBackend.admit` are rendered straight to SSE bytes, byte for byte
what the frontend sends (``tests/backends/test_mock_fast.py`` compares the
two), and the chunks that are ready at once go out in one
``http.response.body`` message: the whole answer when ``--tpot-ms 0``, one
chunk per token at its time otherwise. Requests with faults, and shapes the
fast path leaves alone (``n > 1``, several prompts, logprobs, non-streaming),
go through the frontend with their body replayed::

    FaultInjector ── not generation ──────────────> OpenAIServer (frontend)
          │ drawn to fail ── _FaultySend ─────────> OpenAIServer
          └ otherwise ──> FastPath ── other shapes ─> OpenAIServer
                              └ render events, send
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import trio

from backends.base import Event
from backends.errors import HeadraceError, NotFound
from backends.mock import Fault, MockBackend, MockConfig, MockRun, fault_applies, parse_fault
from backends.mock_http import Answer, serve_lean
from frontend.call import Call, prepare_call
from frontend.context import RequestContext, apply_trace, new_request_id, trace_logger
from frontend.kv_stream import kv_events_response
from frontend.server import (
    DEFAULT_MAX_BODY,
    Handler,
    HTTPRequest,
    OpenAIServer,
    Response,
    error_response,
    json_response,
    without_body_writer,
)
from frontend.serving import ServeOptions, os_error_in, serve, wait_for_signal
from frontend.wire import Kind, error_body, usage_payload

__all__ = ["FastPath", "FaultInjector", "build_app", "main"]

GENERATION_KINDS: dict[str, Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/generate": "native",
}
GENERATION_PATHS = frozenset(GENERATION_KINDS)
GARBAGE = b'data: {"choices": [{"text": "\n\n'
BACKEND_FAULTS = frozenset({"diverge"})  # injected by MockBackend, not here
_DONE = b"data: [DONE]\n\n"
_STATUS_ERRORS = {
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "backend_unavailable"),
}

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _Cut(Exception):
    """Abandon the response mid-body (the transport is torn down)."""


class _Stop(Exception):
    """End the response body cleanly, now."""


class FaultInjector:
    """ASGI middleware: apply ``faults`` to a deterministic fraction ``rate``
    of generation requests; everything else passes through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        faults: Sequence[Fault],
        *,
        rate: float = 1.0,
        seed: int = 0,
        fast: ASGIApp | None = None,
    ) -> None:
        backend_faults = [f.kind for f in faults if f.kind in BACKEND_FAULTS]
        if backend_faults:
            raise ValueError(f"{backend_faults[0]} is a fault of the backend: MockConfig(faults=...)")
        self.app, self.faults, self.rate, self.seed = app, list(faults), rate, seed
        self.fast = fast or app  # serves the generation requests no fault touches
        self.requests = 0
        self.injected = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self._eligible(scope):
            await self.app(scope, receive, send)
            return
        index, self.requests = self.requests, self.requests + 1
        if not self.faults or not fault_applies(self.seed, index, self.rate):
            await self.fast(scope, receive, send)
            return
        self.injected += 1
        status = next((f for f in self.faults if f.kind == "status"), None)
        if status is not None:
            await _refuse(status, receive, send)
            return
        try:
            await self.app(without_body_writer(scope), receive, _FaultySend(send, self.faults))
        except* _Cut:
            pass  # returning mid-body: hypercorn closes the connection / resets the stream
        except* _Stop:
            await send({"type": "http.response.body", "body": b""})

    def answer_now(self, scope: dict[str, Any], body: bytes) -> Answer | None:
        """:meth:`FastPath.answer_now` for a request no fault touches (the lean
        server's synchronous path); None leaves the request to ``__call__``."""
        if not isinstance(self.fast, FastPath) or not self._eligible(scope):
            return None
        if self.faults and fault_applies(self.seed, self.requests, self.rate):
            return None
        answer = self.fast.answer_now(scope, body)
        if answer is not None:
            self.requests += 1
        return answer

    def _eligible(self, scope: dict[str, Any]) -> bool:
        return (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_PATHS
        )


class _FaultySend:
    """Wraps ASGI ``send``: counts tokens in outgoing SSE chunks and breaks the
    response once a fault's ``after`` is reached."""

    def __init__(self, send: Any, faults: list[Fault]) -> None:
        self.send = send
        self.delay = sum(f.delay_s for f in faults if f.kind == "slow_first_token")
        self.breaking = [f for f in faults if f.kind in ("cut", "stall", "malformed")]
        self.no_done = any(f.kind == "no_done" for f in faults)
        self.no_final = any(f.kind == "no_final" for f in faults)
        self.sse = False
        self.tokens = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await trio.sleep(self.delay)
            headers = dict(message.get("headers", []))
            self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and message.get("body"):
            body: bytes = message["body"]
            if self.sse and self.no_done and body.endswith(_DONE):
                body = body.removesuffix(_DONE)
                message = {**message, "body": body}
                if not body:
                    return
            await self._maybe_break()
            chunk = _chunk(body) if self.sse else None
            if self.no_final and chunk is not None and _is_final(chunk):
                raise _Stop
            self.tokens += _count_tokens(chunk) if chunk is not None else 0
        await self.send(message)

    async def _maybe_break(self) -> None:
        due = [f for f in self.breaking if f.after <= self.tokens or not self.sse]
        if not due:
            return
        kind = due[0].kind
        if kind == "cut":
            raise _Cut
        if kind == "stall":
            await trio.sleep_forever()
        await self.send({"type": "http.response.body", "body": GARBAGE, "more_body": True})
        raise _Stop


def _chunk(body: bytes) -> dict[str, Any] | None:
    """One SSE event as the frontend frames it (one event per send), decoded."""
    payload = body.strip().removeprefix(b"data:").strip()
    try:
        obj = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _count_tokens(chunk: dict[str, Any]) -> int:
    """Tokens in one chunk (one per choice when it carries no ids)."""
    if isinstance(chunk.get("choices"), list):
        return sum(
            max(1, len(c.get("token_ids") or [])) for c in chunk["choices"] if isinstance(c, dict)
        )
    return len(chunk.get("token_ids") or [])


def _is_final(chunk: dict[str, Any]) -> bool:
    """Whether the chunk carries a finish reason (of a choice, or native)."""
    choices = chunk.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)
    return chunk.get("finish_reason") is not None


async def _refuse(fault: Fault, receive: Any, send: Any) -> None:
    while True:  # drain the request body first, as a real server would
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    type_, code = _STATUS_ERRORS.get(fault.status, ("server_error", None))
    body = msgspec.json.encode(
        error_body(f"injected fault: status {fault.status}", type_, None, code)
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if fault.retry_after is not None:
        headers.append((b"retry-after", str(max(0, round(fault.retry_after))).encode()))
    await send({"type": "http.response.start", "status": fault.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(
    backend: MockBackend,
    faults: Sequence[Fault] = (),
    *,
    fault_rate: float = 1.0,
    seed: int = 0,
    fast: bool = True,
) -> FaultInjector:
    """The mock's ASGI app: the shared frontend plus ``GET /stats``, wrapped
    in the fault injector, with the fast path in front (unless ``fast=False``)."""
    injector: FaultInjector

    async def stats(request: HTTPRequest) -> Response:
        counters = msgspec.structs.asdict(backend.statistics())
        counters.update(requests=injector.requests, faults_injected=injector.injected)
        return json_response(counters)

    routes: dict[tuple[str, str], Handler] = {
        ("GET", "/stats"): stats, ("GET", "/v1/models"): partial(_models, backend),
    }
    if backend.cache is not None:
        routes[("GET", "/v1/kv_events")] = partial(_kv_events, backend)
    if not backend.config.token_ids:
        routes[("POST", "/v1/generate")] = _no_native
    server: ASGIApp = OpenAIServer(backend, extra_routes=routes, finished=_trace_line)
    if not backend.config.token_ids:
        server = _WithoutTokenIds(server)
    fast_path = FastPath(backend, server) if fast else None
    injector = FaultInjector(server, faults, rate=fault_rate, seed=seed, fast=fast_path)
    return injector


_KV_EPOCH = secrets.token_hex(8)  # this process's run of KV event numbers
# A DEBUG line per request with its trace (the fast path's too): a benchmark tool logs nothing per request by default.
_requests_log = logging.getLogger("headrace.mock.requests")
_trace_line = trace_logger(_requests_log, logging.DEBUG)


def _log_fast(scope: dict[str, Any]) -> None:
    """The fast path's request line (it bypasses the frontend's hook)."""
    if _requests_log.isEnabledFor(logging.DEBUG):
        context = RequestContext(request_id=new_request_id())
        apply_trace(context, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])})
        _trace_line(context, scope["path"], 200)


async def _models(backend: MockBackend, request: HTTPRequest) -> Response:
    """The frontend's model list, plus what a router resumes streams by
    (``token_ids``, ``exact_resume``) and, with the prefix-cache model on,
    what it needs to hash blocks."""
    info = backend.info()
    extra: dict[str, Any] = {"token_ids": info.token_ids, "exact_resume": info.exact_resume}
    if backend.cache is not None:
        extra |= {"block_size": info.block_size, "kv_capacity_blocks": info.kv_capacity_blocks,
                  "prefix_sharing": info.prefix_sharing,
                  "kv_events": True, "tokenizer": "bytes",
                  "kv_epoch": _KV_EPOCH}
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": info.name,
         "max_model_len": info.max_context, **extra}
        for m in info.models
    ]
    return json_response({"object": "list", "data": data})


async def _no_native(request: HTTPRequest) -> Response:
    """``--no-token-ids``: no native route (its answers are all token ids)."""
    raise NotFound(f"no route for {request.path} (this mock reports no token ids)")


class _WithoutTokenIds:
    """ASGI middleware for ``--no-token-ids``: drops ``return_token_ids``
    from generation requests before the frontend reads them, so no chunk
    carries ids. A body it cannot read (too large, cut short, not a JSON
    object) goes on as it came, for the frontend to answer."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int = DEFAULT_MAX_BODY) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        messages, body = await _read_body(receive, self.max_body_bytes)
        if body is not None:
            stripped = _without_token_ids(body)
            if stripped is not None:
                messages = [{"type": "http.request", "body": stripped, "more_body": False}]
        await self.app(scope, _replay(messages, receive), send)


def _without_token_ids(body: bytes) -> bytes | None:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict) or "return_token_ids" not in obj:
        return None
    del obj["return_token_ids"]
    return msgspec.json.encode(obj)


async def _kv_events(backend: MockBackend, request: HTTPRequest) -> Response:
    """``backends.engine.server``'s KV event stream, over the mock's cache."""
    return kv_events_response(request, backend.kv_events)


# ---------------------------------------------------------------- fast path

_encode = msgspec.json.encode
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class FastPath:
    """ASGI app: streamed generation requests of the common shape, rendered
    from :class:`MockRun` events to SSE bytes without the frontend's per-chunk
    dicts, channels and sends; every other request goes to ``fallback``
    (the frontend) with the body it already read replayed."""

    def __init__(
        self, backend: MockBackend, fallback: ASGIApp, *, max_body_bytes: int = DEFAULT_MAX_BODY
    ) -> None:
        self.backend, self.fallback, self.max_body_bytes = backend, fallback, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = GENERATION_KINDS.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST" or self.backend.config.faults:
            await self.fallback(scope, receive, send)
            return
        messages, body = await _read_body(receive, self.max_body_bytes)
        call = None
        if body is not None:
            try:
                call = self._admit(kind, body)
            except HeadraceError as exc:
                await _send_error(send, exc)
                return
        if call is None:  # the frontend answers, and says what was wrong
            await self.fallback(scope, _replay(messages, receive), send)
            return
        renderer, run = call
        _log_fast(scope)
        config = self.backend.config
        with run:
            if config.ttft_s == 0 and config.tpot_s == 0 and config.prefill_s_per_token == 0:
                self.backend.prefill_now(run)
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                await send({"type": "http.response.body", "body": renderer.burst(run)})
                run.sent()
            else:
                await self._paced(renderer, run, receive, send)

    def answer_now(self, scope: dict[str, Any], body: bytes) -> Answer | None:
        """The whole answer to a zero-delay generation, without awaiting
        anything; None for requests only :meth:`__call__` answers."""
        config = self.backend.config
        kind = GENERATION_KINDS.get(scope["path"])
        if (kind is None or scope["method"] != "POST" or config.faults or config.ttft_s
                or config.tpot_s or config.prefill_s_per_token or len(body) > self.max_body_bytes):
            return None
        try:
            call = self._admit(kind, body)
        except HeadraceError as exc:
            response = error_response(exc)
            return response.status, _error_headers(response), response.body
        if call is None:
            return None
        renderer, run = call
        _log_fast(scope)
        with run:
            self.backend.prefill_now(run)
            data = renderer.burst(run)
            run.sent()
        return 200, _SSE_HEADERS, data

    def _admit(self, kind: Kind, body: bytes) -> tuple[_Renderer, MockRun] | None:
        """What the frontend does up to the first event, in its order (so
        errors are the same); None for shapes the fast path leaves alone."""
        ids = self.backend.config.token_ids
        if kind == "native" and not ids:
            return None  # the frontend's 404 (see build_app)
        call = prepare_call(kind, body, self.backend, RequestContext(request_id=new_request_id()))
        if not call.wire.stream or len(call.subs) != 1 or call.subs[0].logprobs is not None:
            return None
        return _Renderer(call, token_ids=ids), self.backend.admit(call.subs[0])

    async def _paced(self, renderer: _Renderer, run: MockRun, receive: Any, send: Any) -> None:
        """First token after ``ttft``, one per ``tpot`` after it; a client that
        leaves cancels the run (counted as cancelled)."""
        config = self.backend.config
        async with trio.open_nursery() as nursery:
            # Cancelled when the client leaves. The last message is sent
            # outside it: once that is handed over, a disconnect is no news.
            with trio.CancelScope() as live:
                nursery.start_soon(_watch_disconnect, receive, live)
                await self.backend.prefill(run)
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                while True:
                    parts = [renderer.chunk(run.step())]
                    while not run.finished and config.tpot_s == 0:
                        parts.append(renderer.chunk(run.step()))
                    if run.finished:
                        break
                    await send({"type": "http.response.body", "body": b"".join(parts),
                                "more_body": True})
                    await trio.sleep(config.tpot_s)
            if run.finished:
                parts.append(renderer.tail())
                await send({"type": "http.response.body", "body": b"".join(parts)})
                run.sent()
            nursery.cancel_scope.cancel()


class _Renderer:
    """One call's SSE chunks, laid out as ``OpenAIServer`` lays them out
    (msgspec, keys in the frontend's order, no spaces)."""

    def __init__(self, call: Call, *, token_ids: bool = True) -> None:
        kind, rid, model, created = call.kind, call.rid, call.model, call.created
        options = call.wire.stream_options
        self.kind, self.token_ids = kind, call.token_ids and token_ids
        self.include_usage = kind != "native" and options is not None and options.include_usage
        self.first = True
        self.usage = b""
        if kind == "native":
            self.head = b'data: {"id":' + _encode(rid)
            text, after, self.end = b',"text":', b"", b"}\n\n"
        else:
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            self.head = b"".join((
                b'data: {"id":', _encode(rid), b',"object":', _encode(obj), b',"created":',
                _encode(created), b',"model":', _encode(model), b',"choices":',
            ))
            chat = kind == "chat"
            text = b'[{"index":0,"delta":{"content":' if chat else b'[{"index":0,"text":'
            after = b'}' * chat + b',"logprobs":null,"finish_reason":null'
            self.end = b"}]}\n\n"
        # A chunk between the first and the last: the same bytes around its text and ids.
        self.before, self.ids_at, self.after = self.head + text, after + b',"token_ids":', after + self.end

    def burst(self, run: MockRun) -> bytes:
        """Every chunk of ``run``, usage and ``[DONE]``: one body."""
        parts = [self.chunk(e) for e in run.rest()]
        parts.append(self.tail())
        return b"".join(parts)

    def chunk(self, event: Event) -> bytes:
        first, self.first = self.first, False
        if not first and event.finish_reason is None:
            if self.token_ids:
                return self.before + _encode(event.text) + self.ids_at + _encode(event.token_ids) + self.end
            return self.before + _encode(event.text) + self.after
        if event.usage is not None:
            self.usage = _encode(usage_payload(event.usage))
        if self.kind == "native":
            return self._native(event)
        if self.kind == "chat":
            delta = b'{"role":"assistant","content":' if first else b'{"content":'
            parts = [self.head, b'[{"index":0,"delta":', delta, _encode(event.text), b"}"]
        else:
            parts = [self.head, b'[{"index":0,"text":', _encode(event.text)]
        parts += (b',"logprobs":null,"finish_reason":', _encode(event.finish_reason))
        if self.token_ids:
            self._ids(event, parts)
        parts.append(b"}]}\n\n")
        return b"".join(parts)

    def _native(self, event: Event) -> bytes:
        parts = [self.head, b',"text":', _encode(event.text)]
        self._ids(event, parts)
        if event.finish_reason is not None:
            parts += (b',"finish_reason":', _encode(event.finish_reason), b',"usage":', self.usage)
        parts.append(b"}\n\n")
        return b"".join(parts)

    @staticmethod
    def _ids(event: Event, parts: list[bytes]) -> None:
        parts += (b',"token_ids":', _encode(event.token_ids))
        if event.prompt_token_ids is not None:
            parts += (b',"prompt_token_ids":', _encode(event.prompt_token_ids))
        if event.seed is not None:
            parts += (b',"seed":', _encode(event.seed))

    def tail(self) -> bytes:
        """After the last event: the usage chunk (when asked for) and ``[DONE]``."""
        if not self.include_usage:
            return _DONE
        return self.head + b'[],"usage":' + (self.usage or b"null") + b"}\n\n" + _DONE


async def _read_body(receive: Any, limit: int) -> tuple[list[dict[str, Any]], bytes | None]:
    """The request's messages, and its body (None when it was cut short or is
    over ``limit``: the frontend answers those)."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        size += len(message.get("body", b""))
        if size > limit:
            return messages, None
        if not message.get("more_body", False):
            return messages, b"".join(m.get("body", b"") for m in messages)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Callable[[], Awaitable[Any]]:
    pending = list(messages)

    async def replay() -> Any:
        return pending.pop(0) if pending else await receive()

    return replay


def _error_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """The headers the frontend sends with an error (``_send_response``'s order)."""
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in response.headers]
    headers.append((b"content-length", str(len(response.body)).encode()))
    return headers


async def _send_error(send: Any, exc: HeadraceError) -> None:
    """The frontend's error answer: ``error_response`` with its headers."""
    response = error_response(exc)
    await send({"type": "http.response.start", "status": response.status,
                "headers": _error_headers(response)})
    await send({"type": "http.response.body", "body": response.body})


async def _watch_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


# ---------------------------------------------------------------- command line


def _fault(spec: str) -> Fault:
    try:
        return parse_fault(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="headrace mock", description="A deterministic OpenAI-compatible mock backend."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    p.add_argument("--tpot-ms", type=float, default=0.0, help="time per output token")
    p.add_argument("--max-tokens", type=int, default=256, help="output length cap")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="served model name (repeatable)",
    )
    p.add_argument(
        "--fault",
        action="append",
        type=_fault,
        default=[],
        metavar="SPEC",
        help="cut-after=N, stall-after=N, malformed-after=N, no-done (final event and usage, "
        "no [DONE]), no-final (ends before the final event), diverge (identical requests "
        "get different text), slow-first-token=MS, status=500|503[:retry-after=S], "
        "429[:retry-after=S] (repeatable; see the module docs)",
    )
    p.add_argument(
        "--fault-rate", type=float, default=1.0, help="fraction of requests hit by the faults"
    )
    p.add_argument(
        "--no-token-ids", dest="token_ids", action="store_false",
        help="act as a server that reports no token ids: no token_ids, prompt_token_ids or "
        "seed in chunks (return_token_ids is ignored), no /v1/generate",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for fault draws and for seedless requests"
    )
    p.add_argument(
        "--block-size", type=int, default=0, metavar="TOKENS",
        help="turn on the prefix-cache model: tokens per KV block (e.g. 16; 0: off)",
    )
    p.add_argument(
        "--cache-blocks", type=int, default=4096, metavar="N",
        help="prefix-cache capacity in blocks (LRU; with --block-size)",
    )
    p.add_argument(
        "--prefill-ms-per-token", type=float, default=0.0, metavar="MS",
        help="prefill cost of each uncached prompt token, paid in the replica's one "
        "prefill lane, after --ttft-ms (with --block-size)",
    )
    p.add_argument(
        "--prefill-chunk-tokens", type=int, default=512, metavar="TOKENS",
        help="chunked prefill: a prefill holds the lane this many tokens at a time, so a "
        "higher-priority request waits at most one chunk (the engine's budget per step; "
        "0: whole prompts)",
    )
    p.add_argument("--certfile")
    p.add_argument("--keyfile")
    p.add_argument(
        "--server",
        choices=("auto", "lean", "hypercorn"),
        default="auto",
        help="lean: the mock's own HTTP/1.1 + h2c server (backends.mock_http, ~4x less CPU "
        "per request); hypercorn: the shared stack (TLS, h2c upgrade); auto: lean unless "
        "--certfile is given",
    )
    return p


def _config(args: argparse.Namespace) -> MockConfig:
    return MockConfig(
        ttft_s=args.ttft_ms / 1000,
        tpot_s=args.tpot_ms / 1000,
        max_tokens=args.max_tokens,
        max_context=args.max_context,
        models=tuple(args.models or ("mock",)),
        seed=args.seed,
        faults=tuple(f for f in args.fault if f.kind in BACKEND_FAULTS),
        fault_rate=args.fault_rate,
        token_ids=args.token_ids,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )


async def _serve(args: argparse.Namespace) -> None:
    backend = MockBackend(_config(args))
    http_faults = [f for f in args.fault if f.kind not in BACKEND_FAULTS]
    app = build_app(backend, http_faults, fault_rate=args.fault_rate, seed=args.seed)
    options = ServeOptions(
        args.host, args.port, certfile=args.certfile, keyfile=args.keyfile, graceful_timeout=5.0
    )
    lean = args.server == "lean" or (args.server == "auto" and args.certfile is None)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_signal, shutdown)
        if lean:
            run = partial(serve_lean, app, options, answer_now=app.answer_now, shutdown=shutdown)
        else:
            run = partial(serve, app, options, shutdown=shutdown)
        url = await nursery.start(run)
        print(f"mock listening on {url}", flush=True)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    bad = [
        ("--max-tokens", args.max_tokens < 1),
        ("--max-context", args.max_context < 1),
        ("--fault-rate", not 0.0 <= args.fault_rate <= 1.0),
        ("--ttft-ms/--tpot-ms", args.ttft_ms < 0 or args.tpot_ms < 0),
        ("--block-size", args.block_size < 0),
        ("--cache-blocks", args.cache_blocks < 1),
        ("--prefill-ms-per-token", args.prefill_ms_per_token < 0),
        ("--prefill-chunk-tokens", args.prefill_chunk_tokens < 0),
        ("--prefill-ms-per-token without --block-size",
         args.prefill_ms_per_token > 0 and args.block_size == 0),
        ("--certfile/--keyfile", (args.certfile is None) != (args.keyfile is None)),
        ("--server lean with --certfile (no TLS there)", args.server == "lean" and args.certfile),
    ]
    for name, is_bad in bad:
        if is_bad:
            print(f"headrace mock: bad {name}", file=sys.stderr)
            return 2
    try:
        trio.run(_serve, args)
    except KeyboardInterrupt:
        return 130
    except (OSError, BaseExceptionGroup) as exc:
        error = os_error_in(exc)
        if error is None:
            raise
        print(f"headrace mock: cannot serve: {error}", file=sys.stderr)
        return 1
    return 0

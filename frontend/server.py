"""Serve any :class:`~backends.base.Backend` as an OpenAI-compatible HTTP API.

One ASGI app used three times: by the mock server, by the engine server, and
by the router (whose "backend" is its dispatcher: routing, retries,
migration, and whose gate is its request pipeline). Routes::

    POST /v1/completions        OpenAI completions, SSE or JSON
    POST /v1/chat/completions   OpenAI chat completions, SSE or JSON
    POST /v1/generate           native: text + token ids out, SSE or JSON
    GET  /v1/models
    GET  /health
    + extra routes given by the embedding server (metrics, admin, tokenize,
      jobs...), which may take path parameters: ``/v1/jobs/{id}``

The path of one request::

    ASGI scope ─> RequestContext (id, tenant: authenticate(headers), arrival)
      body ─> route ─> handler(HTTPRequest)
        completions/chat/generate: prepare_call (decode once) ─> gate.admit ─> Call
      ─> Response (JSON, or SSE from the call's producer) ─> observe(route, status, tenant, s)

Each request runs in its own nursery beside a task that watches for the
client's ``http.disconnect``: a client that goes away (or resets its HTTP/2
stream) cancels the backend stream at once, which frees its slot.

Errors: every :class:`~backends.errors.HeadraceError` becomes an OpenAI error
body with its status here, in :func:`error_response`, and nowhere else. Once a
stream has started, an error is sent as a final ``data: {"error": ...}`` event
and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from contextlib import AsyncExitStack
from typing import Any, TypeVar, cast

import msgspec
import trio

from backends.base import Backend
from backends.errors import BadRequest, HeadraceError, PayloadTooLarge, RequestTimeout
from frontend.call import Emit, Producer, prepare_call
from frontend.context import (
    OPEN_GATE,
    Gate,
    Principal,
    RequestContext,
    apply_request_headers,
    apply_trace,
    request_id_from,
)
from frontend.routes import RouteTable
from frontend.wire import Kind, error_body

__all__ = [
    "DEFAULT_BODY_IDLE_TIMEOUT",
    "DEFAULT_MAX_BODY",
    "Authenticate",
    "BodyReader",
    "Emit",
    "HTTPRequest",
    "Handler",
    "OpenAIServer",
    "Producer",
    "RequestTimeout",
    "Response",
    "StreamingBody",
    "error_response",
    "json_response",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 * 1024 * 1024
DEFAULT_BODY_IDLE_TIMEOUT = 10.0  # seconds without a body byte before 408
_encoder = msgspec.json.Encoder()


class HTTPRequest:
    """What a route handler sees: method, path, path parameters, query,
    headers, body, the request's context, ``defer`` (an exit stack closed
    once the response has been sent: a streamed answer's resources live until
    its last byte) and :meth:`task_nursery` (tasks that live as long as the
    response)."""

    def __init__(
        self,
        scope: dict[str, Any],
        body: bytes,
        context: RequestContext,
        tasks: _Tasks,
        *,
        headers: dict[str, str],
        params: dict[str, str],
        defer: AsyncExitStack,
    ) -> None:
        self.scope = scope
        self._tasks = tasks
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")
        self.headers = headers
        self.params = params
        self.body = body
        self.context = context
        self.defer = defer
        self.reader: BodyReader | None = None  # a StreamingBody route's body, unread

    async def task_nursery(self) -> trio.Nursery:
        """A nursery whose tasks live as long as the response, cancelled
        when the client leaves or the response is sent. Opened on first use."""
        return await self._tasks.nursery()


class _Tasks:
    """A request's nursery, opened on first use, in ``stack`` (inside the
    request's cancel scope, closed before it). Most requests start no task,
    and a nursery even without a task costs a scheduler turn at its exit."""

    __slots__ = ("_nursery", "_stack")

    def __init__(self, stack: AsyncExitStack) -> None:
        self._stack = stack
        self._nursery: trio.Nursery | None = None

    async def nursery(self) -> trio.Nursery:
        if self._nursery is None:
            self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        return self._nursery


class BodyReader:
    """The request body of a :class:`StreamingBody` route, chunk by chunk as
    it arrives (``read()``; ``b""`` at its end), for handlers that write it
    somewhere instead of holding it (file uploads). A client silent for
    ``idle_timeout`` is a 408; one that leaves is a 400. The handler enforces its own size limit."""

    def __init__(self, receive: Any, idle_timeout: float) -> None:
        self._receive, self.idle_timeout, self.done = receive, idle_timeout, False

    async def read(self) -> bytes:
        while not self.done:
            message: dict[str, Any] | None = None
            with trio.move_on_after(self.idle_timeout):
                message = await self._receive()
            if message is None:
                raise RequestTimeout(f"no request body bytes for {self.idle_timeout:g} s")
            if message["type"] == "http.disconnect":
                raise BadRequest("client went away before sending the body")
            self.done = not message.get("more_body", False)
            chunk: bytes = message.get("body", b"")
            if chunk:
                return chunk
        return b""


class StreamingBody:
    """Wraps a handler that reads its body itself (``request.reader``): the
    server does not buffer it nor apply ``max_body_bytes``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, request: HTTPRequest) -> Response:
        return await self.handler(request)


class Response:
    """A complete response, or a streaming one when ``stream`` is set."""

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        *,
        content_type: str = "application/json",
        headers: Iterable[tuple[str, str]] = (),
        stream: Producer | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = list(headers)
        self.stream = stream


Handler = Callable[[HTTPRequest], Awaitable[Response]]
# ``authenticate(headers) -> Principal``; raises Unauthorized.
Authenticate = Callable[[dict[str, str]], Principal]


def json_response(obj: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Response:
    return Response(status, _encoder.encode(obj), headers=headers)


def error_response(exc: HeadraceError) -> Response:
    """The one place an error becomes an HTTP response."""
    headers = []
    if exc.retry_after is not None:
        headers.append(("retry-after", str(max(1, math.ceil(exc.retry_after)))))
    headers += getattr(exc, "headers", ())  # x-ratelimit-* of a rate limit refusal
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return json_response(body, exc.status, headers)


class OpenAIServer:
    """ASGI app serving ``backend`` with the OpenAI API.

    ``authenticate(headers) -> Principal`` runs first, on the headers, before
    any of the body is read, and may raise
    :class:`~backends.errors.Unauthorized`; a body that sends nothing for
    ``body_idle_timeout`` seconds is answered 408 (:class:`RequestTimeout`); ``extra_routes`` maps
    ``(method, path)`` to handlers (they take precedence over built-ins; a
    path may hold ``{name}`` parameters). ``gate`` admits each completions,
    chat or generate call once, before its fan-out into choices (the router's
    request pipeline; open by default). ``observe(route, status, tenant,
    seconds)`` is called once per request, however it ended, with the route
    template. ``coalesce``: SSE events that are ready together leave in one
    write (one socket send and one HTTP/2 DATA frame instead of one per
    token); off, every event is its own write, which fault injectors that
    count tokens per write rely on. ``openai_routes=False``: only
    ``extra_routes`` (an admin or ops app that must never serve generations).
    ``finished(context, route, status)``: called once per request after
    ``observe``, with its context (trace, the router's record): request logs.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        extra_routes: dict[tuple[str, str], Handler] | None = None,
        authenticate: Authenticate | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        observe: Callable[[str, int, str, float], None] | None = None,
        gate: Gate = OPEN_GATE,
        coalesce: bool = False,
        body_idle_timeout: float = DEFAULT_BODY_IDLE_TIMEOUT,
        openai_routes: bool = True,
        finished: Callable[[RequestContext, str, int], None] | None = None,
    ) -> None:
        self.backend = backend
        self.finished = finished
        self.body_idle_timeout = body_idle_timeout
        self.authenticate = authenticate
        self.max_body_bytes = max_body_bytes
        self.observe = observe
        self.gate = gate
        self.coalesce = coalesce
        self.routes: RouteTable[Handler] = RouteTable()
        builtins: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/generate"): self._generate,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
        } if openai_routes else {}  # fmt: skip
        for (method, path), handler in {**builtins, **(extra_routes or {})}.items():
            self.routes.add(method, path, handler)

    # ------------------------------------------------------------ ASGI entry

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        context = RequestContext(
            request_id=request_id_from(headers),
            tenant="anonymous" if self.authenticate is not None else "default",
            arrival=trio.current_time(),
        )
        apply_trace(context, headers)
        exchange = _Exchange()
        route = "other"
        try:
            # ``cancel``: the request's cancel scope, cancelled when the client
            # leaves before the response is complete, and once it is sent.
            async with AsyncExitStack() as defer:
                with trio.CancelScope() as cancel:
                    async with AsyncExitStack() as spawned:
                        tasks = _Tasks(spawned)
                        try:
                            found = self.routes.match(scope["method"], scope["path"])
                            route = found.template if found is not None else "other"
                            # On the headers, before any of the body is read: a client
                            # without a key holds nothing while it trickles a body in.
                            if self.authenticate is not None:
                                principal = self.authenticate(headers)
                                context.tenant, context.key_id = principal.tenant, principal.key_id
                            apply_request_headers(context, headers)
                            streams = found is not None and isinstance(found.handler, StreamingBody)
                            body = b"" if streams else await self._read_body(headers, receive)
                            context.read_at = trio.current_time()
                            if not streams:  # only now watch for disconnect: the body has been consumed
                                await _on_disconnect(scope, receive, cancel, tasks, exchange)
                            # No route: 404 or 405, told only to an authenticated client.
                            match = found or self.routes.resolve(scope["method"], scope["path"])
                            request = HTTPRequest(scope, body, context, tasks, headers=headers, params=match.params, defer=defer)
                            if streams:
                                request.reader = BodyReader(receive, self.body_idle_timeout)
                            response = await match.handler(request)
                        except HeadraceError as exc:
                            response = error_response(exc)
                        except Exception:
                            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                            response = json_response(error_body("internal error", "server_error", None, None), 500)
                        await _send_response(send, response, exchange, scope.get("extensions", {}).get(BODY_WRITER))
                        cancel.cancel()  # the tasks of the response, if any
        finally:
            # Once per request, however it ended: the status actually sent,
            # 499 when the body never completed (the client left).
            if self.observe is not None:
                status = exchange.status if exchange.complete else 499
                self.observe(route, status, context.tenant, trio.current_time() - context.arrival)
            if self.finished is not None:
                self.finished(context, route, exchange.status if exchange.complete else 499)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_body(self, headers: dict[str, str], receive: Any) -> bytes:
        """The whole body. It ends with the message that says so, or as soon
        as ``content-length`` bytes are in: hypercorn passes the body and its
        end in two messages, and a refusal decided on the body then waited a
        trip through the scheduler for the second (see :func:`_queued`)."""
        length = headers.get("content-length", "")
        declared = int(length) if length.isdigit() else None
        if declared is not None and declared > self.max_body_bytes:
            raise PayloadTooLarge(f"request body over {self.max_body_bytes} bytes")
        queued = _queued(receive)
        chunks, size = [], 0
        while True:
            message = queued()
            if message is None:
                with trio.move_on_after(self.body_idle_timeout):
                    message = await receive()
            if message is None:
                raise RequestTimeout(f"no request body bytes for {self.body_idle_timeout:g} s")
            if message["type"] == "http.disconnect":
                raise BadRequest("client went away before sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(f"request body over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False) or size == declared:
                return b"".join(chunks)

    # ------------------------------------------------------------ routes

    async def _models(self, request: HTTPRequest) -> Response:
        info = self.backend.info()
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": info.name, "max_model_len": info.max_context}
            for m in info.models
        ]
        return json_response({"object": "list", "data": data})

    async def _health(self, request: HTTPRequest) -> Response:
        health = await self.backend.health()
        return json_response({"status": "ok" if health.ok else "down", "detail": health.detail}, 200 if health.ok else 503)

    async def _completions(self, request: HTTPRequest) -> Response:
        return await self._openai(request, "completion")

    async def _chat(self, request: HTTPRequest) -> Response:
        return await self._openai(request, "chat")

    async def _generate(self, request: HTTPRequest) -> Response:
        return await self._openai(request, "native")

    async def _openai(self, request: HTTPRequest, kind: Kind) -> Response:
        call = prepare_call(kind, request.body, self.backend, request.context, coalesce=self.coalesce)
        # Once per client request, whatever its n: held until the last byte.
        await request.defer.enter_async_context(self.gate.admit(request.context, call))
        if call.wire.stream:
            # Pull the first event before answering 200, so errors that happen
            # before any token (overload, bad prompt) get a real status code.
            stream = await call.start_stream(await request.task_nursery() if len(call.subs) > 1 else None, request.defer)
            return Response(200, content_type="text/event-stream", headers=[("cache-control", "no-cache"), *call.headers], stream=stream)
        return json_response(await call.collect(), headers=call.headers)


class _Exchange:
    """How far the response got. Once the last message is handed to the
    server, a disconnect no longer cancels anything (hypercorn reports
    ``http.disconnect`` as soon as a response completes)."""

    def __init__(self) -> None:
        self.status = 0
        self.complete = False


# The key of an ``http.response.start`` message by which an app promises that
# a ``http.response.body`` follows at once: frontend/serving.py then holds the
# start for that body, and both leave in one write. ASGI servers that do not
# know it ignore it.
BODY_FOLLOWS = "headrace.body_follows"


# The key of a request scope's ``extensions`` under which frontend/serving.py
# offers a :data:`BodyWriter` (over HTTP/2): ``writer(data)`` frames and writes
# a body part of a response whose head has gone, without ending it, at once and
# without a checkpoint, and says whether it did; where it did not (no window, a
# busy connection, a closed stream), the part goes by ``send`` as before. A
# streamed answer's parts after its first are ~25 Python calls each by
# ``send`` (hypercorn's stream and protocol layers, ours around them) against
# ~10 here: a write a token, from a backend that paces its tokens.
# A middleware that wraps ``send`` to see or change the body must hide the
# writer from the app it wraps (:func:`without_body_writer`), or the parts the
# writer takes pass it by.
BODY_WRITER = "headrace.body_writer"
BodyWriter = Callable[[bytes], bool]
_Scope = TypeVar("_Scope", bound=MutableMapping[str, Any])


def without_body_writer(scope: _Scope) -> _Scope:
    """``scope`` for an app whose ``send`` is wrapped: every body part then
    goes by ``send`` (a copy without :data:`BODY_WRITER`; ``scope`` itself
    when it offers none)."""
    extensions = scope.get("extensions")
    if not extensions or BODY_WRITER not in extensions:
        return scope
    return cast(_Scope, {**scope, "extensions": {k: v for k, v in extensions.items() if k != BODY_WRITER}})


async def _send_response(send: Any, response: Response, exchange: _Exchange, writer: BodyWriter | None = None) -> None:
    """The start goes right before the first body, with :data:`BODY_FOLLOWS`
    (a stream's first chunk may be long in coming: its head waits with it),
    so that frontend/serving.py writes the head and that body together. A
    stream's later parts, but its last, go by ``writer`` when the server
    offers one (:data:`BODY_WRITER`) and it takes them."""
    exchange.status = response.status
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in response.headers]
    start = {"type": "http.response.start", "status": response.status, "headers": headers, BODY_FOLLOWS: True}
    if response.stream is None:
        headers.append((b"content-length", str(len(response.body)).encode()))
        await send(start)
        exchange.complete = True
        await send({"type": "http.response.body", "body": response.body})
        return

    started = ended = False

    async def emit(chunk: bytes, last: bool = False) -> None:
        nonlocal started, ended
        if ended:
            raise RuntimeError("the response body has already ended")
        if last:
            ended = exchange.complete = True
        if not started:
            started = True
            await send(start)
        elif not last and writer is not None and chunk and writer(chunk):
            return
        await send({"type": "http.response.body", "body": chunk, "more_body": not last})

    try:
        await response.stream(emit)
    except BaseException:
        if not started:  # the head goes out as before, then the server ends the stream
            started = True
            with trio.CancelScope(shield=True):
                await send(start)
        raise
    if not ended:
        exchange.complete = True
        if not started:
            await send(start)
        await send({"type": "http.response.body", "body": b""})


def _queued(receive: Any) -> Callable[[], dict[str, Any] | None]:
    """A message ``receive`` already holds, taken without waiting (None: none
    yet). hypercorn's trio worker passes a memory channel's ``receive``,
    which checkpoints even when a message is there: each message read was
    a trip to the back of the scheduler's queue, behind every other runnable
    task (under load, one batch of them each: milliseconds). The lean
    HTTP/2 ingress's streams say it themselves (``receive_ready``), so that
    a body already here is read without a cancel scope for its timeout.
    Any other ``receive`` always answers None, so the caller awaits it."""
    channel = getattr(receive, "__self__", None)
    ready: Callable[[], dict[str, Any] | None] | None = getattr(channel, "receive_ready", None)
    if ready is not None:
        return ready
    if not isinstance(channel, trio.MemoryReceiveChannel):
        return lambda: None

    def take() -> dict[str, Any] | None:
        try:
            message: dict[str, Any] = channel.receive_nowait()
        except trio.WouldBlock:
            return None
        return message

    return take


# The key of a request scope's ``extensions`` under which frontend/serving.py
# offers a :class:`DisconnectHook`: the server calls it when the request's
# stream closes (the client left, or the response ended). Under another ASGI
# server (no such key) a task per request reads ``receive`` for
# ``http.disconnect`` instead; the hook spares that task's spawn, its wake-ups
# and its cancellation on every request.
ON_DISCONNECT = "headrace.on_disconnect"


class DisconnectHook:
    """Called once by the server when the stream closes; :meth:`then`
    registers what to call (at once if the stream closed already)."""

    __slots__ = ("_callback", "closed")

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None
        self.closed = False

    def then(self, callback: Callable[[], None]) -> None:
        if self.closed:
            callback()
        else:
            self._callback = callback

    def __call__(self) -> None:
        self.closed = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


async def _on_disconnect(scope: dict[str, Any], receive: Any, cancel_scope: trio.CancelScope, tasks: _Tasks, exchange: _Exchange) -> None:
    """Cancel the request's scope if the client leaves before the last
    message of the response is handed to the server: through the server's
    hook, else a task that waits for ``http.disconnect``."""
    hook = scope.get("extensions", {}).get(ON_DISCONNECT)
    if hook is None:
        (await tasks.nursery()).start_soon(_watch_disconnect, receive, cancel_scope, exchange)
        return

    def disconnected() -> None:
        if not exchange.complete:
            cancel_scope.cancel()

    hook.then(disconnected)


async def _watch_disconnect(receive: Any, scope: trio.CancelScope, exchange: _Exchange) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.complete:
                scope.cancel()
            return

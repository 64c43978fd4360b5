"""Serve any :class:`~backends.base.Backend` as an OpenAI-compatible HTTP API.

One ASGI app used three times: by the mock server, by the engine server, and
by the router (whose "backend" is its dispatcher: admission, routing,
migration). Routes::

    POST /v1/completions        OpenAI completions, SSE or JSON
    POST /v1/chat/completions   OpenAI chat completions, SSE or JSON
    POST /v1/generate           native: text + token ids out, SSE or JSON
    GET  /v1/models
    GET  /health
    + extra routes given by the embedding server (metrics, admin, tokenize...)

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import msgspec
import trio

from backends.base import Backend, Event, GenerateRequest, Usage
from backends.errors import (
    BadRequest,
    HeadraceError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    StreamBroken,
    UpstreamError,
)
from backends.openai_wire import (
    Kind,
    WireRequest,
    chunk_choice,
    decode_request,
    error_body,
    logprobs_payload,
    new_id,
    now,
    to_generate_requests,
    usage_payload,
)

__all__ = [
    "Emit",
    "HTTPRequest",
    "Handler",
    "OpenAIServer",
    "Producer",
    "Response",
    "error_response",
    "json_response",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 * 1024 * 1024
_encoder = msgspec.json.Encoder()


class HTTPRequest:
    """What a route handler sees: method, path, query, headers, body."""

    def __init__(self, scope: dict[str, Any], body: bytes, tenant: str, nursery: trio.Nursery) -> None:
        self.scope = scope
        self.nursery = nursery  # lives as long as the response; cancelled on disconnect
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")
        self.headers: dict[str, str] = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
        }
        self.body = body
        self.tenant = tenant


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
# ``emit(chunk)``; ``emit(chunk, True)`` sends the body's last chunk (the
# stream ends with it, in the same write).
Emit = Callable[..., Awaitable[None]]
# A streaming body: called with ``emit`` once the headers are out.
Producer = Callable[[Emit], Awaitable[None]]
Authenticate = Callable[[dict[str, str]], str]


def json_response(obj: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Response:
    return Response(status, _encoder.encode(obj), headers=headers)


def error_response(exc: HeadraceError) -> Response:
    """The one place an error becomes an HTTP response."""
    headers = []
    if exc.retry_after is not None:
        headers.append(("retry-after", str(max(1, math.ceil(exc.retry_after)))))
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return json_response(body, exc.status, headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _error_event(exc: HeadraceError) -> bytes:
    """The in-band error that ends a stream (no ``[DONE]`` follows it)."""
    return _sse(error_body(exc.message, exc.type, exc.param, exc.code))


class OpenAIServer:
    """ASGI app serving ``backend`` with the OpenAI API.

    ``authenticate(headers) -> tenant`` runs first and may raise
    :class:`~backends.errors.Unauthorized`; ``extra_routes`` maps
    ``(method, path)`` to handlers (they take precedence over built-ins).
    ``observe(route, status, tenant, seconds)`` is called once per request.
    ``coalesce``: SSE events that are ready together leave in one write (one
    socket send and one HTTP/2 DATA frame instead of one per token); off,
    every event is its own write, which fault injectors that count tokens
    per write rely on.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        extra_routes: dict[tuple[str, str], Handler] | None = None,
        authenticate: Authenticate | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        observe: Callable[[str, int, str, float], None] | None = None,
        coalesce: bool = False,
    ) -> None:
        self.coalesce = coalesce
        self.backend = backend
        self.authenticate = authenticate
        self.max_body_bytes = max_body_bytes
        self.observe = observe
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/generate"): self._generate,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
        }
        self.routes.update(extra_routes or {})

    # ------------------------------------------------------------ ASGI entry

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        start = trio.current_time()
        tenant = "anonymous" if self.authenticate is not None else "default"
        exchange = _Exchange()
        try:
            async with trio.open_nursery() as nursery:
                try:
                    body = await self._read_body(scope, receive)
                    # Only now watch for disconnect: the body has been consumed.
                    nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, exchange)
                    tenant = self._tenant(scope)
                    handler = self._route(scope["method"], scope["path"])
                    response = await handler(HTTPRequest(scope, body, tenant, nursery))
                except HeadraceError as exc:
                    response = error_response(exc)
                except Exception:
                    log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                    response = json_response(error_body("internal error", "server_error", None, None), 500)
                await _send_response(send, response, exchange)
                nursery.cancel_scope.cancel()
        finally:
            # Once per request, however it ended: the status actually sent,
            # 499 when the body never completed (the client left).
            if self.observe is not None:
                route = scope["path"] if (scope["method"], scope["path"]) in self.routes else "other"
                status = exchange.status if exchange.complete else 499
                self.observe(route, status, tenant, trio.current_time() - start)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> bytes:
        for k, v in scope.get("headers", []):
            if k.lower() == b"content-length" and v.isdigit() and int(v) > self.max_body_bytes:
                raise PayloadTooLarge(f"request body over {self.max_body_bytes} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("client went away before sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(f"request body over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _tenant(self, scope: dict[str, Any]) -> str:
        if self.authenticate is None:
            return "default"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        return self.authenticate(headers)

    def _route(self, method: str, path: str) -> Handler:
        handler = self.routes.get((method, path))
        if handler is not None:
            return handler
        allowed = sorted(m for (m, p) in self.routes if p == path)
        if allowed:
            raise MethodNotAllowed(f"{method} not allowed on {path}; use {', '.join(allowed)}")
        raise NotFound(f"no route {path}")

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
        wire, extra = decode_request(request.body, kind)
        model = self._check_model(wire.model)
        rid = new_id(kind)
        subs = to_generate_requests(wire, extra, request_id=rid, tenant=request.tenant)
        call = _Call(kind, rid, model, wire, subs, self.backend, coalesce=self.coalesce)
        if wire.stream:
            # Pull the first event before answering 200, so errors that happen
            # before any token (overload, bad prompt) get a real status code.
            stream = await call.start_stream(request.nursery)
            return Response(200, content_type="text/event-stream", headers=[("cache-control", "no-cache")], stream=stream)
        return json_response(await call.collect())

    def _check_model(self, model: str | None) -> str:
        models = self.backend.info().models
        if model is None or model == "":
            return models[0] if models else "default"
        if models and model not in models:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        return model


class _Call:
    """One OpenAI call: n sub-generations merged into one response."""

    def __init__(
        self,
        kind: Kind,
        rid: str,
        model: str,
        wire: WireRequest,
        subs: list[GenerateRequest],
        backend: Backend,
        *,
        coalesce: bool = False,
    ) -> None:
        self.kind, self.rid, self.model, self.wire, self.subs = kind, rid, model, wire, subs
        self.backend = backend
        self.created = now()
        self.token_ids = wire.return_token_ids or kind == "native"
        self.coalesce = coalesce

    # -------- non-streaming

    async def collect(self) -> dict[str, Any]:
        results: list[_Choice] = [_Choice() for _ in self.subs]

        async def run(i: int) -> None:
            try:
                async for event in self.backend.stream(self.subs[i]):
                    results[i].add(event)
            except HeadraceError:
                raise
            except Exception as exc:
                log.exception("choice %d: the backend stream failed with an untranslated error", i)
                raise UpstreamError(f"backend stream failed: {type(exc).__name__}") from exc
            if results[i].finish_reason is None:
                raise StreamBroken("the backend stream ended before its final event")

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(self.subs)):
                    nursery.start_soon(run, i)
        except BaseExceptionGroup as group:
            # One failed choice fails the call: surface the first error of
            # ours unwrapped so it keeps its status code.
            raise _first_headrace_error(group) or group from None
        usage = _total_usage(results)
        if self.kind == "native":
            return results[0].native(self.rid, self.model, usage)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        choices = [r.openai(self.kind, i, self.token_ids) for i, r in enumerate(results)]
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage_payload(usage)}

    # -------- streaming

    async def start_stream(self, nursery: trio.Nursery) -> Producer:
        """Start one pump task per choice in the request's nursery, wait for
        each choice's first event (an error there raises, so it gets a real
        status code), and return the producer of the SSE body.

        Each backend stream is iterated start to end by one task (its pump):
        async generators must not migrate between tasks."""
        send, recv = trio.open_memory_channel[tuple[int, Event | HeadraceError]](64)
        async with send:
            for i, sub in enumerate(self.subs):
                nursery.start_soon(_pump, i, self.backend.stream(sub), send.clone())
        pending: list[tuple[int, Event]] = []
        started: set[int] = set()
        while len(started) < len(self.subs):
            try:
                i, item = await recv.receive()
            except trio.EndOfChannel:
                raise UpstreamError("the backend ended the stream without any event") from None
            if isinstance(item, HeadraceError):
                raise item
            started.add(i)
            pending.append((i, item))

        async def flush(emit: Emit, parts: list[bytes], last: bool = False) -> None:
            if self.coalesce:
                await emit(b"".join(parts), last)
            else:  # one SSE event per write, as fault injectors count them
                for part in parts:
                    await emit(part)
            parts.clear()

        async def produce(emit: Emit) -> None:
            states = [_Choice() for _ in self.subs]
            parts = [self._chunk(i, event, states[i]) for i, event in pending]
            while True:
                # Chunks that are ready leave in one write (coalesce); a
                # write goes out as soon as nothing more is ready.
                try:
                    i, item = recv.receive_nowait()
                except trio.WouldBlock:
                    if parts:
                        await flush(emit, parts)
                    try:
                        i, item = await recv.receive()
                    except trio.EndOfChannel:
                        break
                except trio.EndOfChannel:
                    break
                if isinstance(item, HeadraceError):
                    parts.append(_error_event(item))
                    await flush(emit, parts, True)
                    return
                parts.append(self._chunk(i, item, states[i]))
            if any(state.finish_reason is None for state in states):
                # Every pump ended, yet some choice never got its final event:
                # a truncated answer must not look like a complete one.
                parts.append(_error_event(StreamBroken("the backend stream ended before its final event")))
                await flush(emit, parts, True)
                return
            opts = self.wire.stream_options
            if self.kind != "native" and opts is not None and opts.include_usage:
                parts.append(_sse(self._envelope([], usage_payload(_total_usage(states)))))
            parts.append(_DONE)
            await flush(emit, parts, True)

        return produce

    def _chunk(self, i: int, event: Event, state: _Choice) -> bytes:
        first = state.events == 0
        offset = len(state.text)
        state.add(event)
        if self.kind == "native":
            payload: dict[str, Any] = {"id": self.rid, "text": event.text, "token_ids": event.token_ids}
            if event.prompt_token_ids is not None:
                payload["prompt_token_ids"] = event.prompt_token_ids
            if event.seed is not None:
                payload["seed"] = event.seed
            if event.logprobs:
                payload["logprobs"] = logprobs_payload("completion", event.logprobs, offset)
            if event.finish_reason is not None:
                payload["finish_reason"] = event.finish_reason
                payload["usage"] = usage_payload(state.usage)
            return _sse(payload)
        choice = chunk_choice(self.kind, i, event, token_ids=self.token_ids, first=first, text_offset=offset)
        return _sse(self._envelope([choice], None))

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out: dict[str, Any] = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


async def _pump(i: int, it: AsyncIterator[Event], send: trio.MemorySendChannel[tuple[int, Event | HeadraceError]]) -> None:
    """Relay one backend stream into the call's channel. Whatever ends the
    stream early is sent as an error, never as a plain end of channel: the
    producer answers ``[DONE]`` only after every choice's final event."""
    async with send:
        try:
            async for event in it:
                # Without a checkpoint while the channel has room: the events
                # of one upstream read reach the producer together.
                try:
                    send.send_nowait((i, event))
                except trio.WouldBlock:
                    await send.send((i, event))
        except HeadraceError as exc:
            await send.send((i, exc))
        except Exception as exc:
            log.exception("choice %d: the backend stream failed with an untranslated error", i)
            await send.send((i, UpstreamError(f"backend stream failed: {type(exc).__name__}")))
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()


def _first_headrace_error(group: BaseExceptionGroup[BaseException]) -> HeadraceError | None:
    for exc in group.exceptions:
        if isinstance(exc, HeadraceError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_headrace_error(exc)
            if found is not None:
                return found
    return None


class _Choice:
    """Accumulates one choice's events."""

    def __init__(self) -> None:
        self.events = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.prompt_token_ids: list[int] | None = None
        self.seed: int | None = None
        self.finish_reason: str | None = None
        self.usage = Usage()

    def add(self, event: Event) -> None:
        self.events += 1
        self.text += event.text
        self.token_ids += event.token_ids
        if event.logprobs:
            self.logprobs += event.logprobs
        if event.prompt_token_ids is not None:
            self.prompt_token_ids = event.prompt_token_ids
        if event.seed is not None:
            self.seed = event.seed
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        if event.usage is not None:
            self.usage = event.usage

    def openai(self, kind: Kind, index: int, token_ids: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice["logprobs"] = logprobs_payload(kind, self.logprobs) if self.logprobs else None
        choice["finish_reason"] = self.finish_reason
        if token_ids:
            choice["token_ids"] = self.token_ids
            choice["prompt_token_ids"] = self.prompt_token_ids
            choice["seed"] = self.seed
        return choice

    def native(self, rid: str, model: str, usage: Usage) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid,
            "model": model,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "usage": usage_payload(usage),
        }
        if self.logprobs:
            out["logprobs"] = logprobs_payload("completion", self.logprobs)
        return out


def _total_usage(choices: list[_Choice]) -> Usage:
    # The prompt is shared by the n choices of one prompt; count it once per
    # distinct prompt as OpenAI does (here: the max, since n shares one prompt).
    prompt = max((c.usage.prompt_tokens for c in choices), default=0)
    cached = max((c.usage.cached_tokens for c in choices), default=0)
    completion = sum(c.usage.completion_tokens for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


class _Exchange:
    """How far the response got. Once the last message is handed to the
    server, a disconnect no longer cancels anything (hypercorn reports
    ``http.disconnect`` as soon as a response completes)."""

    def __init__(self) -> None:
        self.status = 0
        self.complete = False


async def _send_response(send: Any, response: Response, exchange: _Exchange) -> None:
    exchange.status = response.status
    headers = [(b"content-type", response.content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in response.headers]
    if response.stream is None:
        headers.append((b"content-length", str(len(response.body)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        exchange.complete = True
        await send({"type": "http.response.body", "body": response.body})
        return
    await send({"type": "http.response.start", "status": response.status, "headers": headers})

    ended = False

    async def emit(chunk: bytes, last: bool = False) -> None:
        nonlocal ended
        if ended:
            raise RuntimeError("the response body has already ended")
        if last:
            ended = exchange.complete = True
        await send({"type": "http.response.body", "body": chunk, "more_body": not last})

    await response.stream(emit)
    if not ended:
        exchange.complete = True
        await send({"type": "http.response.body", "body": b""})


async def _watch_disconnect(receive: Any, scope: trio.CancelScope, exchange: _Exchange) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.complete:
                scope.cancel()
            return

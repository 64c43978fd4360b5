"""``Idempotency-Key`` on every POST, kept in the job store (24 h by default).

::

    POST with Idempotency-Key ── reserve(tenant, key, sha256(path, body))
        ├ new ───────────> the handler ──> 2xx JSON: stored, then answered
        │                               ├> 4xx/5xx: the key is released (a retry may do the work)
        │                               └> a stream: relayed; the key is then marked streamed
        ├ stored (same digest) ──> that response again, ``idempotent-replayed: true``
        ├ in flight (same) ──────> 409 idempotency_key_in_use
        └ other digest ──────────> 422 idempotency_key_reused

Keys are per tenant, and the digest covers the path, so one key sent to two
endpoints is a 422. A streamed answer is not stored (it may be long, and a
replay of stored SSE would pretend to be a live stream): a repeat of a
streamed request is a 409 ``idempotency_key_stream_consumed`` that says so,
so the work is never done twice; send ``"stream": false`` to have the answer
kept. A request that fails (an error, the client leaving) releases its key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

import msgspec
import trio

from backends.errors import BadRequest, ClientError
from frontend.server import Emit, Handler, HTTPRequest, Response
from frontend.wire import error_body
from router.store import IdemBusy, IdemMismatch, IdemReplay, JobStore

__all__ = ["Idempotency", "IdempotencyConflict", "IdempotencyMismatch"]

STREAMED = msgspec.json.encode(error_body(
    "the first request with this Idempotency-Key was streamed, and a stream is not replayed; use a new key",
    "invalid_request_error", "idempotency-key", "idempotency_key_stream_consumed",
))  # fmt: skip


class IdempotencyConflict(ClientError):
    """409: the first request with this ``Idempotency-Key`` is still in flight."""

    status = 409
    code = "idempotency_key_in_use"


class IdempotencyMismatch(ClientError):
    """422: this ``Idempotency-Key`` was used with a different body."""

    status = 422
    code = "idempotency_key_reused"


class Idempotency:
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def wrap(self, handler: Handler) -> Handler:
        """``handler`` with ``Idempotency-Key`` honoured (its digest: path and body)."""

        async def idempotent(request: HTTPRequest) -> Response:
            if "idempotency-key" not in request.headers:
                return await handler(request)
            digest = hashlib.sha256(request.path.encode() + b"\0" + request.body).hexdigest()
            return await self.run(request, digest, lambda: handler(request))

        return idempotent

    async def run(self, request: HTTPRequest, digest: str, work: Callable[[], Awaitable[Response]]) -> Response:
        """``work()`` once per key: a replay, a 409 or a 422 instead when the key was seen."""
        key = request.headers.get("idempotency-key")
        if key is None:
            return await work()
        if not 1 <= len(key) <= 255:
            raise BadRequest("Idempotency-Key must be 1 to 255 characters", param="idempotency-key")
        tenant = request.context.tenant
        found = await self.store.reserve(tenant, key, digest)
        if isinstance(found, IdemReplay):
            return Response(found.status, found.body, headers=[("idempotent-replayed", "true")])
        if isinstance(found, IdemBusy):
            raise IdempotencyConflict("a request with this Idempotency-Key is still in flight", param="idempotency-key")
        if isinstance(found, IdemMismatch):
            raise IdempotencyMismatch("this Idempotency-Key was used with a different request", param="idempotency-key")
        try:
            response = await work()
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.store.release_key(tenant, key)
            raise
        if response.stream is not None:
            response.stream = self._streamed(response.stream, tenant, key)
        elif 200 <= response.status < 300:
            await self.store.complete_key(tenant, key, response.status, response.body, None)
        else:
            await self.store.release_key(tenant, key)
        return response

    def _streamed(self, producer: Callable[[Emit], Awaitable[None]], tenant: str, key: str) -> Callable[[Emit], Awaitable[None]]:
        async def relay(emit: Emit) -> None:
            try:
                await producer(emit)
            finally:  # the backend did the work, whole or in part: never again for this key
                with trio.CancelScope(shield=True):
                    await self.store.complete_key(tenant, key, 409, STREAMED, None)

        return relay

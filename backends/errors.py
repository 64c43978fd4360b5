"""The project's exception tree.

Exceptions from trio, httpx, h2 and torch never escape ``backends/``: adapters
translate them here, and the HTTP layer maps ``status`` to a response in one
place (``frontend.server.error_response``)::

    HeadraceError                      status  type
    ├── ClientError                    4xx     invalid_request_error
    │   ├── BadRequest                 400
    │   │   └── ContextLengthExceeded  400     code=context_length_exceeded
    │   ├── Unauthorized               401     code=invalid_api_key
    │   ├── NotFound                   404     unknown path
    │   ├── ModelNotFound              404     code=model_not_found
    │   ├── MethodNotAllowed           405
    │   ├── RequestTimeout             408     code=request_timeout: the body stopped coming
    │   ├── PayloadTooLarge            413
    │   └── RateLimited                429     (+ retry_after)
    └── UpstreamError                  5xx     server_error / upstream_error
        ├── BackendUnavailable         503     (+ retry_after): refused, down, overloaded
        ├── UpstreamRateLimited        429     (+ retry_after): the backend said 429
        ├── BackendTimeout             504     no progress within the deadline
        │   └── BackendStalled         504     no event mid-stream for the stall timeout (migratable)
        ├── BackendProtocolError       502     malformed answer from a backend
        ├── StreamBroken               502     died mid-stream (migratable)
        └── MigrationFailed            502/503 a broken stream that could not be resumed (terminal)

Client errors are the caller's fault and are never retried; upstream errors
may be retried on another backend (before the first token) or migrated (after).
A backend's 429 is an upstream error, not the client's :class:`RateLimited`:
the router cools that backend down for its ``retry_after`` and moves the
request on (router/dispatch.py); only when no other route absorbs it does the
client see the 429, with the backend's Retry-After.
"""

from __future__ import annotations

__all__ = [
    "BackendProtocolError",
    "BackendStalled",
    "BackendTimeout",
    "BackendUnavailable",
    "BadRequest",
    "ClientError",
    "ContextLengthExceeded",
    "HeadraceError",
    "MethodNotAllowed",
    "MigrationFailed",
    "ModelNotFound",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "StreamBroken",
    "Unauthorized",
    "UpstreamError",
    "UpstreamRateLimited",
    "drop_tracebacks",
]


class HeadraceError(Exception):
    """Base of every error headrace raises on purpose."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after


class ClientError(HeadraceError):
    """The request is at fault (4xx); retrying it elsewhere will not help."""

    status = 400
    type = "invalid_request_error"


class BadRequest(ClientError):
    status = 400


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class ModelNotFound(ClientError):
    status = 404
    code = "model_not_found"


class RequestTimeout(ClientError):
    """The client stopped sending its request body (``body_idle_timeout``)."""

    status = 408
    code = "request_timeout"


class PayloadTooLarge(ClientError):
    status = 413
    code = "payload_too_large"


class RateLimited(ClientError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class UpstreamError(HeadraceError):
    """A backend failed (5xx); another backend may succeed."""

    status = 502
    type = "upstream_error"


class BackendUnavailable(UpstreamError):
    status = 503
    code = "backend_unavailable"


class UpstreamRateLimited(UpstreamError):
    """The backend answered 429: it is healthy, but wants no requests for
    ``retry_after`` seconds (None: it did not say)."""

    status = 429
    type = "rate_limit_error"
    code = "upstream_rate_limited"


class BackendTimeout(UpstreamError):
    status = 504
    code = "backend_timeout"


class BackendStalled(BackendTimeout):
    """The stream started, then nothing came for the stall timeout (a frozen
    backend): the router migrates it like a broken stream."""

    code = "backend_stalled"


class BackendProtocolError(UpstreamError):
    status = 502
    code = "backend_protocol_error"


class StreamBroken(UpstreamError):
    """The backend died after the stream started; the tokens so far are valid."""

    status = 502
    code = "stream_broken"


class MigrationFailed(UpstreamError):
    """A stream broke after its first token and could not be resumed (no
    backend left, the migration limit, a replay that diverged): the end of
    the answer, never retried. ``code`` says which; 503 when no backend was
    left to resume on (``retry_after`` then says when to come back)."""

    status = 502
    code = "migration_failed"

    def __init__(self, message: str, *, status: int | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        if status is not None:
            self.status = status


class Unauthorized(ClientError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ClientError):
    status = 404
    code = "not_found"


class MethodNotAllowed(ClientError):
    status = 405
    code = "method_not_allowed"


def drop_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of every exception it chains
    (``__cause__``, ``__context__``): call it once ``exc`` is handled and
    will not be raised again as it is, where it is kept (a broken stream's
    error for its migration, a retry's last error, an h2 stream's ``error``).

    A caught exception's traceback holds the frame that caught it, and each
    frame it passed through, with their locals: an exception kept in one of
    them (``failure = exc``, ``s.error``) is a reference cycle, and with it
    the request's whole state (its parser, response, stream record, ~80
    objects) waits for the cyclic collector. Those frames and objects are
    old by then, so they waited for a collection of the oldest generation:
    ``headrace bench chaos`` kills a backend under 200 streams, and each
    kill left 64 such cycles behind. The messages, types and codes stay;
    nothing logs these tracebacks (``log.exception`` paths never call
    this)."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)

"""What the frontend knows about one client request, created once per HTTP
request and passed explicitly (never through a ContextVar), and the gate a
request passes through once, after decoding and before it fans out into its
``n`` choices.

::

    HTTP request ──> RequestContext (id, tenant, key id, class, arrival, deadline, trace)
        decode body ──> Call (kind, model, choices)
        gate.admit(context, call) ── rate limits, admission, queueing (the router's pipeline)
            └─> fan out: one backend stream per choice ──> SSE / JSON

The gate is a context manager held for the whole call (a streamed answer
holds it until its last byte), so a concurrency limit counts requests in
flight, not requests started. Raising a :class:`~backends.errors.HeadraceError`
from it refuses the request with that error's status.
"""

from __future__ import annotations

import logging
import random
import re
import secrets
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import msgspec

from backends.errors import BadRequest

if TYPE_CHECKING:
    from frontend.call import Call

__all__ = [
    "ENGINE_PRIORITY",
    "OPEN_GATE",
    "THROUGH",
    "Gate",
    "HeldStage",
    "Hold",
    "Leave",
    "Principal",
    "PriorityClass",
    "RequestContext",
    "apply_request_headers",
    "apply_trace",
    "format_traceparent",
    "new_request_id",
    "new_span_id",
    "parse_traceparent",
    "request_id_from",
    "trace_logger",
]

# Priority classes, highest first; the admission issue gives them meaning.
PriorityClass = Literal["interactive", "default", "batch"]
# GenerateRequest.priority ("higher runs first") for each class: the engine's
# scheduler orders by it (a body's ``"priority": "batch"`` reaches it as -1).
ENGINE_PRIORITY: dict[str, int] = {"interactive": 1, "default": 0, "batch": -1}
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; a later
# version may append fields after a dash, which this version ignores.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


class Principal(msgspec.Struct, frozen=True):
    """Who is calling: the tenant, and an id for the API key (a digest prefix,
    never the key itself); ``key_id`` is None without authentication."""

    tenant: str = "default"
    key_id: str | None = None


class RequestContext(msgspec.Struct, kw_only=True):
    """One client request. ``arrival`` and ``deadline`` are on trio's clock."""

    request_id: str
    tenant: str = "default"
    key_id: str | None = None
    priority: PriorityClass = "default"
    arrival: float = 0.0
    deadline: float | None = None
    # W3C trace context (:func:`apply_trace`): the trace (32 hex digits, the
    # caller's or a new one), this server's span for the request (16 hex),
    # the caller's span when it sent a valid ``traceparent``, and whether the
    # trace is sampled (the caller's flag; the router may decide for a new one).
    trace_id: str | None = None
    span_id: str = ""
    parent_span_id: str | None = None
    sampled: bool = False
    read_at: float = 0.0  # when the body was read (trio's clock): the end of ingress
    record: Any = None  # the router's per-request record (router/logs.py), while it serves one

    @property
    def traceparent(self) -> str | None:
        """The ``traceparent`` a call made on this request's behalf sends
        (this server's span as its parent); None without a trace."""
        if self.trace_id is None:
            return None
        return format_traceparent(self.trace_id, self.span_id, self.sampled)


def new_request_id() -> str:
    """A fresh 96-bit random id, from a generator seeded once per process
    from the OS (uuid4 makes a system call per id). Not a secret: ids name
    requests, they authorise nothing; and unlike a counter they do not tell a
    client how many requests others made."""
    return f"{_RNG.getrandbits(96):024x}"


_RNG = random.Random(secrets.randbits(128))


def new_span_id() -> str:
    """A fresh non-zero 64-bit span id, 16 hex digits."""
    return f"{_RNG.getrandbits(64) or 1:016x}"


def new_trace_id() -> str:
    return f"{_RNG.getrandbits(128) or 1:032x}"


def parse_traceparent(value: str | None) -> tuple[str, str, bool] | None:
    """``(trace_id, parent_span_id, sampled)`` of a valid W3C ``traceparent``
    header, else None (a malformed one starts a new trace; it is never an
    error). Version ff, all-zero ids, upper-case hex, and a version-00 header
    with anything after its flags are invalid, as the spec says."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, parent, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or parent == _ZERO_SPAN:
        return None
    return trace_id, parent, bool(int(flags, 16) & 1)


def format_traceparent(trace_id: str, span_id: str, sampled: bool) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def apply_trace(context: RequestContext, headers: dict[str, str]) -> None:
    """The caller's trace from its ``traceparent`` (valid: continued, with
    its span as parent and its sampled flag), else a new trace; either way a
    new span id for this server's part of the request."""
    parsed = parse_traceparent(headers.get("traceparent"))
    if parsed is None:
        context.trace_id = new_trace_id()
    else:
        context.trace_id, context.parent_span_id, context.sampled = parsed
    context.span_id = new_span_id()


def request_id_from(headers: dict[str, str]) -> str:
    """The client's ``x-request-id`` when it is a sane token, else a new one."""
    given = headers.get("x-request-id", "")
    if _SAFE_ID.fullmatch(given):
        return given
    return new_request_id()


def apply_request_headers(context: RequestContext, headers: dict[str, str]) -> None:
    """``X-Priority`` (interactive | default | batch: the class asked for; the
    router caps it by the tenant's maximum) and ``X-Deadline-Ms`` (how long
    the client will wait, from arrival) into the context; a bad value is a
    400 naming the header."""
    priority = headers.get("x-priority")
    if priority is not None:
        chosen = priority.strip().lower()
        if chosen not in ("interactive", "default", "batch"):
            raise BadRequest("X-Priority must be interactive, default or batch", param="x-priority")
        context.priority = cast(PriorityClass, chosen)
    deadline = headers.get("x-deadline-ms")
    if deadline is not None:
        if not deadline.strip().isdigit() or int(deadline) <= 0:
            raise BadRequest("X-Deadline-Ms must be a positive integer (milliseconds)", param="x-deadline-ms")
        context.deadline = context.arrival + int(deadline) / 1000


def trace_logger(logger: logging.Logger, level: int = logging.INFO) -> Callable[[RequestContext, str, int], None]:
    """An ``OpenAIServer`` ``finished`` hook for the engine's and the mock's
    servers: one line per request (at ``level``) naming its trace and the
    caller's span (the router's attempt), so a backend's log joins the
    router's trace."""

    def finished(context: RequestContext, route: str, status: int) -> None:
        if logger.isEnabledFor(level):
            fields = {"request_id": context.request_id, "route": route, "status": status, "trace_id": context.trace_id,
                      "parent_span_id": context.parent_span_id, "span_id": context.span_id}  # fmt: skip
            logger.log(level, "request %s %s status=%d trace_id=%s parent_span_id=%s", context.request_id, route, status,
                       context.trace_id, context.parent_span_id, extra={"fields": fields})  # fmt: skip

    return finished


class Gate(Protocol):
    """Runs once per client request, around the whole call."""

    def admit(self, context: RequestContext, call: Call) -> AbstractAsyncContextManager[None]: ...


Leave = Callable[[], None]


class Hold:
    """A stage's hold on a call, as an async context manager without an
    async generator: ``enter`` (a coroutine, awaited on entry) does what
    comes before an ``@asynccontextmanager``'s ``yield`` and returns what
    its ``finally`` would do (None: nothing), called on the way out however
    the call ends. A stage subclasses :class:`HeldStage`, whose ``admit``
    returns one, and writes its entry::

        async def _admit(self, context, call) -> Leave | None:
            ...  # may raise to refuse, may await (a queue)
            return partial(self._release, ...)

    An ``@asynccontextmanager`` is an async generator a stage a request
    (trio tracks each in a weak set, contextlib drives it through
    ``asend``/``athrow``): five stages in an exit stack took 15-17 us
    against 9.4-9.8 as holds (a 2.1 GHz Xeon), and the router's own stages
    and upstream stream as classes 2.2% fewer instructions a request.
    Any async context manager still makes a stage (tests/router/
    test_pipeline.py runs each form through the pipeline)."""

    __slots__ = ("_enter", "_leave")

    def __init__(self, enter: Awaitable[Leave | None]) -> None:
        self._enter = enter
        self._leave: Leave | None = None

    async def __aenter__(self) -> None:
        self._leave = await self._enter

    async def __aexit__(self, *exc_info: object) -> None:
        leave, self._leave = self._leave, None
        if leave is not None:
            leave()


class HeldStage:
    """A stage written as a :class:`Hold`: its ``_admit`` coroutine (entry,
    then what leaving does), which each subclass defines, wrapped here as
    the stage's ``admit``."""

    __slots__ = ()
    _admit: Callable[[RequestContext, Call], Awaitable[Leave | None]]

    def admit(self, context: RequestContext, call: Call) -> AbstractAsyncContextManager[None]:
        return Hold(self._admit(context, call))


class _Through:
    """An async context manager that does nothing: stateless, so one serves
    every call."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


THROUGH: AbstractAsyncContextManager[None] = _Through()


class _OpenGate:
    """Lets everything through: the engine's and the mock's servers."""

    def admit(self, context: RequestContext, call: Call) -> AbstractAsyncContextManager[None]:
        return THROUGH


OPEN_GATE: Gate = _OpenGate()

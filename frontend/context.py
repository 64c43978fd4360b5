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

import random
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Literal, Protocol, cast

import msgspec

from backends.errors import BadRequest

if TYPE_CHECKING:
    from frontend.call import Call

__all__ = [
    "ENGINE_PRIORITY",
    "OPEN_GATE",
    "Gate",
    "Principal",
    "PriorityClass",
    "RequestContext",
    "apply_request_headers",
    "new_request_id",
    "request_id_from",
]

# Priority classes, highest first; the admission issue gives them meaning.
PriorityClass = Literal["interactive", "default", "batch"]
# GenerateRequest.priority ("higher runs first") for each class: the engine's
# scheduler orders by it (a body's ``"priority": "batch"`` reaches it as -1).
ENGINE_PRIORITY: dict[str, int] = {"interactive": 1, "default": 0, "batch": -1}
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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
    trace_id: str | None = None


def new_request_id() -> str:
    """A fresh 96-bit random id, from a generator seeded once per process
    from the OS (uuid4 makes a system call per id). Not a secret: ids name
    requests, they authorise nothing; and unlike a counter they do not tell a
    client how many requests others made."""
    return f"{_RNG.getrandbits(96):024x}"


_RNG = random.Random(secrets.randbits(128))


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


class Gate(Protocol):
    """Runs once per client request, around the whole call."""

    def admit(self, context: RequestContext, call: Call) -> AbstractAsyncContextManager[None]: ...


class _OpenGate:
    """Lets everything through: the engine's and the mock's servers."""

    @asynccontextmanager
    async def admit(self, context: RequestContext, call: Call) -> AsyncIterator[None]:
        yield


OPEN_GATE: Gate = _OpenGate()

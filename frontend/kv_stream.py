"""``GET /v1/kv_events``: a backend's KV block events as SSE, one shape for
the engine server and the mock (``id: SEQ`` + ``data: <KVEvent json>``;
``?since=SEQ`` or ``Last-Event-ID`` resumes, -1 = everything still kept)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from backends.base import KVEvent
from backends.errors import BadRequest
from frontend.server import HTTPRequest, Response

__all__ = ["kv_events_response", "resume_point"]


def resume_point(request: HTTPRequest) -> int:
    """``?since=SEQ`` or the SSE ``Last-Event-ID`` header; -1 = all kept."""
    params = dict(p.split("=", 1) for p in request.query.decode("latin-1").split("&") if "=" in p)
    raw = params.get("since", request.headers.get("last-event-id", "-1"))
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"since must be an integer, got {raw!r}", param="since") from None


def kv_events_response(request: HTTPRequest, subscribe: Callable[[int], AsyncIterator[KVEvent]]) -> Response:
    """Stream ``subscribe(since)`` as SSE until the client leaves."""
    events = subscribe(resume_point(request))
    encoder = msgspec.json.Encoder()

    async def produce(emit: Any) -> None:
        try:
            await emit(b": kv events\n\n")
            async for event in events:
                await emit(b"id: %d\ndata: %s\n\n" % (event.seq, encoder.encode(event)))
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return Response(200, content_type="text/event-stream", headers=[("cache-control", "no-cache")], stream=produce)

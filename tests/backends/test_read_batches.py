"""``Event.more_ready`` from the OpenAI-compatible adapter: a relay that
writes what it relays (frontend/call.py, one choice) waits for the next event
only when it is already here, so the events of one upstream read leave in one
write, and an event is never held across a wait."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import trio

from backends.base import Event, GenerateRequest
from backends.errors import HeadraceError
from backends.openai_http import OpenAIHTTPBackend
from tests.h1_server import serving_http1


def _sse_app(*writes: bytes) -> Callable[..., Awaitable[None]]:
    """An ASGI app that answers any POST with an SSE body sent in ``writes``."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for body in writes:
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await trio.sleep(0.05)  # each write its own read at the client
        await send({"type": "http.response.body", "body": b""})

    return app


def _chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return b"data: " + msgspec.json.encode({"id": "c", "object": "text_completion", "choices": [choice]}) + b"\n\n"


async def test_events_of_one_read_are_more_ready_but_the_last_unless_the_stream_ends_with_it() -> None:
    """``Event.more_ready`` tells a relay that the next step needs no wait:
    each event of one read but its last, and that last too when the read
    also ends the stream ([DONE])."""
    usage = b'data: {"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":4,"total_tokens":5}}\n\n'
    app = _sse_app(_chunk(" a") + _chunk(" b") + _chunk(" c"), _chunk(" d", "length") + usage + b"data: [DONE]\n\n")
    async with serving_http1(app) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http="1.1")
        try:
            events = [e async for e in client.stream(GenerateRequest(prompt="x", max_tokens=4))]
        finally:
            await client.aclose()
    assert [(e.text, e.more_ready) for e in events] == [(" a", True), (" b", True), (" c", False), (" d", True)]
    assert events[-1].finish_reason == "length"


async def test_the_last_event_before_an_error_in_the_same_read_is_not_more_ready() -> None:
    """What follows a broken stream may wait (a migration): the event before
    the break is not marked, so a relay writes it at once."""
    app = _sse_app(_chunk(" a") + _chunk(" b") + b"data: {not json\n\n")
    async with serving_http1(app) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http="1.1")
        events: list[Event] = []
        try:
            with pytest.raises(HeadraceError):
                async for e in client.stream(GenerateRequest(prompt="x", max_tokens=4)):
                    events.append(e)
        finally:
            await client.aclose()
    assert [(e.text, e.more_ready) for e in events] == [(" a", True), (" b", False)]

"""``Event.more_ready`` from the OpenAI-compatible adapter: a relay that
writes what it relays (frontend/call.py, one choice) waits for the next event
only when it is already here, so the events of one upstream read leave in one
write, and an event is never held across a wait. The stream's first event
leaves alone, before the rest of its read is parsed: a backend that answers
at once (a cached answer, a fast draft) sends many tokens in one read, and
the first token is the one a client waits on."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest
import trio

from backends.base import Event, GenerateRequest
from backends.errors import HeadraceError
from backends.openai_http import OpenAIHTTPBackend
from backends.openai_wire import ChunkParser
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.frontend.test_serving import _writes_to_clients_of
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
    also ends the stream ([DONE]); never the stream's first event."""
    usage = b'data: {"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":4,"total_tokens":5}}\n\n'
    app = _sse_app(_chunk(" a") + _chunk(" b") + _chunk(" c"), _chunk(" d", "length") + usage + b"data: [DONE]\n\n")
    async with serving_http1(app) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http="1.1")
        try:
            events = [e async for e in client.stream(GenerateRequest(prompt="x", max_tokens=4))]
        finally:
            await client.aclose()
    assert [(e.text, e.more_ready) for e in events] == [(" a", False), (" b", True), (" c", False), (" d", True)]
    assert events[-1].finish_reason == "length"


async def test_the_last_event_before_an_error_in_the_same_read_is_not_more_ready() -> None:
    """What follows a broken stream may wait (a migration): the event before
    the break is not marked, so a relay writes it at once."""
    app = _sse_app(_chunk(" z"), _chunk(" a") + _chunk(" b") + b"data: {not json\n\n")
    async with serving_http1(app) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http="1.1")
        events: list[Event] = []
        try:
            with pytest.raises(HeadraceError):
                async for e in client.stream(GenerateRequest(prompt="x", max_tokens=4)):
                    events.append(e)
        finally:
            await client.aclose()
    assert [(e.text, e.more_ready) for e in events] == [(" z", False), (" a", True), (" b", False)]


async def test_the_first_event_comes_before_the_rest_of_its_read_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole answer in one read: the first event is handed over after one
    chunk is parsed, not after all of them; the rest of the read follows as
    one batch (each more_ready but the last, which ends the stream)."""
    parsed: list[str] = []
    feed = ChunkParser.feed

    def counted(self: ChunkParser, data: str) -> list[Event]:
        parsed.append(data)
        return feed(self, data)

    monkeypatch.setattr(ChunkParser, "feed", counted)
    usage = b'data: {"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":4,"total_tokens":5}}\n\n'
    app = _sse_app(_chunk(" a") + _chunk(" b") + _chunk(" c") + _chunk(" d", "length") + usage + b"data: [DONE]\n\n")
    seen: list[tuple[str, bool, int]] = []
    async with serving_http1(app) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http="1.1")
        try:
            async for e in client.stream(GenerateRequest(prompt="x", max_tokens=4)):
                seen.append((e.text, e.more_ready, len(parsed)))
        finally:
            await client.aclose()
    assert seen == [(" a", False, 1), (" b", True, 6), (" c", True, 6), (" d", True, 6)]


async def test_a_relayed_answer_in_one_read_writes_its_first_chunk_alone(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the router's server over HTTP/2: a backend's whole answer in
    one read reaches the client in two socket writes, the response's head
    with the first token's chunk, then the rest with ``[DONE]``."""
    usage = b'data: {"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}\n\n'
    app = _sse_app(_chunk(" a") + _chunk(" b") + _chunk(" c", "length") + usage + b"data: [DONE]\n\n")
    async with serving_http1(app) as upstream:  # type: ignore[arg-type]
        backend = OpenAIHTTPBackend(upstream, http="1.1")
        try:
            url = await nursery.start(serve, OpenAIServer(backend, coalesce=True), ServeOptions())
            writes = _writes_to_clients_of(int(url.rsplit(":", 1)[1]), monkeypatch)
            async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        finally:
            await backend.aclose()
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    answer = [w for w in writes if b"data: " in w]
    texts = [[json.loads(data)["choices"][0]["text"] for data in re.findall(rb"data: (\{.*?\})\n\n", w)] for w in answer]
    assert texts == [[" a"], [" b", " c"]], answer
    assert answer[0][3] == 1  # a HEADERS frame opens the first: the head left with the first chunk
    assert answer[1].endswith(b"data: [DONE]\n\n")

"""The path of a small answer (a refusal, an error, a JSON reply) through
the frontend: the body is complete once its content-length is in, and the
whole response leaves in one write with its HEADERS."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
import trio
import trio.testing
from hyperframe.frame import DataFrame, Frame, HeadersFrame

from frontend import hardening
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.frontend.test_server import CountingBackend
from tests.frontend.test_serving import health_app

BODY = b'{"model": "m1", "prompt": "hi", "max_tokens": 2}'


async def _asgi(app: OpenAIServer, messages: list[dict[str, Any]], headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """One POST /v1/completions through the ASGI app; ``messages`` are all
    the request messages the client ever sends (the channel stays open)."""
    to_app, from_client = trio.open_memory_channel[dict[str, Any]](10)
    for message in messages:
        to_app.send_nowait(message)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "http_version": "2"}
    with trio.move_on_after(60):
        await app(scope, from_client.receive, send)
    return sent


async def test_a_body_complete_by_its_content_length_is_served_without_its_end_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """hypercorn hands an HTTP/2 body and its end in two messages; once
    content-length bytes are in, the request is served without waiting for
    the second (before: the server waited for it, and answered 408 when it
    did not come within the body idle timeout)."""
    app = OpenAIServer(CountingBackend(), body_idle_timeout=5)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    sent = await _asgi(app, [{"type": "http.request", "body": BODY, "more_body": True}], headers)
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == 200, sent


async def test_without_a_content_length_the_body_ends_with_its_end_message(autojump_clock: trio.testing.MockClock) -> None:
    app = OpenAIServer(CountingBackend(), body_idle_timeout=5)
    half = len(BODY) // 2
    messages = [{"type": "http.request", "body": BODY[:half], "more_body": True},
                {"type": "http.request", "body": BODY[half:], "more_body": True},
                {"type": "http.request", "body": b"", "more_body": False}]  # fmt: skip
    sent = await _asgi(app, messages, [(b"content-type", b"application/json")])
    assert sent[0]["status"] == 200, sent
    # and one that never ends is still a 408
    sent = await _asgi(app, messages[:2], [(b"content-type", b"application/json")])
    assert sent[0]["status"] == 408, sent


# ---------------------------------------------------------------- one write


def _frames(data: bytes) -> list[Frame]:
    frames, rest = [], memoryview(data)
    while len(rest) >= 9:
        frame, length = Frame.parse_frame_header(rest[:9])
        frame.parse_body(rest[9 : 9 + length])
        frames.append(frame)
        rest = rest[9 + length :]
    return frames


async def _request(port: int, path: str) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "x")], end_stream=True)
    await stream.send_all(conn.data_to_send())
    status, body, ended = 0, b"", False
    with trio.fail_after(10):
        while not ended:
            for event in conn.receive_data(await stream.receive_some(1 << 20)):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            await stream.send_all(conn.data_to_send())
    await stream.aclose()
    return status, body


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await health_app(scope, receive, send)
        return
    body = b"x" * 200_000 if scope["path"] == "/big" else b'{"error": {"code": "shed"}}'
    if scope["path"] == "/parts":
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await send({"type": "http.response.body", "body": body[5:]})
        return
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"%d" % len(body)),
                                                                          (b"retry-after", b"2")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def writes(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[bytes]]:
    """A server of :func:`_app`, and every write its sockets made."""
    seen: list[bytes] = []
    send_all = trio.SocketStream.send_all
    write_now = getattr(hardening, "_write_now", None)

    async def recorded_send_all(self: trio.SocketStream, data: bytes | bytearray | memoryview) -> None:
        seen.append(bytes(data))
        await send_all(self, data)

    def recorded_write_now(stream: Any, data: bytes) -> int:
        assert write_now is not None
        n: int = write_now(stream, data)
        if n:
            seen.append(data[:n])
        return n

    monkeypatch.setattr(trio.SocketStream, "send_all", recorded_send_all)
    if write_now is not None:
        monkeypatch.setattr(hardening, "_write_now", recorded_write_now)
    url = await nursery.start(serve, _app, ServeOptions(graceful_timeout=0.1))
    return int(url.rsplit(":", 1)[1]), seen


async def test_a_whole_small_response_leaves_with_its_headers_in_one_write(writes: tuple[int, list[bytes]]) -> None:
    """HEADERS, then DATA with END_STREAM, in the same socket write (before:
    the HEADERS were flushed as soon as the app started the response, the
    DATA by the connection's send task on its next turn: two writes)."""
    port, seen = writes
    assert await _request(port, "/small") == (503, b'{"error": {"code": "shed"}}')
    ours = [[f for f in _frames(w) if f.stream_id == 1] for w in seen]
    carrying = [frames for frames in ours if frames]
    assert len(carrying) == 1, carrying
    kinds = [type(f) for f in carrying[0]]
    assert kinds == [HeadersFrame, DataFrame]
    assert "END_STREAM" in carrying[0][1].flags


@pytest.mark.parametrize("path", ["/big", "/parts"])
async def test_a_response_too_big_for_one_frame_or_sent_in_parts_still_arrives_whole(
    writes: tuple[int, list[bytes]], path: str
) -> None:
    port, _ = writes
    status, body = await _request(port, path)
    assert status == 503
    assert body == (b"x" * 200_000 if path == "/big" else b'{"error": {"code": "shed"}}')

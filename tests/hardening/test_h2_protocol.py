"""Protocol cases in the spirit of h2spec (RFC 9113): frame sizes, stream
states, flow control, SETTINGS, PING, GOAWAY, header blocks, each answered
with the right frame and error code by frontend.serving (hypercorn + h2 +
frontend/hardening.py) on a real loopback socket.

Frames are written raw (hyperframe), so that what no well-behaved client
library would send can be sent; the server's frames are parsed raw too. An
error the RFC calls a stream error may be answered as a connection error
(RFC 9113 5.4.1 allows it); where the server does that, the case says so.
What matters for hardening: every malformed input gets a definite answer
(GOAWAY or RST_STREAM with the code the RFC names), never a hang, never a
crash, and a stream error leaves the connection serving."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import h2.errors
import hpack
import pytest
import trio
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from frontend.serving import Limits, ServeOptions, serve
from tests.hardening.test_h2_abuse import App

pytestmark = pytest.mark.timeout(60)
E = h2.errors.ErrorCodes
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def raw(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    """A frame header and payload exactly as given (lengths may lie, types may be anything)."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, sid) + payload


def headers_block(path: str = "/", *, extra: list[tuple[str, str]] | None = None, pseudo: list[tuple[str, str]] | None = None,
                  encoder: hpack.Encoder | None = None) -> bytes:  # fmt: skip
    fields = pseudo if pseudo is not None else [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "x")]
    return (encoder or hpack.Encoder()).encode(fields + (extra or []))


def request(sid: int, path: str = "/", *, end_stream: bool = True, encoder: hpack.Encoder | None = None, **kw: Any) -> bytes:
    frame = HeadersFrame(sid, data=headers_block(path, encoder=encoder, **kw))
    frame.flags.add("END_HEADERS")
    if end_stream:
        frame.flags.add("END_STREAM")
    return frame.serialize()


@dataclass
class Answer:
    frames: list[Frame]
    closed: bool

    def goaway(self) -> int | None:
        codes = [f.error_code for f in self.frames if isinstance(f, GoAwayFrame)]
        return codes[0] if codes else None

    def resets(self) -> list[tuple[int, int]]:
        return [(f.stream_id, f.error_code) for f in self.frames if isinstance(f, RstStreamFrame)]

    def responded(self, sid: int) -> bool:
        """The server sent response HEADERS on ``sid``."""
        return any(isinstance(f, HeadersFrame) and f.stream_id == sid for f in self.frames)

    def pings(self) -> list[bytes]:
        return [f.opaque_data for f in self.frames if isinstance(f, PingFrame) and "ACK" in f.flags]


async def exchange(port: int, *chunks: bytes, settings: bytes | None = None, wait: float = 1.0) -> Answer:
    """Preface + SETTINGS (empty unless given) + an ACK of the server's, then
    ``chunks`` (written in order, with a pause between, so that a frame the
    server must answer first is answered first); the server's frames until
    it closes or ``wait`` s pass quietly."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    ack = SettingsFrame(0)
    ack.flags.add("ACK")
    await sock.send_all(PREFACE + (settings if settings is not None else SettingsFrame(0).serialize()) + ack.serialize())
    frames: list[Frame] = []
    closed = False
    buffer = b""

    async def read() -> None:
        nonlocal buffer, closed
        while True:
            try:
                data = await sock.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                closed = True
                return
            buffer += data
            while len(buffer) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
                if len(buffer) < 9 + length:
                    break
                frame.parse_body(memoryview(buffer[9:9 + length]))
                frames.append(frame)
                buffer = buffer[9 + length:]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for chunk in chunks:
            try:
                await sock.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                break
            await trio.sleep(0.05)
        with trio.move_on_after(wait):
            seen = -1
            while not closed and seen != len(frames):  # until closed, or quiet for a tenth of wait
                seen = len(frames)
                await trio.sleep(wait / 10)
        nursery.cancel_scope.cancel()
    await sock.aclose()
    return Answer(frames, closed)


@pytest.fixture
async def port(nursery: trio.Nursery) -> int:
    url = await nursery.start(serve, App(), ServeOptions(graceful_timeout=0.1, limits=Limits()))
    return int(url.rsplit(":", 1)[1])


def settings(*pairs: tuple[int, int]) -> bytes:
    return raw(0x4, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


def ping(data: bytes = b"12345678", *, ack: bool = False, sid: int = 0) -> bytes:
    return raw(0x6, 0x1 if ack else 0, sid, data)


# (name, chunks, expected): expected is ("goaway", code), ("reset", sid, code),
# ("served", sid) or ("ping", data).
CONNECTION_ERRORS: list[tuple[str, list[bytes], int]] = [
    # 6.5 SETTINGS
    ("SETTINGS ACK with a payload", [raw(0x4, 0x1, 0, b"\0" * 6)], E.FRAME_SIZE_ERROR),
    ("SETTINGS length not a multiple of 6", [raw(0x4, 0, 0, b"\0" * 5)], E.FRAME_SIZE_ERROR),
    ("SETTINGS on a stream", [raw(0x4, 0, 1, b"")], E.PROTOCOL_ERROR),
    ("SETTINGS_ENABLE_PUSH = 2", [settings((0x2, 2))], E.PROTOCOL_ERROR),
    ("SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1", [settings((0x4, 2**31))], E.FLOW_CONTROL_ERROR),
    ("SETTINGS_MAX_FRAME_SIZE under 16384", [settings((0x5, 16383))], E.PROTOCOL_ERROR),
    ("SETTINGS_MAX_FRAME_SIZE over 2^24-1", [settings((0x5, 2**24))], E.PROTOCOL_ERROR),
    # 6.7 PING
    ("PING on a stream", [ping(sid=1)], E.PROTOCOL_ERROR),
    ("PING of 7 bytes", [ping(b"1234567")], E.FRAME_SIZE_ERROR),
    # 6.8 GOAWAY
    ("GOAWAY on a stream", [raw(0x7, 0, 1, b"\0" * 8)], E.PROTOCOL_ERROR),
    # 6.9 WINDOW_UPDATE
    ("WINDOW_UPDATE of 0 on the connection", [raw(0x8, 0, 0, b"\0" * 4)], E.PROTOCOL_ERROR),
    ("WINDOW_UPDATE of 3 bytes", [raw(0x8, 0, 0, b"\0\0\1")], E.FRAME_SIZE_ERROR),
    ("connection window past 2^31-1", [WindowUpdateFrame(0, window_increment=2**31 - 1).serialize()], E.FLOW_CONTROL_ERROR),
    # 6.1 DATA, 5.1 stream states
    ("DATA on stream 0", [raw(0x0, 0x1, 0, b"x")], E.PROTOCOL_ERROR),
    ("DATA on an idle stream", [DataFrame(1, data=b"x").serialize()], E.PROTOCOL_ERROR),
    ("DATA whose pad length is past its end", [request(1, end_stream=False), raw(0x0, 0x8, 1, b"\x10x")], E.PROTOCOL_ERROR),
    # 6.2 HEADERS, 5.1.1 stream identifiers
    ("HEADERS on stream 0", [raw(0x1, 0x5, 0, headers_block())], E.PROTOCOL_ERROR),
    ("HEADERS on an even (server) stream", [request(2)], E.PROTOCOL_ERROR),
    ("a stream id lower than one already used", [request(5), request(3)], E.PROTOCOL_ERROR),
    ("HEADERS over SETTINGS_MAX_FRAME_SIZE", [raw(0x1, 0x5, 1, b"\0" * 16385)], E.FRAME_SIZE_ERROR),
    ("HEADERS whose pad length is past its end", [raw(0x1, 0x5 | 0x8, 1, b"\xff" + headers_block())], E.PROTOCOL_ERROR),
    # 6.10 CONTINUATION
    ("CONTINUATION without HEADERS", [ContinuationFrame(1, data=headers_block(), flags=["END_HEADERS"]).serialize()], E.PROTOCOL_ERROR),
    ("CONTINUATION for another stream mid-block",
     [HeadersFrame(1, data=headers_block()).serialize() + ContinuationFrame(3, data=b"", flags=["END_HEADERS"]).serialize()],
     E.PROTOCOL_ERROR),
    ("a PING between HEADERS and its CONTINUATION",
     [HeadersFrame(1, data=headers_block()).serialize() + ping()], E.PROTOCOL_ERROR),
    # 6.4 RST_STREAM
    ("RST_STREAM on stream 0", [raw(0x3, 0, 0, b"\0" * 4)], E.PROTOCOL_ERROR),
    ("RST_STREAM on an idle stream", [RstStreamFrame(1).serialize()], E.PROTOCOL_ERROR),
    ("RST_STREAM of 3 bytes", [request(1, "/slow"), raw(0x3, 0, 1, b"\0\0\0")], E.FRAME_SIZE_ERROR),
    # 6.3 PRIORITY, 8.4 server push
    ("PRIORITY on stream 0", [raw(0x2, 0, 0, b"\0" * 5)], E.PROTOCOL_ERROR),
    ("PUSH_PROMISE from a client", [request(1, "/slow", end_stream=False),
                                    PushPromiseFrame(1, promised_stream_id=2, data=headers_block(), flags=["END_HEADERS"]).serialize()],
     E.PROTOCOL_ERROR),
    # 4.3 header compression
    ("a header block that is not valid HPACK", [raw(0x1, 0x5, 1, b"\xff\xff\xff\xff\xff")], E.COMPRESSION_ERROR),
]


@pytest.mark.parametrize(("chunks", "code"), [c[1:] for c in CONNECTION_ERRORS], ids=[c[0] for c in CONNECTION_ERRORS])
async def test_a_connection_error_gets_goaway_with_its_code_and_the_connection_closed(port: int, chunks: list[bytes], code: int) -> None:
    answer = await exchange(port, *chunks)
    assert answer.goaway() == code, answer.frames
    assert answer.closed


# Stream errors this server answers on the stream alone: RST_STREAM, and the
# connection serves the next stream.
STREAM_ERRORS: list[tuple[str, list[bytes], int, int]] = [
    # 8.3 request pseudo-header fields, 8.2 header fields: on the stream only (frontend/hardening.py)
    ("no :method", [request(1, pseudo=[(":path", "/"), (":scheme", "http"), (":authority", "x")])], 1, E.PROTOCOL_ERROR),
    ("an unknown pseudo-header", [request(1, extra=[(":bogus", "x")])], 1, E.PROTOCOL_ERROR),
    ("a pseudo-header after a regular one",
     [request(1, pseudo=[(":method", "GET"), ("x-a", "1"), (":path", "/"), (":scheme", "http"), (":authority", "x")])], 1, E.PROTOCOL_ERROR),
    ("te other than trailers", [request(1, extra=[("te", "gzip")])], 1, E.PROTOCOL_ERROR),
    ("an uppercase header name", [request(1, extra=[("X-Upper", "1")])], 1, E.PROTOCOL_ERROR),
    # 6.9.1 flow control on one stream
    ("a stream window past 2^31-1", [request(1, "/slow"), WindowUpdateFrame(1, window_increment=2**31 - 1).serialize()], 1, E.FLOW_CONTROL_ERROR),
    # 5.1 half-closed (remote): the client already ended the stream
    ("DATA after END_STREAM", [request(1, "/slow"), DataFrame(1, data=b"x").serialize()], 1, E.STREAM_CLOSED),
    # 5.1.2 stream concurrency (frontend/hardening.py; h2 made it GOAWAY)
    ("a stream over MAX_CONCURRENT_STREAMS", [b"".join(request(1 + 2 * i) for i in range(101))], 201, E.REFUSED_STREAM),
]

# Stream errors (RFC 9113) that h2 answers as connection errors, which 5.4.1
# allows: RST_STREAM or GOAWAY, with the RFC's code either way.
STREAM_OR_CONNECTION_ERRORS: list[tuple[str, list[bytes], int]] = [
    ("PRIORITY of 4 bytes", [raw(0x2, 0, 1, b"\0" * 4)], E.FRAME_SIZE_ERROR),
    ("WINDOW_UPDATE of 0 on a stream", [request(1, "/slow"), raw(0x8, 0, 1, b"\0" * 4)], E.PROTOCOL_ERROR),
    ("a stream that depends on itself", [PriorityFrame(1, depends_on=1, stream_weight=16).serialize()], E.PROTOCOL_ERROR),
    ("HEADERS again on a closed stream", [request(1), request(1)], E.STREAM_CLOSED),
]


@pytest.mark.parametrize(("chunks", "sid", "code"), [c[1:] for c in STREAM_ERRORS], ids=[c[0] for c in STREAM_ERRORS])
async def test_a_stream_error_resets_that_stream_and_the_connection_serves_on(port: int, chunks: list[bytes], sid: int, code: int) -> None:
    answer = await exchange(port, *chunks, request(1001))
    assert (sid, code) in answer.resets(), answer.frames
    assert answer.goaway() is None and answer.responded(1001), answer.frames  # the next stream is served


@pytest.mark.parametrize(("chunks", "code"), [c[1:] for c in STREAM_OR_CONNECTION_ERRORS], ids=[c[0] for c in STREAM_OR_CONNECTION_ERRORS])
async def test_a_stream_error_gets_rst_stream_or_goaway_with_its_code(port: int, chunks: list[bytes], code: int) -> None:
    answer = await exchange(port, *chunks)
    assert code in [c for _, c in answer.resets()] or answer.goaway() == code, answer.frames


async def test_ping_is_acked_with_its_payload_and_a_ping_ack_is_not(port: int) -> None:
    answer = await exchange(port, ping(b"acked-me", ack=True), ping(b"answered"))
    assert answer.pings() == [b"answered"]
    assert answer.goaway() is None and not answer.closed


async def test_settings_are_acked_and_unknown_settings_and_frame_types_ignored(port: int) -> None:
    answer = await exchange(port, settings((0x99, 7)), raw(0xEE, 0, 0, b"?"), ping())
    acks = [f for f in answer.frames if isinstance(f, SettingsFrame) and "ACK" in f.flags]
    assert len(acks) == 2  # the preface's SETTINGS and the one with an unknown identifier
    assert answer.pings() == [b"12345678"] and answer.goaway() is None


async def test_te_trailers_is_allowed_and_served(port: int) -> None:
    answer = await exchange(port, request(1, extra=[("te", "trailers")]))
    assert answer.responded(1) and not answer.resets()

"""The client side of HTTP/2 (RFC 9113), sans-I/O, for the router's upstream
connections (backends/h2client.py does the I/O around it).

Why not h2: its general state machines (one per stream and one for the
connection, an event object per frame, inbound header validation, a frame
object per frame in and out) cost about 11% of the router's CPU per streamed
request, for a client that only ever sends a request and reads its answer.
This module does that subset: frames are parsed from their 9-byte headers
with slicing, and what a request/response client must track is tracked in a
few ints per stream. What it does not need, it refuses or ignores as the RFC
lets a client: server push is disabled in our SETTINGS (a PUSH_PROMISE is a
connection error), PRIORITY is ignored, unknown frame types are skipped.

What it keeps of the RFC:

- **HPACK**: every header block is decoded (:class:`backends.h2lite.LeanDecoder`:
  hpack's Decoder's results and refusals, tested against it, at a fraction
  of its cost), including blocks for streams already closed, so the dynamic
  table stays in step;
  our blocks are encoded without the dynamic table (:mod:`backends.h2lite`).
- **Flow control** both ways: the server's windows bound what we send (its
  INITIAL_WINDOW_SIZE changes adjust open streams; a window over 2^31-1 is a
  FLOW_CONTROL_ERROR); ours bound what it sends (overrunning one is a
  FLOW_CONTROL_ERROR). Crediting is the caller's choice
  (:meth:`ClientConnection.window_update`): h2client credits the connection
  as bytes arrive and a stream as its consumer takes them.
- **Frame rules**: sizes over our SETTINGS_MAX_FRAME_SIZE, CONTINUATION out
  of place, frames on stream 0 that need a stream (and the reverse), streams
  the server cannot have (even, or never opened), bad lengths of fixed-size
  frames, padding longer than its frame: connection errors
  (:class:`ProtocolError`, with the RFC's error code).
- **GOAWAY** is an event, not the end: the streams up to its last stream id
  go on (h2 4.x closed the connection on it).
- SETTINGS and PING are acknowledged as they arrive.

Events (msgspec Structs, untracked by the GC): :class:`Response`, :class:`Data`,
:class:`Ended`, :class:`Reset`, :class:`WindowOpened`, :class:`SettingsChanged`,
:class:`GoAway`. Frames for a stream already closed (reset by us, or ended)
are absorbed: their DATA comes back as a :class:`Data` on stream 0, so the
caller credits the connection window for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from hpack.exceptions import HPACKError

from backends.h2lite import LeanDecoder, StatelessEncoder

__all__ = [
    "PREFACE",
    "ClientConnection",
    "Data",
    "Ended",
    "ErrorCode",
    "GoAway",
    "ProtocolError",
    "Reset",
    "Response",
    "SettingsChanged",
    "WindowOpened",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = range(1, 7)

DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
MAX_WINDOW = 2**31 - 1
UNLIMITED_STREAMS = 2**31 - 1


class ErrorCode:
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9


class ProtocolError(Exception):
    """The server broke HTTP/2: a connection error with ``code``."""

    def __init__(self, message: str, code: int = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- events


class Response(msgspec.Struct, gc=False):
    """A stream's final response headers (informational 1xx are skipped)."""

    stream_id: int
    headers: list[tuple[bytes, bytes]]


class Data(msgspec.Struct, gc=False):
    """DATA for a stream (``stream_id`` 0: for a stream already closed, to
    be credited to the connection only); ``flow``: its flow-controlled
    length (padding included)."""

    stream_id: int
    data: bytes
    flow: int


class Ended(msgspec.Struct, gc=False):
    """The server ended the stream (END_STREAM)."""

    stream_id: int


class Reset(msgspec.Struct, gc=False):
    """The server reset the stream (RST_STREAM)."""

    stream_id: int
    error_code: int


class WindowOpened(msgspec.Struct, gc=False):
    """The server gave send window: to ``stream_id``, or (0) to the connection or every stream."""

    stream_id: int


class SettingsChanged(msgspec.Struct, gc=False):
    """The server's SETTINGS arrived (``max_streams``: its concurrency limit)."""

    max_streams: int


class GoAway(msgspec.Struct, gc=False):
    """The server will process no stream above ``last_stream_id``."""

    last_stream_id: int
    error_code: int


Event = Response | Data | Ended | Reset | WindowOpened | SettingsChanged | GoAway


# ---------------------------------------------------------------- the connection


class _Stream:
    __slots__ = ("got_response", "local_ended", "recv_window", "remote_ended", "send_window")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window
        self.local_ended = False  # we sent END_STREAM
        self.remote_ended = False  # the server did
        self.got_response = False


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream_id.to_bytes(4, "big") + payload


class ClientConnection:
    """One HTTP/2 client connection's protocol state. Outbound calls queue
    bytes (:meth:`data_to_send`); :meth:`receive` parses the server's bytes
    into events (and queues the acknowledgements it owes)."""

    max_frame_size_in = DEFAULT_FRAME  # we never raise SETTINGS_MAX_FRAME_SIZE

    def __init__(
        self,
        *,
        stream_window: int = DEFAULT_WINDOW,
        connection_window: int = DEFAULT_WINDOW,
        max_concurrent_streams: int = 100,
        max_header_list_size: int = 65536,
    ) -> None:
        self._out: list[bytes] = []
        self._buf = b""
        self._streams: dict[int, _Stream] = {}
        self._next_id = 1
        self._encoder = StatelessEncoder()
        self._decoder = LeanDecoder()
        self._decoder.max_header_list_size = max_header_list_size
        self._header_block: list[bytes] = []  # a HEADERS frame's fragments until END_HEADERS
        self._header_stream = 0  # the stream whose block is incomplete (0: none)
        self._header_end = False  # that HEADERS frame carried END_STREAM
        self._header_bytes = 0
        self.stream_window = stream_window  # ours: what each stream may receive
        self.connection_window = connection_window
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_size = max_header_list_size
        self.recv_window = DEFAULT_WINDOW  # connection window as advertised to the server
        self.send_window = DEFAULT_WINDOW  # the server's connection window for us
        self.peer_initial_window = DEFAULT_WINDOW
        self.max_outbound_frame_size = DEFAULT_FRAME
        self.peer_max_streams = UNLIMITED_STREAMS
        self._settings_acked = False

    # ------------------------------------------------------------ state

    @property
    def highest_outbound_stream_id(self) -> int:
        return self._next_id - 2 if self._next_id > 1 else 0

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def send_window_of(self, stream_id: int) -> int:
        """What may be sent on ``stream_id`` now (0 when it is closed)."""
        s = self._streams.get(stream_id)
        return min(self.send_window, s.send_window) if s is not None and not s.local_ended else 0

    # ------------------------------------------------------------ outbound

    def initiate(self) -> None:
        """The preface and our SETTINGS (push off, our stream window and
        limits), and the connection window above the default."""
        values = ((ENABLE_PUSH, 0), (MAX_CONCURRENT_STREAMS, self.max_concurrent_streams),
                  (INITIAL_WINDOW_SIZE, self.stream_window), (MAX_HEADER_LIST_SIZE, self.max_header_list_size))  # fmt: skip
        payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values)
        self._out += (PREFACE, _frame(SETTINGS, 0, 0, payload))
        if self.connection_window > DEFAULT_WINDOW:
            self.window_update(self.connection_window - DEFAULT_WINDOW)

    def send_headers(self, headers: Iterable[Any], *, end_stream: bool) -> int:
        """Open the next stream with ``headers``; its id."""
        sid = self._next_id
        if sid > MAX_WINDOW:
            raise ProtocolError("no stream id left on this connection", ErrorCode.NO_ERROR)
        self._next_id += 2
        s = self._streams[sid] = _Stream(self.peer_initial_window, self.stream_window)
        s.local_ended = end_stream
        block = self._encoder.encode(headers)
        size = self.max_outbound_frame_size
        flags = END_STREAM if end_stream else 0
        if len(block) <= size:
            self._out.append(_frame(HEADERS, flags | END_HEADERS, sid, block))
        else:
            parts = [block[i : i + size] for i in range(0, len(block), size)]
            self._out.append(_frame(HEADERS, flags, sid, parts[0]))
            for k, part in enumerate(parts[1:], start=2):
                self._out.append(_frame(CONTINUATION, END_HEADERS if k == len(parts) else 0, sid, part))
        return sid

    def send_data(self, stream_id: int, data: bytes, *, end_stream: bool) -> None:
        """DATA within the windows (the caller asks :meth:`send_window_of`
        first) and the server's frame size."""
        s = self._streams.get(stream_id)
        if s is None or s.local_ended:
            raise ProtocolError(f"stream {stream_id} is closed for sending", ErrorCode.STREAM_CLOSED)
        n = len(data)
        if n > min(self.send_window, s.send_window, self.max_outbound_frame_size):
            raise ValueError(f"{n} bytes over the window or frame size")
        self.send_window -= n
        s.send_window -= n
        self._out.append(_frame(DATA, END_STREAM if end_stream else 0, stream_id, data))
        if end_stream:
            s.local_ended = True
            if s.remote_ended:
                del self._streams[stream_id]  # closed both ways

    def window_update(self, increment: int, stream_id: int = 0) -> bool:
        """Give the server ``increment`` bytes of window on the connection (0)
        or a stream; False when that stream is closed or ``increment`` is
        not positive (nothing queued: a WINDOW_UPDATE of 0 is an error)."""
        if increment <= 0:
            return False
        if stream_id:
            s = self._streams.get(stream_id)
            if s is None:
                return False
            s.recv_window += increment
        else:
            self.recv_window += increment
        self._out.append(_frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big")))
        return True

    def reset_stream(self, stream_id: int, error_code: int = ErrorCode.CANCEL) -> bool:
        """RST_STREAM, and forget the stream; False when it was closed already."""
        if self._streams.pop(stream_id, None) is None:
            return False
        self._out.append(_frame(RST_STREAM, 0, stream_id, error_code.to_bytes(4, "big")))
        return True

    def ping(self, opaque: bytes = b"\0" * 8) -> None:
        self._out.append(_frame(PING, 0, 0, opaque[:8].ljust(8, b"\0")))

    def close(self, error_code: int = ErrorCode.NO_ERROR) -> None:
        """GOAWAY: we open no more streams (we accept none anyway)."""
        self._out.append(_frame(GOAWAY, 0, 0, (0).to_bytes(4, "big") + error_code.to_bytes(4, "big")))

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data

    # ------------------------------------------------------------ inbound

    def receive(self, data: bytes) -> list[Event]:
        """The events in ``data`` (with what an earlier call left incomplete)."""
        buf = self._buf + data if self._buf else data
        events: list[Event] = []
        pos, n = 0, len(buf)
        limit = self.max_frame_size_in
        while n - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if length > limit:
                raise ProtocolError(f"a frame of {length} bytes (over {limit})", ErrorCode.FRAME_SIZE_ERROR)
            end = pos + 9 + length
            if end > n:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & MAX_WINDOW
            payload = buf[pos + 9 : end]
            pos = end
            if self._header_stream and kind != CONTINUATION:
                raise ProtocolError("a header block interrupted by another frame")
            if kind == DATA:
                self._data(sid, flags, payload, events)
            elif kind == HEADERS:
                self._headers(sid, flags, payload, events)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload, events)
            elif kind == SETTINGS:
                self._settings(sid, flags, payload, events)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload, events)
            elif kind == RST_STREAM:
                if not sid or len(payload) != 4:
                    raise ProtocolError("a malformed RST_STREAM", ErrorCode.FRAME_SIZE_ERROR if sid else ErrorCode.PROTOCOL_ERROR)
                self._check_opened(sid)
                if self._streams.pop(sid, None) is not None:
                    events.append(Reset(sid, int.from_bytes(payload, "big")))
            elif kind == PING:
                if sid or len(payload) != 8:
                    raise ProtocolError("a malformed PING", ErrorCode.PROTOCOL_ERROR if sid else ErrorCode.FRAME_SIZE_ERROR)
                if not flags & ACK:
                    self._out.append(_frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                if sid or length < 8:
                    raise ProtocolError("a malformed GOAWAY", ErrorCode.PROTOCOL_ERROR if sid else ErrorCode.FRAME_SIZE_ERROR)
                last = int.from_bytes(payload[:4], "big") & MAX_WINDOW
                events.append(GoAway(last, int.from_bytes(payload[4:8], "big")))
            elif kind == PRIORITY:
                if not sid or length != 5:
                    raise ProtocolError("a malformed PRIORITY", ErrorCode.FRAME_SIZE_ERROR if sid else ErrorCode.PROTOCOL_ERROR)
            elif kind == PUSH_PROMISE:
                raise ProtocolError("PUSH_PROMISE, though our SETTINGS disable push")
            # any other type: ignored (RFC 9113 5.5)
        self._buf = buf[pos:] if pos < n else b""
        return events

    def _check_opened(self, sid: int) -> None:
        """A frame for a stream the server cannot know of: a connection error."""
        if not sid & 1 or sid >= self._next_id:
            raise ProtocolError(f"a frame for stream {sid}, which we never opened")

    def _data(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if not sid:
            raise ProtocolError("DATA on stream 0")
        self._check_opened(sid)
        flow = len(payload)
        if flow > self.recv_window:
            raise ProtocolError(f"DATA of {flow} bytes over the connection window ({self.recv_window})", ErrorCode.FLOW_CONTROL_ERROR)
        self.recv_window -= flow
        data = _unpad(payload, flags) if flags & PADDED else payload
        s = self._streams.get(sid)
        if s is None:  # closed (we reset it, or it ended): the connection's window is still owed
            events.append(Data(0, b"", flow))
            return
        if not s.got_response or s.remote_ended:  # a stream error
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR if not s.got_response else ErrorCode.STREAM_CLOSED, events)
            events.append(Data(0, b"", flow))
            return
        allowed = s.recv_window if self._settings_acked else max(s.recv_window, s.recv_window + DEFAULT_WINDOW - self.stream_window)
        if flow > allowed:
            raise ProtocolError(f"DATA of {flow} bytes over stream {sid}'s window ({s.recv_window})", ErrorCode.FLOW_CONTROL_ERROR)
        s.recv_window -= flow
        events.append(Data(sid, data, flow))
        if flags & END_STREAM:
            self._remote_end(sid, s, events)

    def _remote_end(self, sid: int, s: _Stream, events: list[Event]) -> None:
        events.append(Ended(sid))
        s.remote_ended = True
        if s.local_ended:
            del self._streams[sid]  # closed both ways; else when our body ends, or we reset it

    def _stream_error(self, sid: int, code: int, events: list[Event]) -> None:
        """RST_STREAM(code) for a stream the server wronged, told as a Reset."""
        self.reset_stream(sid, code)
        events.append(Reset(sid, code))

    def _headers(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if not sid:
            raise ProtocolError("HEADERS on stream 0")
        self._check_opened(sid)
        block = _unpad(payload, flags) if flags & PADDED else payload
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ProtocolError("HEADERS too short for its priority fields", ErrorCode.FRAME_SIZE_ERROR)
            block = block[5:]
        self._header_end = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block_done(sid, block, events)
        else:
            self._header_stream, self._header_block, self._header_bytes = sid, [block], len(block)

    def _continuation(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if not self._header_stream or sid != self._header_stream:
            raise ProtocolError("CONTINUATION without a header block to continue")
        self._header_block.append(payload)
        self._header_bytes += len(payload)
        if self._header_bytes > 2 * self.max_header_list_size:  # CONTINUATION without end: memory, not headers
            raise ProtocolError(f"a header block of over {self._header_bytes} bytes", ErrorCode.COMPRESSION_ERROR)
        if flags & END_HEADERS:
            block = b"".join(self._header_block)
            self._header_stream, self._header_block = 0, []
            self._header_block_done(sid, block, events)

    def _header_block_done(self, sid: int, block: bytes, events: list[Event]) -> None:
        try:  # always decoded: the table must follow, whatever the stream's state
            headers: list[tuple[bytes, bytes]] = list(self._decoder.decode(block, raw=True))  # raw: bytes pairs
        except HPACKError as exc:
            raise ProtocolError(f"a header block we cannot decode: {exc!r}", ErrorCode.COMPRESSION_ERROR) from None
        s = self._streams.get(sid)
        if s is None:
            return  # a stream already closed (we reset it): nothing to tell
        ended = self._header_end
        if s.remote_ended:
            self._stream_error(sid, ErrorCode.STREAM_CLOSED, events)
            return
        if not s.got_response:
            status = headers[0][1] if headers and headers[0][0] == b":status" else None
            if status is not None and len(status) == 3 and status[:1] == b"1" and status != b"101":
                if ended:
                    raise ProtocolError(f"an informational response ending stream {sid}")
                return  # 1xx: the final response is still to come
            s.got_response = True
            events.append(Response(sid, headers))
        elif not ended:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)  # trailers without END_STREAM
            return
        if ended:
            self._remote_end(sid, s, events)

    def _settings(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if sid:
            raise ProtocolError("SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError("a SETTINGS ack with a payload", ErrorCode.FRAME_SIZE_ERROR)
            self._settings_acked = True
            return
        if len(payload) % 6:
            raise ProtocolError("a SETTINGS frame not a multiple of 6 bytes", ErrorCode.FRAME_SIZE_ERROR)
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(f"SETTINGS_INITIAL_WINDOW_SIZE {value}", ErrorCode.FLOW_CONTROL_ERROR)
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for s in self._streams.values():
                    s.send_window += delta
                    if s.send_window > MAX_WINDOW:
                        raise ProtocolError("a stream window over 2^31-1", ErrorCode.FLOW_CONTROL_ERROR)
                if delta > 0:
                    events.append(WindowOpened(0))
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError(f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.max_outbound_frame_size = value
            elif key == MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = min(value, UNLIMITED_STREAMS)
            elif key == ENABLE_PUSH:
                if value > 1:
                    raise ProtocolError(f"SETTINGS_ENABLE_PUSH {value}")
            elif key == HEADER_TABLE_SIZE:
                self._encoder.header_table_size = value
            # MAX_HEADER_LIST_SIZE (advisory) and unknown settings: ignored
        self._out.append(_frame(SETTINGS, ACK, 0))
        events.append(SettingsChanged(self.peer_max_streams))

    def _window_update(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ProtocolError("a WINDOW_UPDATE not of 4 bytes", ErrorCode.FRAME_SIZE_ERROR)
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if not sid:
            if not increment:
                raise ProtocolError("a connection WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ProtocolError("a connection window over 2^31-1", ErrorCode.FLOW_CONTROL_ERROR)
            events.append(WindowOpened(0))
            return
        self._check_opened(sid)
        s = self._streams.get(sid)
        if s is None:
            return  # a closed stream: nothing to send on it
        if not increment:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            return
        s.send_window += increment
        if s.send_window > MAX_WINDOW:
            self._stream_error(sid, ErrorCode.FLOW_CONTROL_ERROR, events)
            return
        events.append(WindowOpened(sid))


def _unpad(payload: bytes, flags: int) -> bytes:
    if not payload:
        raise ProtocolError("a PADDED frame without its pad length", ErrorCode.FRAME_SIZE_ERROR)
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError("padding as long as its frame")
    return payload[1 : len(payload) - pad]

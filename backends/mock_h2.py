"""The server side of cleartext HTTP/2, sans-I/O, as much as ``headrace
mock``'s lean server (``backends.mock_http``) needs: bytes in, events out;
calls in, bytes to send, in the style of h2's own ``H2Connection``.

The h2 library cost ~150 us a request there (events, a state machine per
stream, frame objects, logging calls), half the mock's CPU budget of 0.3 ms.
This reads every frame type (DATA and HEADERS with padding and priority,
CONTINUATION, SETTINGS, PING, RST_STREAM, WINDOW_UPDATE, GOAWAY), keeps flow
control both ways (the peer's windows for what we send, credit back for what
the app consumed), decodes header blocks with our own RFC 7541 decoder
(backends/h2lite.py's, which the router's ingress uses too), and encodes responses as literals without indexing, so it
keeps no encoder state. Protocol errors end the connection with GOAWAY::

    receive(bytes) -> [(REQUEST, sid, headers, ended), (DATA, sid, data, length, ended),
                       (END, sid), (RESET, sid), (WINDOW, 0), (CLOSED, 0)]
    window(sid) / send_headers / send_data / reset / credit / goaway -> data_to_send()
"""

from __future__ import annotations

import struct
from typing import Any

import hpack
from hpack.table import HeaderTable

from backends.h2lite import HPACKDecoder

__all__ = [
    "CLOSED", "DATA", "END", "INTERNAL_ERROR", "PREFACE", "REQUEST", "RESET", "WINDOW",
    "H2Core", "HPACKDecoder", "StreamGone", "encode_headers",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_STREAMS = 1000
_DATA, _HEADERS, _PRIORITY, _RST, _SETTINGS, _PUSH, _PING, _GOAWAY, _WINDOW, _CONT = range(10)
_END_STREAM = _ACK = 0x1
_END_HEADERS, _PADDED, _PRIO = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 5, 6, 7, 9
_FRAME_HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_MAX_WINDOW = 2**31 - 1
RECV_FRAME = 16384  # the largest frame we accept (the default; we do not raise it)
STREAM_WINDOW = 1 << 20  # what each stream may send us before we credit it
CONN_WINDOW = 1 << 24
_STATIC: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
_STATUS_INDEX = {b"200": 8, b"204": 9, b"206": 10, b"304": 11, b"400": 12, b"404": 13, b"500": 14}

# events of H2Core.receive: (kind, stream id, ...)
REQUEST, DATA, END, RESET, WINDOW, CLOSED = range(6)


class _GoAway(Exception):
    """A connection error: answered with GOAWAY(code) and the end of the connection."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class StreamGone(Exception):
    """The stream was reset (or never existed): nothing more may be sent on it."""


class _Stream:
    __slots__ = ("local_done", "remote_done", "window")

    def __init__(self, window: int, remote_done: bool) -> None:
        self.window, self.remote_done, self.local_done = window, remote_done, False


def _hpack_int(out: bytearray, n: int) -> None:
    """An HPACK integer with a 7-bit prefix (a string length, no Huffman)."""
    if n < 127:
        out.append(n)
        return
    out.append(127)
    n -= 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block of literals without indexing (``:status`` from the static table)."""
    out = bytearray()
    for name, value in headers:
        if name == b":status":
            index = _STATUS_INDEX.get(value)
            if index is not None:
                out.append(0x80 | index)
                continue
            out.append(0x08)  # literal without indexing, name: static entry 8
        else:
            out.append(0)
            _hpack_int(out, len(name))
            out += name
        _hpack_int(out, len(value))
        out += value
    return bytes(out)


class H2Core:
    """The server side of one cleartext HTTP/2 connection, without I/O."""

    def __init__(self, *, max_streams: int = MAX_STREAMS) -> None:
        self.max_streams = max_streams
        self.out = bytearray()
        self.buf = bytearray()
        self.preface = False
        self.decoder = HPACKDecoder()
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.peer_window = 65535  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.conn_window = 65535  # what we may still send on the connection
        self.unacked = 0  # bytes consumed on the connection and not yet credited
        self.block: bytearray | None = None  # a header block awaiting CONTINUATION
        self.block_sid, self.block_end = 0, False
        self.closed = False
        settings = struct.pack(">HIHIHI", 3, max_streams, 4, STREAM_WINDOW, 6, 65536)
        self._frame(_SETTINGS, 0, 0, settings)
        self._frame(_WINDOW, 0, 0, struct.pack(">I", CONN_WINDOW - 65535))

    def data_to_send(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes = b"") -> None:
        self.out += _FRAME_HEAD.pack(len(payload) << 8 | ftype, flags, sid)
        self.out += payload

    # -------- receiving

    def receive(self, data: bytes) -> list[tuple[Any, ...]]:
        events: list[tuple[Any, ...]] = []
        if self.closed:
            return events
        self.buf += data
        try:
            self._frames(events)
        except _GoAway as exc:
            self.goaway(exc.code)
            events.append((CLOSED, 0))
        return events

    def _frames(self, events: list[tuple[Any, ...]]) -> None:
        buf = self.buf
        if not self.preface:
            if len(buf) < len(PREFACE):
                return
            if buf[: len(PREFACE)] != PREFACE:
                raise _GoAway(PROTOCOL_ERROR)
            del buf[: len(PREFACE)]
            self.preface = True
        pos, window = 0, False
        while len(buf) - pos >= 9:
            head, flags, sid = _FRAME_HEAD.unpack_from(buf, pos)
            length, ftype, sid = head >> 8, head & 0xFF, sid & 0x7FFFFFFF
            if length > RECV_FRAME:
                raise _GoAway(FRAME_SIZE_ERROR)
            if len(buf) - pos - 9 < length:
                break
            payload = bytes(buf[pos + 9 : pos + 9 + length])
            pos += 9 + length
            if self.block is not None and (ftype != _CONT or sid != self.block_sid):
                raise _GoAway(PROTOCOL_ERROR)  # a header block must not be interrupted
            if ftype == _DATA:
                self._data(flags, sid, payload, events)
            elif ftype in (_HEADERS, _CONT):
                self._headers(ftype, flags, sid, payload, events)
            elif ftype in (_WINDOW, _SETTINGS):
                window |= self._control(ftype, flags, sid, payload)
            elif ftype == _RST:
                if sid == 0:
                    raise _GoAway(PROTOCOL_ERROR)
                if self.streams.pop(sid, None) is not None:
                    events.append((RESET, sid))
            elif ftype == _PING:
                if len(payload) != 8:
                    raise _GoAway(FRAME_SIZE_ERROR)
                if not flags & _ACK:
                    self._frame(_PING, _ACK, 0, payload)
            elif ftype == _PUSH:
                raise _GoAway(PROTOCOL_ERROR)
            # PRIORITY, GOAWAY (the client stops opening streams; it closes later)
            # and unknown frames need nothing
        del buf[:pos]
        if window:
            events.append((WINDOW, 0))

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & _PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise _GoAway(PROTOCOL_ERROR)
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, sid: int, payload: bytes, events: list[tuple[Any, ...]]) -> None:
        if sid == 0:
            raise _GoAway(PROTOCOL_ERROR)
        data = self._unpad(flags, payload)
        stream = self.streams.get(sid)
        if stream is None or stream.remote_done:
            if sid > self.last_sid:
                raise _GoAway(PROTOCOL_ERROR)  # DATA on a stream never opened
            self.credit(0, len(payload))  # a stream we stopped reading: credit it now
            return
        end = bool(flags & _END_STREAM)
        stream.remote_done = end
        events.append((DATA, sid, data, len(payload), end))
        if end and stream.local_done:
            del self.streams[sid]

    def _headers(self, ftype: int, flags: int, sid: int, payload: bytes,
                 events: list[tuple[Any, ...]]) -> None:
        if ftype == _HEADERS:
            if sid == 0 or sid % 2 == 0:
                raise _GoAway(PROTOCOL_ERROR)
            payload = self._unpad(flags, payload)
            if flags & _PRIO:
                payload = payload[5:]
            self.block, self.block_sid = bytearray(payload), sid
            self.block_end = bool(flags & _END_STREAM)
        else:
            assert self.block is not None
            self.block += payload
        if not flags & _END_HEADERS:
            if len(self.block) > 65536 + 16384:
                raise _GoAway(PROTOCOL_ERROR)
            return
        block, end, self.block = bytes(self.block), self.block_end, None
        try:
            headers = self.decoder.decode(block)
        except hpack.HPACKError:
            raise _GoAway(COMPRESSION_ERROR) from None
        self._opened(sid, headers, end, events)

    def _opened(self, sid: int, headers: list[tuple[bytes, bytes]], end: bool,
                events: list[tuple[Any, ...]]) -> None:
        stream = self.streams.get(sid)
        if stream is not None:  # trailers
            if not end or stream.remote_done:
                raise _GoAway(PROTOCOL_ERROR)
            stream.remote_done = True
            events.append((END, sid))
            if stream.local_done:
                del self.streams[sid]
            return
        if sid <= self.last_sid:
            raise _GoAway(STREAM_CLOSED)
        self.last_sid = sid
        if len(self.streams) >= self.max_streams:
            self._frame(_RST, 0, sid, struct.pack(">I", REFUSED_STREAM))
            return
        self.streams[sid] = _Stream(self.peer_window, end)
        events.append((REQUEST, sid, headers, end))

    def _control(self, ftype: int, flags: int, sid: int, payload: bytes) -> bool:
        """WINDOW_UPDATE and SETTINGS; True when send windows may have grown."""
        if ftype == _WINDOW:
            if len(payload) != 4:
                raise _GoAway(FRAME_SIZE_ERROR)
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.conn_window += increment
                if self.conn_window > _MAX_WINDOW:
                    raise _GoAway(FLOW_CONTROL_ERROR)
            elif (stream := self.streams.get(sid)) is not None:
                stream.window += increment
            return True
        if flags & _ACK:
            return False
        if sid != 0 or len(payload) % 6:
            raise _GoAway(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR)
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 4:  # INITIAL_WINDOW_SIZE: applies to the open streams too
                if value > _MAX_WINDOW:
                    raise _GoAway(FLOW_CONTROL_ERROR)
                for stream in self.streams.values():
                    stream.window += value - self.peer_window
                self.peer_window = value
            elif key == 5:  # MAX_FRAME_SIZE
                if not 16384 <= value <= 2**24 - 1:
                    raise _GoAway(PROTOCOL_ERROR)
                self.max_frame = value
        self._frame(_SETTINGS, _ACK, 0)
        return True

    # -------- sending

    def window(self, sid: int) -> int:
        """How much DATA may go out on ``sid`` now; raises StreamGone."""
        stream = self.streams.get(sid)
        if stream is None or stream.local_done:
            raise StreamGone(sid)
        return min(self.conn_window, stream.window)

    def send_headers(self, sid: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        self.window(sid)
        block = encode_headers(headers)
        first, block = block[: self.max_frame], block[self.max_frame :]
        flags = (_END_STREAM if end else 0) | (0 if block else _END_HEADERS)
        self._frame(_HEADERS, flags, sid, first)
        while block:
            piece, block = block[: self.max_frame], block[self.max_frame :]
            self._frame(_CONT, 0 if block else _END_HEADERS, sid, piece)
        if end:
            self._ended(sid)

    def send_data(self, sid: int, data: bytes, end: bool) -> None:
        """``data`` must fit :meth:`window`; split into frames of the peer's size."""
        stream = self.streams[sid]
        stream.window -= len(data)
        self.conn_window -= len(data)
        step = self.max_frame
        for offset in range(0, len(data), step):
            last = end and offset + step >= len(data)
            self._frame(_DATA, _END_STREAM if last else 0, sid, data[offset : offset + step])
        if end and not data:
            self._frame(_DATA, _END_STREAM, sid)
        if end:
            self._ended(sid)

    def _ended(self, sid: int) -> None:
        stream = self.streams[sid]
        stream.local_done = True
        if not stream.remote_done:  # answered before the request ended: stop its body
            self._frame(_RST, 0, sid, struct.pack(">I", NO_ERROR))
        del self.streams[sid]

    def reset(self, sid: int, code: int) -> None:
        if self.streams.pop(sid, None) is not None:
            self._frame(_RST, 0, sid, struct.pack(">I", code))

    def credit(self, sid: int, n: int) -> None:
        """``n`` flow-controlled bytes of ``sid`` were consumed: let the peer send more."""
        self.unacked += n
        if self.unacked >= CONN_WINDOW // 2:
            self._frame(_WINDOW, 0, 0, struct.pack(">I", self.unacked))
            self.unacked = 0
        stream = self.streams.get(sid)
        if n and stream is not None and not stream.remote_done:
            self._frame(_WINDOW, 0, sid, struct.pack(">I", n))

    def goaway(self, code: int = NO_ERROR) -> None:
        if not self.closed:
            self.closed = True
            self._frame(_GOAWAY, 0, 0, struct.pack(">II", self.last_sid, code))

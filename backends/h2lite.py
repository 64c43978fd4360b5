"""h2's connection with two per-frame costs taken out, for the router's
HTTP/2 ingress (frontend/hardening.py's GuardedH2Connection); the header
encoder serves the upstream client too (backends/h2wire.py).

- **Header blocks are encoded without HPACK's dynamic table and without
  Huffman coding** (:class:`StatelessEncoder`). hpack's encoder, in pure
  Python, searched the dynamic table and Huffman-coded every value bit by
  bit: 3-4% of the router's CPU per streamed request went to the upstream
  request's headers and the client's response headers, most of it for
  values seen once (a request id, a traceparent, a date). Here a field is
  an index into the static table when it is there whole, else a literal
  "without indexing" (its name indexed when the static table has it), and
  a field's bytes are cached. The first block of a connection starts with
  a dynamic table size update to 0, so that a peer which lowers
  SETTINGS_HEADER_TABLE_SIZE later is already answered (RFC 7541 4.2; a
  decoder such as nghttp2's expects one after lowering it). The cost:
  larger header blocks (about 200 bytes for a request instead of 60 once
  the table is warm), nothing against a streamed answer's body.
- **Header blocks are decoded by our own RFC 7541 decoder**
  (:class:`HPACKDecoder`, behind hpack's ``Decoder`` interface as
  :class:`LeanDecoder`). hpack's ``Decoder.decode`` slices a memoryview,
  builds a ``HeaderTuple`` and formats a debug line per field: ~2.6% of the
  router's CPU per streamed request over h2c went to decoding the client's
  request headers. The checks stay hpack's: the header list size limit
  (counted as it grows, so an indexed field repeated cannot inflate a small
  block), a table size update only at a block's start and within the
  size we allowed, truncated strings and integers.
- **A DATA frame is framed in place** (:meth:`LeanH2Connection.send_data`).
  h2's ``send_data`` passes two state machines (an Enum-keyed lookup
  each), builds a ``DataFrame`` with its ``Flags``, serializes it through
  three methods and formats four debug lines: ~25 Python calls for 9 bytes
  of header, on every write of a streamed answer (a token each, from a
  backend that paces them). Where h2 would send the frame unpadded and
  unchanged (the connection and the stream open for sending, the data
  within both windows and a frame), the header is packed here and the
  windows and the stream's state are kept as h2 keeps them; anything else
  is h2's own ``send_data``, errors included.
- **A received frame is not formatted for a log line nobody reads.** h2's
  ``_receive_frame`` builds ``repr(frame)`` for a trace message before
  calling the logger (about 1% of the CPU per request, two frames a
  request at least). :meth:`LeanH2Connection._receive_frame` is h2 4.x's
  without that line; tests/backends/test_h2lite.py checks h2's still reads
  as this one was copied from.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable
from typing import Any

import h2.connection
import hpack
from h2.connection import ConnectionState
from h2.errors import ErrorCodes
from h2.events import Event
from h2.exceptions import StreamClosedError, StreamIDTooLowError
from h2.stream import StreamInputs, StreamState
from hpack.huffman_table import decode_huffman
from hpack.struct import HeaderTuple
from hpack.table import HeaderTable
from hyperframe.frame import Frame, RstStreamFrame

__all__ = ["HPACKDecoder", "LeanDecoder", "LeanH2Connection", "StatelessEncoder"]

_STATIC_PAIRS: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAMES: dict[bytes, int] = {}
for _i, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, start=1):
    _STATIC_PAIRS.setdefault((_name, _value), _i)
    _STATIC_NAMES.setdefault(_name, _i)

CACHE_FIELDS = 512  # encoded fields kept (the first ones: a connection's steady headers come first)


def _integer(value: int, bits: int, prefix: int) -> bytes:
    """RFC 7541 5.1: ``value`` with an N-bit prefix, the byte's other bits ``prefix``."""
    limit = (1 << bits) - 1
    if value < limit:
        return bytes((prefix | value,))
    out = bytearray((prefix | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    """RFC 7541 5.2, not Huffman-coded."""
    return _integer(len(data), 7, 0x00) + data


def _bytes(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode("utf-8")


def encode_field(name: bytes, value: bytes, sensitive: bool) -> bytes:
    """One header field, never added to the dynamic table: indexed (static
    table), or literal without indexing (never indexed when ``sensitive``,
    RFC 7541 6.2.3, so intermediaries keep it out of their tables too)."""
    if not sensitive:
        index = _STATIC_PAIRS.get((name, value))
        if index is not None:
            return _integer(index, 7, 0x80)
    prefix = 0x10 if sensitive else 0x00
    named = _STATIC_NAMES.get(name)
    if named is not None:
        return _integer(named, 4, prefix) + _string(value)
    return bytes((prefix,)) + _string(name) + _string(value)


class StatelessEncoder:
    """What h2 uses of hpack's ``Encoder`` (``encode`` and a writable
    ``header_table_size``), without a dynamic table."""

    __slots__ = ("_cache", "_first")

    def __init__(self) -> None:
        self._first = True
        self._cache: dict[tuple[bytes | str, bytes | str, bool], bytes] = {}

    @property
    def header_table_size(self) -> int:
        return 0

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE: any value is at least the 0
        this encoder announces in its first block and keeps to."""

    def encode(self, headers: Iterable[Any], huffman: bool = True) -> bytes:
        cache = self._cache
        parts: list[bytes] = []
        if self._first:
            self._first = False
            parts.append(b"\x20")  # dynamic table size update: 0
        for header in headers:
            if isinstance(header, HeaderTuple):
                sensitive = not header.indexable
            else:
                sensitive = len(header) > 2 and bool(header[2])
            key = (header[0], header[1], sensitive)
            field = cache.get(key)
            if field is None:
                field = encode_field(_bytes(header[0]), _bytes(header[1]), sensitive)
                if len(cache) < CACHE_FIELDS:
                    cache[key] = field
            parts.append(field)
        return b"".join(parts)


_STATIC: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
_NSTATIC = len(_STATIC)


class HPACKDecoder:
    """RFC 7541 decoding with its dynamic table (hpack's Decoder, at ~40 us a
    block, was the largest single cost of an HTTP/2 request in ``headrace
    mock``'s lean server). Huffman strings are decoded by hpack's table;
    the short ones are remembered (``cache`` of them at most), as clients
    repeat them. A header list whose size (RFC 9113 6.5.2: 32 + name +
    value a field) goes over ``max_header_list_size`` raises
    ``OversizedHeaderListError`` as soon as it does."""

    def __init__(self, max_size: int = 4096, *, cache: int = 1024, max_header_list_size: int = 65536) -> None:
        self.limit = self.max_size = max_size  # our SETTINGS_HEADER_TABLE_SIZE
        self.max_header_list_size = max_header_list_size
        self.table: deque[tuple[bytes, bytes]] = deque()
        self.size = 0
        self._huffman: dict[bytes, bytes] = {}
        self._cache = cache

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self._decode(block)
        except IndexError:
            raise hpack.HPACKDecodingError("truncated header block") from None

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        pos, end = 0, len(block)
        room = self.max_header_list_size
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index = first & 0x7F
                if index == 0x7F:
                    index, pos = _int(block, pos, 7)
                else:  # a one-byte index (_int's common case, without the call)
                    pos += 1
                field = _STATIC[index - 1] if 0 < index <= _NSTATIC else self._entry(index)
            elif not first & 0x40 and first & 0x20:  # dynamic table size update
                if out:
                    raise hpack.HPACKDecodingError("table size update after a field")
                size, pos = _int(block, pos, 5)
                if size > self.limit:
                    raise hpack.InvalidTableSizeError("table size over the limit")
                self.max_size = size
                self._evict(0)
                continue
            else:
                indexing = first & 0x40  # else without indexing / never indexed
                mask = 0x3F if indexing else 0x0F
                index = first & mask
                if index == mask:
                    index, pos = _int(block, pos, 6 if indexing else 4)
                else:
                    pos += 1
                if index:
                    name = _STATIC[index - 1][0] if index <= _NSTATIC else self._entry(index)[0]
                else:
                    name, pos = self._string(block, pos)
                value, pos = self._string(block, pos)
                field = (name, value)
                if indexing:
                    self._add(name, value)
            room -= 32 + len(field[0]) + len(field[1])
            if room < 0:
                raise hpack.OversizedHeaderListError(
                    f"a header list larger than {self.max_header_list_size} bytes")
            out.append(field)
        return out

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(_STATIC):
            return _STATIC[index - 1]
        if len(_STATIC) < index <= len(_STATIC) + len(self.table):
            return self.table[index - len(_STATIC) - 1]
        raise hpack.InvalidTableIndexError(f"no header table entry {index}")

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        huffman = block[pos] & 0x80
        length, pos = _int(block, pos, 7)
        raw = block[pos : pos + length]
        if len(raw) != length:
            raise hpack.HPACKDecodingError("truncated string")
        if not huffman:
            return raw, pos + length
        text = self._huffman.get(raw)
        if text is None:
            text = decode_huffman(raw)
            if length <= 64:  # long ones are rarely repeated: not worth the memory
                if len(self._huffman) >= self._cache:
                    self._huffman.clear()
                self._huffman[raw] = text
        return text, pos + length

    def _add(self, name: bytes, value: bytes) -> None:
        size = 32 + len(name) + len(value)
        self._evict(size)
        if size <= self.max_size:
            self.table.appendleft((name, value))
            self.size += size

    def _evict(self, room: int) -> None:
        while self.table and self.size + room > self.max_size:
            name, value = self.table.pop()
            self.size -= 32 + len(name) + len(value)


def _int(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An HPACK integer with a ``prefix``-bit prefix at ``pos``; (value, next pos)."""
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 28:
            raise hpack.HPACKDecodingError("integer too large")


class LeanDecoder(HPACKDecoder):
    """:class:`HPACKDecoder` behind ``hpack.Decoder``'s interface as h2's
    connection uses it: ``decode(block, raw=True)``, the header list limit
    (``max_header_list_size``), the table size we allow
    (``max_allowed_table_size``, from our acknowledged SETTINGS) and the
    table's own (``header_table_size``). Fields come as plain tuples, which
    h2's validation and normalisation take as they take ``HeaderTuple``.
    Few strings are remembered (64, each at most 64 bytes): one decoder a
    client connection."""

    def __init__(self) -> None:
        super().__init__(cache=64)

    @property
    def max_allowed_table_size(self) -> int:
        return self.limit

    @max_allowed_table_size.setter
    def max_allowed_table_size(self, value: int) -> None:
        self.limit = value

    @property
    def header_table_size(self) -> int:
        return self.max_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self.max_size = value
        self._evict(0)

    def decode(self, block: bytes, raw: bool = False) -> list[tuple[bytes, bytes]]:
        headers = super().decode(block)
        if self.max_size > self.limit:  # we lowered the limit; the peer has not followed (hpack's check)
            raise hpack.InvalidTableSizeError("the encoder did not shrink its table to within our limit")
        if raw:
            return headers
        try:
            return [(n.decode("utf-8"), v.decode("utf-8")) for n, v in headers]  # type: ignore[misc]
        except UnicodeDecodeError as exc:
            raise hpack.HPACKDecodingError("header fields are not UTF-8") from exc


FRAME_HEAD = struct.Struct(">HBBBL")  # hyperframe's: length (24 bits), type, flags, stream id
# The states SEND_DATA keeps (compared by identity: an Enum's hash is a Python call)
_SERVER_OPEN, _CLIENT_OPEN = ConnectionState.SERVER_OPEN, ConnectionState.CLIENT_OPEN
_OPEN, _HALF_CLOSED_REMOTE = StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE
END_STREAM_FLAG = 0x1


class LeanH2Connection(h2.connection.H2Connection):
    """h2's connection with a :class:`StatelessEncoder`, a :class:`LeanDecoder`,
    a ``send_data`` that frames in place and a ``_receive_frame`` that
    formats nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.encoder = StatelessEncoder()  # type: ignore[assignment]
        limit = self.decoder.max_header_list_size
        self.decoder = LeanDecoder()  # type: ignore[assignment]
        self.decoder.max_header_list_size = limit

    def send_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False, pad_length: Any = None) -> None:
        """h2's ``send_data``, the common case framed here (see the module
        docstring): the same bytes, windows and stream state as h2's."""
        stream = self.streams.get(stream_id)
        size = len(data)
        if (
            pad_length is not None
            or stream is None
            or type(data) is not bytes
            or not 0 < size <= self.max_outbound_frame_size
            or size > self.outbound_flow_control_window
            or size > stream.outbound_flow_control_window
            or not ((conn_state := self.state_machine.state) is _SERVER_OPEN or conn_state is _CLIENT_OPEN)
            or not ((state := stream.state_machine.state) is _HALF_CLOSED_REMOTE or state is _OPEN)
        ):
            super().send_data(stream_id, data, end_stream, pad_length)
            return
        flags = 0
        if end_stream:
            stream.state_machine.process_input(StreamInputs.SEND_END_STREAM)
            flags = END_STREAM_FLAG
        buffer = self._data_to_send
        buffer += FRAME_HEAD.pack(size >> 8, size & 0xFF, 0, flags, stream_id)
        buffer += data
        stream.outbound_flow_control_window -= size
        self.outbound_flow_control_window -= size

    def _receive_frame(self, frame: Frame) -> list[Event]:
        # h2 4.x's H2Connection._receive_frame less its trace line (see the module docstring).
        events: list[Event]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = e.error_code
                self._prepare_for_sending([f])
                events = e._events
            else:
                raise
        except StreamIDTooLowError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([f])
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise StreamClosedError(e.stream_id) from e
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events

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
- **A received frame is not formatted for a log line nobody reads.** h2's
  ``_receive_frame`` builds ``repr(frame)`` for a trace message before
  calling the logger (about 1% of the CPU per request, two frames a
  request at least). :meth:`LeanH2Connection._receive_frame` is h2 4.x's
  without that line; tests/backends/test_h2lite.py checks h2's still reads
  as this one was copied from.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import h2.connection
from h2.errors import ErrorCodes
from h2.events import Event
from h2.exceptions import StreamClosedError, StreamIDTooLowError
from hpack.struct import HeaderTuple
from hpack.table import HeaderTable
from hyperframe.frame import Frame, RstStreamFrame

__all__ = ["LeanH2Connection", "StatelessEncoder"]

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


class LeanH2Connection(h2.connection.H2Connection):
    """h2's connection with a :class:`StatelessEncoder` and a
    ``_receive_frame`` that formats nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.encoder = StatelessEncoder()  # type: ignore[assignment]

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

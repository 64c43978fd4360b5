"""Header blocks over HTTP/2 without h2's per-field generators where they
would change nothing.

h2 normalizes and validates every header block it sends (lowercase names,
stripped values, no connection-specific fields, credentials kept out of the
HPACK table; no ``te`` but trailers, pseudo-headers first and known) and
every block it receives (RFC 9113 8.2.1's characters, pseudo-headers
present, known, once and first, no connection-specific fields, ``:authority``
against ``host``; cookies joined), through a chain of Python generators a
field each: about 4% of the router's self time each way under cProfile.

:func:`canonical` recognises a response block those passes would send
unchanged (``:status`` first, then lowercase plain fields), and
:func:`canonical_request` a request block they would accept unchanged (the
four pseudo-headers first, then plain lowercase fields; no ``host``,
``cookie``, ``te`` or connection-specific field). :class:`CheckedWhenNeeded`,
a mixin of the ingress's connection (frontend/hardening.py's
``GuardedH2Connection``), sends the first and takes the second, on the frame
that opens a stream only (never trailers), without the passes; everything
else goes through them as before. So what goes on the wire, and what is
accepted or refused, is h2's: tests/frontend/test_h2_headers.py compares the
two for arbitrary blocks each way. Measured with ``headrace bench
instructions``: with the outbound passes off for every block (an
experiment) -2.1% of a streamed request's instructions; this checked
version -0.2% to -1.6%, in runs whose spread is as large (bench/README.md,
stop 40).

A canonical response block on a stream that has sent no headers yet is
framed here too (:meth:`CheckedWhenNeeded.send_headers`): the stream's
state machine is driven as h2 drives it, the block encoded once by the
connection's encoder and split into HEADERS and CONTINUATION frames as h2
splits it, without h2's frame objects, its per-field byte conversion and
its debug lines (~35 Python calls a response).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import h2.config
import h2.connection
from h2.connection import ConnectionState
from h2.stream import StreamInputs, StreamState
from h2.utilities import CONNECTION_HEADERS

from backends.h2lite import END_STREAM_FLAG, FRAME_HEAD, LeanDecoder

__all__ = ["CheckedWhenNeeded", "RequestCheckingDecoder", "canonical", "canonical_request"]

# Fields h2 drops or rejects (connection-specific, ``te``) or sends
# never-indexed (credentials): a block with any takes h2's own path.
_ASIDE = CONNECTION_HEADERS | {b"te", b"authorization", b"proxy-authorization", b"cookie"}


def canonical(headers: Sequence[Any]) -> bool:
    """A response's header block that h2's outbound normalization leaves as it
    is and its validation lets through: ``(b":status", value)`` first, then
    fields whose names are lowercase with no surrounding whitespace, none of
    them a pseudo-header or in :data:`_ASIDE`, values with no surrounding
    whitespace; plain ``bytes`` tuples throughout. False says only "let h2
    look", never that the block is wrong."""
    if not headers:
        return False
    for i, header in enumerate(headers):
        if type(header) is not tuple or len(header) != 2:
            return False  # a HeaderTuple (never-indexed...) or anything else: h2 knows
        name, value = header
        if type(name) is not bytes or type(value) is not bytes or value.strip() != value:
            return False
        if i == 0:
            if name != b":status":
                return False
        elif not name.islower() or name.strip() != name or name[0] == 0x3A or name in _ASIDE:
            return False
    return True


# A request's field names and values as h2's inbound validation takes them
# (RFC 9113 8.2.1): names of visible ASCII but uppercase letters and ':', values
# without NUL, CR or LF, not starting or ending with SP or HTAB.
_NAME = re.compile(rb"[\x21-\x39\x3b-\x40\x5b-\x7e]+")
_VALUE = re.compile(rb"(?:[^\x00\n\r\t ](?:[^\x00\n\r]*[^\x00\n\r\t ])?)?")
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})
# Fields h2 rejects, checks against others (host) or merges (cookie) coming in.
_INBOUND_ASIDE = CONNECTION_HEADERS | {b"te", b"host", b"cookie"}


def canonical_request(headers: Sequence[Any]) -> bool:
    """A request's header block that h2's inbound validation accepts and its
    normalization leaves as it is: ``:method`` (not CONNECT), ``:scheme``,
    ``:authority`` and a non-empty ``:path``, each once, before every other
    field; names and values as :data:`_NAME` and :data:`_VALUE` allow; no
    ``host``, ``cookie``, ``te`` or connection-specific field; plain
    ``bytes`` tuples. False says only "let h2 look" (it may well accept)."""
    seen: set[bytes] = set()
    regular = False
    for header in headers:
        if type(header) is not tuple or len(header) != 2:
            return False
        name, value = header
        if type(name) is not bytes or type(value) is not bytes or not _VALUE.fullmatch(value):
            return False
        if name[:1] == b":":
            if regular or name not in _REQUEST_PSEUDO or name in seen:
                return False
            if (name == b":method" and value == b"CONNECT") or (name == b":path" and not value):
                return False
            seen.add(name)
        else:
            regular = True
            if not _NAME.fullmatch(name) or name in _INBOUND_ASIDE:
                return False
    return len(seen) == 4


class RequestCheckingDecoder(LeanDecoder):
    """The ingress's HPACK decoder: a block it decodes while ``armed`` (the
    HEADERS frame that opens a stream, on a server's connection: not
    trailers) that is a :func:`canonical_request` has h2's inbound
    validation and normalization off for it (``unchecked``), until
    :class:`CheckedWhenNeeded` turns them back on once the frame is
    handled, whatever happened to it."""

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__()
        self.config: Any = config  # its options' storage is read below, past the descriptors
        self.armed = self.unchecked = False

    # The two options are read and set where h2's descriptors keep them
    # (``_BooleanConfigOption``: ``_`` and the name; checked by
    # tests/frontend/test_h2_headers.py), not through the descriptors: each
    # access was a Python call, six a request.

    def decode(self, block: bytes, raw: bool = False) -> list[tuple[bytes, bytes]]:
        headers = super().decode(block, raw)
        config = self.config
        if (raw and self.armed and config._validate_inbound_headers and config._normalize_inbound_headers
                and canonical_request(headers)):  # fmt: skip
            config._validate_inbound_headers = config._normalize_inbound_headers = False
            self.unchecked = True
        return headers

    def checked_again(self) -> None:
        if self.unchecked:
            self.unchecked = False
            self.config._validate_inbound_headers = self.config._normalize_inbound_headers = True


class CheckedWhenNeeded(h2.connection.H2Connection):
    """A mixin for an h2 connection: ``send_headers`` skips h2's outbound
    normalization and validation for a :func:`canonical` block, for that
    call only; any other block, and everything else the connection sends,
    is checked as before. (A method, not a wrapper set on the instance: that
    would be a reference cycle, and a closed connection is freed without the
    collector; tests/hardening/test_connections.py.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.decoder.max_header_list_size
        self.decoder = RequestCheckingDecoder(self.config)  # type: ignore[assignment]
        self.decoder.max_header_list_size = limit

    def _receive_headers_frame(self, frame: Any) -> Any:
        decoder = self.decoder
        if not isinstance(decoder, RequestCheckingDecoder):
            return super()._receive_headers_frame(frame)
        # A request's own block, not trailers (h2 refuses pseudo-headers there).
        decoder.armed = not self.config.client_side and frame.stream_id not in self.streams
        try:
            return super()._receive_headers_frame(frame)
        finally:
            decoder.armed = False
            decoder.checked_again()

    def send_headers(self, stream_id: int, headers: Any, *args: Any, **kwargs: Any) -> None:
        stream = self.streams.get(stream_id)
        if not canonical(headers) or (stream is not None and stream.state_machine.headers_sent):
            # Anything else, and trailers (h2 refuses a pseudo-header there): h2's passes
            super().send_headers(stream_id, headers, *args, **kwargs)
            return
        if (
            stream is not None
            and not args
            and kwargs.keys() <= {"end_stream"}
            and self._frame_response(stream, headers, kwargs.get("end_stream", False))
        ):
            return
        config = self.config
        validate, normalize = config.validate_outbound_headers, config.normalize_outbound_headers
        config.validate_outbound_headers = config.normalize_outbound_headers = False
        try:
            super().send_headers(stream_id, headers, *args, **kwargs)
        finally:
            config.validate_outbound_headers, config.normalize_outbound_headers = validate, normalize

    def _frame_response(self, stream: Any, headers: Sequence[tuple[bytes, bytes]], end_stream: bool) -> bool:
        """Send a :func:`canonical` block as ``stream``'s response headers, as
        h2's ``send_headers`` would with its passes off, where that is all it
        would do: the connection open, the stream open or half closed by the
        request and without headers sent (not trailers), a final status
        (not 1xx), no priority. False where not (nothing done)."""
        if self.state_machine.state is not _SERVER_OPEN:
            return False
        machine = stream.state_machine
        if machine.headers_sent or machine.client is not False or headers[0][1][:1] == b"1":
            return False
        if not (machine.state is _HALF_CLOSED_REMOTE or machine.state is _OPEN):
            return False
        machine.process_input(StreamInputs.SEND_HEADERS)  # before encoding, as h2: the response is sent
        flags = 0
        if end_stream:
            machine.process_input(StreamInputs.SEND_END_STREAM)
            flags = END_STREAM_FLAG
        block = self.encoder.encode(headers)
        size = self.max_outbound_frame_size
        out = self._data_to_send
        # HEADERS, then CONTINUATION frames, of at most a frame each; the last ends the headers
        parts = [block[i : i + size] for i in range(0, len(block), size)]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            kind, frame_flags = (_HEADERS, flags) if i == 0 else (_CONTINUATION, 0)
            if last:
                frame_flags |= _END_HEADERS
            out += FRAME_HEAD.pack(len(part) >> 8, len(part) & 0xFF, kind, frame_flags, stream.stream_id)
            out += part
        return True


_HEADERS, _CONTINUATION, _END_HEADERS = 0x1, 0x9, 0x4
_SERVER_OPEN = ConnectionState.SERVER_OPEN
_OPEN, _HALF_CLOSED_REMOTE = StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE

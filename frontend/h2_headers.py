"""Response headers over HTTP/2 without h2's per-header generators where they
would change nothing.

h2 normalizes (lowercase names, strip whitespace, drop connection-specific
fields, keep credentials out of the HPACK table) and validates (no ``te`` but
trailers, no connection-specific fields, pseudo-headers first and known)
every header block it sends, through a chain of Python generators a header
each: 2.1% of the router's instructions for a streamed request (``headrace
bench instructions``), for a block the router built itself and that already
is what they would make of it. :func:`canonical` recognises such a block
(a response's: ``:status`` first, then lowercase names and stripped values
of plain fields); :class:`CheckedWhenNeeded` has a connection send those
without the two passes and everything else (trailers, anything not
canonical) through them as before, so what goes on the wire and what is
refused are the same; every ingress connection is one
(frontend/hardening.py's ``GuardedH2Connection``) (tests/frontend/test_h2_headers.py compares the frames
with h2's own for any header list). What the server *receives* is validated
by h2 as always.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import h2.config
import h2.connection

from backends.h2lite import LeanDecoder

__all__ = ["CheckedWhenNeeded", "RequestCheckingDecoder", "canonical", "canonical_request"]

# Fields h2 drops or rejects (connection-specific, ``te``) or sends
# never-indexed (credentials): a block with any takes h2's own path.
_ASIDE = frozenset({
    b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te",
    b"authorization", b"proxy-authorization", b"cookie",
})  # fmt: skip


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
_INBOUND_ASIDE = frozenset({
    b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"host", b"cookie",
})  # fmt: skip


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
        self.config = config
        self.armed = self.unchecked = False

    def decode(self, block: bytes, raw: bool = False) -> list[tuple[bytes, bytes]]:
        headers = super().decode(block, raw)
        config = self.config
        if (raw and self.armed and config.validate_inbound_headers and config.normalize_inbound_headers
                and canonical_request(headers)):
            config.validate_inbound_headers = config.normalize_inbound_headers = False
            self.unchecked = True
        return headers

    def checked_again(self) -> None:
        if self.unchecked:
            self.unchecked = False
            self.config.validate_inbound_headers = self.config.normalize_inbound_headers = True


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
        if not canonical(headers):
            super().send_headers(stream_id, headers, *args, **kwargs)
            return
        config = self.config
        validate, normalize = config.validate_outbound_headers, config.normalize_outbound_headers
        config.validate_outbound_headers = config.normalize_outbound_headers = False
        try:
            super().send_headers(stream_id, headers, *args, **kwargs)
        finally:
            config.validate_outbound_headers, config.normalize_outbound_headers = validate, normalize

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

from collections.abc import Sequence
from typing import Any

import h2.connection

__all__ = ["CheckedWhenNeeded", "canonical"]

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


class CheckedWhenNeeded(h2.connection.H2Connection):
    """A mixin for an h2 connection: ``send_headers`` skips h2's outbound
    normalization and validation for a :func:`canonical` block, for that
    call only; any other block, and everything else the connection sends,
    is checked as before. (A method, not a wrapper set on the instance: that
    would be a reference cycle, and a closed connection is freed without the
    collector; tests/hardening/test_connections.py.)"""

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

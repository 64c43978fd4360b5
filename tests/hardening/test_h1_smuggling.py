"""HTTP/1.1 request smuggling: a request with both Content-Length and
Transfer-Encoding is answered 400 and its connection closed (RFC 9112 6.1),
so whatever the two framings disagree about is never read as a request."""

from __future__ import annotations

import pytest
import trio

from backends.mock import MockBackend
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve

SMUGGLED = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
CASES = {
    # chunked says the body ends at once; the smuggled request follows
    "CL.TE": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n" % (5 + len(SMUGGLED)) + SMUGGLED,
    # the length covers the chunked terminator only; a front end framing by length forwards the rest
    "TE.CL": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n0\r\n\r\n" + SMUGGLED,
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(nursery: trio.Nursery, case: str) -> None:
    url = await nursery.start(serve, OpenAIServer(MockBackend()), ServeOptions(graceful_timeout=0.1))
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    await sock.send_all(CASES[case])
    got, closed = b"", False
    with trio.move_on_after(3):
        while True:
            try:
                chunk = await sock.receive_some(65536)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                closed = True
                break
            got += chunk
    await sock.aclose()
    assert got.startswith(b"HTTP/1.1 400"), got
    assert got.count(b"HTTP/1.1 ") == 1, got  # the smuggled request was not answered
    assert b'"object":"list"' not in got
    assert closed

"""The mock's lean HTTP server (``backends.mock_http``): the conformance
suite on HTTP/1.1 and HTTP/2, and the HTTP behaviour the mock and its clients
rely on (flow control both ways, resets, pipelining, errors, graceful drain,
no cap on requests per connection)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h2.config
import h2.connection
import h2.events
import hpack
import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.mock import MockBackend, MockConfig
from backends.mock_h2 import HPACKDecoder, encode_headers
from backends.mock_http import serve_lean
from backends.mock_server import build_app
from conformance import check_http
from frontend.serving import ServeOptions
from tests.backends.conftest import eventually

BODY = {"prompt": "hi", "max_tokens": 8, "stream": True, "seed": 1}


@asynccontextmanager
async def lean(app: Any, *, shutdown: trio.Event | None = None,
               graceful: float = 0.5) -> AsyncIterator[str]:
    """``app`` on the lean server, with its ``answer_now`` as ``headrace mock`` serves it."""
    async with trio.open_nursery() as nursery:
        options = ServeOptions(graceful_timeout=graceful)
        answer_now = getattr(app, "answer_now", None)
        url = await nursery.start(partial(serve_lean, app, options, answer_now=answer_now,
                                          shutdown=shutdown))
        try:
            yield url
        finally:
            if shutdown is None:
                nursery.cancel_scope.cancel()


def _client(url: str, h2: bool, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, http1=not h2, http2=h2, **kwargs)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_the_mock_on_the_lean_server_passes_the_http_suite(http: str) -> None:
    async with lean(build_app(MockBackend(MockConfig(tpot_s=0.002)))) as url:
        report = await check_http(url, http=http, check_timeout=30.0, grace=5.0)
    assert report.ok, report.format_table()


@pytest.mark.parametrize("h2", [False, True])
async def test_a_long_answer_waits_for_flow_control_and_a_long_body_is_credited(h2: bool) -> None:
    """3,000 tokens (~700 KB) outrun the client's 64 KB stream window; a 300 KB
    prompt outruns the server's receive window."""
    backend = MockBackend(MockConfig(max_tokens=5000, max_context=400_000))
    async with lean(build_app(backend)) as url, _client(url, h2, timeout=30) as client:
        r = await client.post("/v1/completions", json=BODY | {"max_tokens": 3000})
        lines = [x for x in r.text.split("\n") if x.startswith("data: ")]
        assert r.status_code == 200 and len(lines) == 3001 and lines[-1] == "data: [DONE]"
        r = await client.post("/v1/completions", json=BODY | {"prompt": "y" * 300_000})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert r.http_version == ("HTTP/2" if h2 else "HTTP/1.1")


async def test_many_concurrent_streams_on_one_h2_connection() -> None:
    app = build_app(MockBackend(MockConfig(tpot_s=0.001)))
    codes: list[int] = []
    async with lean(app) as url, _client(url, True, timeout=30) as client:

        async def one() -> None:
            r = await client.post("/v1/completions", json=BODY)
            codes.append(r.status_code if r.text.endswith("[DONE]\n\n") else -1)

        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(one)
    assert codes == [200] * 200


@pytest.mark.parametrize("h2", [False, True])
async def test_more_than_a_thousand_requests_share_one_connection(h2: bool) -> None:
    """hypercorn closed every connection after 1,000 requests (issue 12, bug 1)."""
    app = build_app(MockBackend(MockConfig(max_tokens=1)))
    one = httpx.Limits(max_connections=1)
    async with lean(app) as url, _client(url, h2, limits=one) as client:
        for _ in range(1100):
            assert (await client.get("/health")).status_code == 200
        stats = (await client.get("/stats")).json()
    assert stats["in_flight"] == 0


async def test_a_client_that_resets_its_stream_cancels_the_backend() -> None:
    backend = MockBackend(MockConfig(tpot_s=0.01))
    async with lean(build_app(backend)) as url:
        stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        _request(conn, 1, BODY | {"max_tokens": 500})
        await stream.send_all(conn.data_to_send())
        with trio.fail_after(5):
            while not any(isinstance(e, h2.events.DataReceived)
                          for e in conn.receive_data(await stream.receive_some())):
                pass
        assert backend.statistics().in_flight == 1
        conn.reset_stream(1)
        _request(conn, 3, {"prompt": "x", "max_tokens": 2})  # the connection lives on
        await stream.send_all(conn.data_to_send())
        await eventually(lambda: backend.statistics().cancelled == 1, 2.0)
        body = await _read_stream(stream, conn, 3)
        assert body.endswith(b"data: [DONE]\n\n")
        await stream.aclose()


def _request(conn: h2.connection.H2Connection, sid: int, body: dict[str, Any]) -> None:
    headers = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
               (":authority", "x"), ("content-type", "application/json")]
    conn.send_headers(sid, headers)
    conn.send_data(sid, json.dumps({"stream": True} | body).encode(), end_stream=True)


async def _read_stream(stream: trio.SocketStream, conn: h2.connection.H2Connection,
                       sid: int) -> bytes:
    body = b""
    with trio.fail_after(5):
        while True:
            events = conn.receive_data(await stream.receive_some())
            for e in events:
                if isinstance(e, h2.events.DataReceived) and e.stream_id == sid:
                    body += e.data
                    conn.acknowledge_received_data(e.flow_controlled_length, sid)
            await stream.send_all(conn.data_to_send())
            if any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events):
                return body


async def _raw_http1(url: str, data: bytes, until: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
    await stream.send_all(data)
    got = b""
    with trio.fail_after(5):
        while until not in got or got.count(until) < data.count(b"HTTP/1.1\r\n"):
            chunk = await stream.receive_some()
            if not chunk:
                break
            got += chunk
    await stream.aclose()
    return got


async def test_http1_pipelined_chunked_and_expect_continue_requests() -> None:
    async with lean(build_app(MockBackend())) as url:
        body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        data = (
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked
            + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        got = await _raw_http1(url, data, b"HTTP/1.1 200 OK\r\n")
        assert got.count(b"HTTP/1.1 200 OK\r\n") == 3 and b'"object":"list"' in got
        async with _client(url, False) as client:
            r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                  headers={"expect": "100-continue"})
            assert r.status_code == 200


async def test_malformed_requests_get_400_and_app_errors_500() -> None:
    async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async with lean(build_app(MockBackend())) as url:
        got = await _raw_http1(url, b"NOT HTTP\r\n\r\n", b"\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 400 ")
    async with lean(broken) as url:
        for h2 in (False, True):
            async with _client(url, h2) as client:
                assert (await client.get("/health")).status_code == 500


@pytest.mark.parametrize("h2", [False, True])
async def test_shutdown_lets_streams_in_flight_finish_and_refuses_new_connections(
    h2: bool,
) -> None:
    shutdown = trio.Event()
    backend = MockBackend(MockConfig(tpot_s=0.01))
    body = BODY | {"max_tokens": 30}
    async with lean(build_app(backend), shutdown=shutdown, graceful=5.0) as url:
        async with _client(url, h2, timeout=10) as client, \
                client.stream("POST", "/v1/completions", json=body) as r:
            text = ""
            async for chunk in r.aiter_text():
                if not shutdown.is_set():
                    shutdown.set()
                text += chunk
        assert text.endswith("data: [DONE]\n\n") and text.count("data: ") == 31
        with pytest.raises(httpx.ConnectError):
            async with _client(url, h2) as client:
                await client.get("/health")


async def _recv_all(stream: trio.SocketStream) -> bytes:
    got = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some():
            got += chunk
    return got


async def test_a_chunked_body_trickling_in_byte_by_byte_with_extensions_and_trailers() -> None:
    async with lean(build_app(MockBackend())) as url:
        stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
        body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
        half = len(body) // 2
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\n"
                + b"%x;ext=1\r\n%s\r\n" % (half, body[:half])
                + b"%X\r\n%s\r\n" % (len(body) - half, body[half:])
                + b"0\r\nX-Trailer: yes\r\n\r\n")
        for i in range(len(data)):
            await stream.send_all(data[i : i + 1])
        got = await _recv_all(stream)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close" in got
    assert got.count(b'"text_completion"') == 1


async def test_http10_head_and_connection_close() -> None:
    async with lean(build_app(MockBackend())) as url:
        stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
        await stream.send_all(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                              b"GET /health HTTP/1.0\r\n\r\n")
        got = await _recv_all(stream)  # HTTP/1.0 without keep-alive: closed after it
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 405 Method Not Allowed") and b"content-length: " in head
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n")  # HEAD sent no body
        assert rest.endswith(b'"detail":""}')


_names = st.sampled_from([":method", ":path", "content-length", "x-request-id", "user-agent",
                          "accept", "x-" + "n" * 40])
_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80)
_blocks = st.lists(st.lists(st.tuples(_names, _values, st.booleans()), max_size=12),
                   min_size=1, max_size=8)


@given(blocks=_blocks, huffman=st.booleans(), table_size=st.sampled_from([4096, 256, 0]))
@settings(max_examples=200, deadline=None)
def test_the_hpack_decoder_reads_what_hpack_encodes_block_after_block(
    blocks: list[list[tuple[str, str, bool]]], huffman: bool, table_size: int
) -> None:
    encoder, decoder = hpack.Encoder(), HPACKDecoder()
    encoder.header_table_size = table_size  # emits a dynamic table size update
    for block in blocks:
        headers = [hpack.HeaderTuple(n, v) if not sensitive else hpack.NeverIndexedHeaderTuple(n, v)
                   for n, v, sensitive in block]
        got = decoder.decode(encoder.encode(headers, huffman=huffman))
        assert got == [(n.encode(), v.encode()) for n, v, _ in block]


def test_response_headers_encode_as_hpack_reads_them() -> None:
    headers = [(b":status", b"200"), (b"content-type", b"text/event-stream"),
               (b"x-long", b"v" * 300)]
    for status in (b"200", b"404", b"503", b"429"):
        block = encode_headers([(b":status", status), *headers[1:]])
        assert hpack.Decoder().decode(block, raw=True) == [(b":status", status), *headers[1:]]


async def test_idle_connections_are_closed_after_the_keep_alive_timeout() -> None:
    options = ServeOptions(keep_alive_timeout=0.2)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_lean, build_app(MockBackend()), options)
        h1 = await trio.open_tcp_stream("127.0.0.1", _port(url))
        await h1.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        h2c = await trio.open_tcp_stream("127.0.0.1", _port(url))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        await h2c.send_all(conn.data_to_send())
        with trio.fail_after(3):  # each is answered, then closed once idle
            assert (await _recv_all(h1)).startswith(b"HTTP/1.1 200 OK")
            events = list(conn.receive_data(await _recv_all(h2c)))
        assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events)
        nursery.cancel_scope.cancel()

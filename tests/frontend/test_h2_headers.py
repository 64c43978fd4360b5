"""frontend/h2_headers.py: a header block that is already what h2's passes
would make of it (a response's going out, a request's coming in) skips
them, and nobody can tell: for any header lists, a patched server connection
sends the same bytes as h2's own and refuses the same blocks, and for any
request blocks (as requests and as trailers) it takes or refuses them with
the same events and frames. A plain client's requests and the server's
responses take the short path."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends.h2lite import LeanH2Connection
from frontend import h2_headers
from frontend.h2_headers import CheckedWhenNeeded, canonical, canonical_request
from frontend.serving import ServeOptions, serve
from tests.frontend.test_serving import _h2_batch, health_app

STREAMS = 3


def _server(patched: bool, kind: type[h2.connection.H2Connection] = h2.connection.H2Connection) -> h2.connection.H2Connection:
    """A server connection with STREAMS requests received (streams 1, 3, 5)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    if patched:
        kind = type("Patched", (CheckedWhenNeeded, kind), {})
    server = kind(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    request = [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "x")]
    for i in range(STREAMS):
        client.send_headers(2 * i + 1, request, end_stream=True)
    server.receive_data(client.data_to_send())
    server.data_to_send()
    return server


def _send(server: h2.connection.H2Connection, blocks: list[list[Any]]) -> list[tuple[str, bytes]]:
    """Each block as one stream's response headers: what was raised (the
    exception's type) or sent, block by block (HPACK's table carries over)."""
    out = []
    for i, block in enumerate(blocks):
        try:
            server.send_headers(2 * i + 1, block, end_stream=True)
        except Exception as exc:  # ProtocolError, and what h2 itself trips on (an empty name: IndexError)
            out.append((type(exc).__name__, server.data_to_send()))
        else:
            out.append(("sent", server.data_to_send()))
    return out


_NAMES = st.sampled_from([
    b"content-type", b"x-request-id", b"retry-after", b"server", b"date", b"x-ratelimit-remaining-requests",
    b"Content-Type", b"X-Request-Id", b" x-pad", b"x-pad ", b"", b"connection", b"keep-alive",
    b"transfer-encoding", b"upgrade", b"te", b"authorization", b"proxy-authorization", b"cookie",
    b":status", b":path", b"x:colon", b"123", b"set-cookie",
])  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from([b"200", b"text/event-stream", b"trailers", b"abc", b" padded", b"padded\t", b"", b"a b", b"short"]),
    st.binary(max_size=12),
)
_FIELD = st.one_of(st.tuples(_NAMES, _VALUES), st.tuples(st.binary(max_size=8), st.binary(max_size=8)))
_BLOCK = st.one_of(
    # a response's: :status first, then fields (most often plain, canonical ones)
    st.builds(lambda status, fields: [(b":status", status), *fields],
              st.sampled_from([b"200", b"404", b"503", b" 200"]), st.lists(_FIELD, max_size=6)),
    st.lists(_FIELD, max_size=5),  # anything: no :status, or elsewhere
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(_BLOCK, min_size=1, max_size=STREAMS), st.sampled_from([h2.connection.H2Connection, LeanH2Connection]))
def test_the_wire_cannot_tell_a_patched_connection_from_h2s_own(
    blocks: list[list[Any]], kind: type[h2.connection.H2Connection]
) -> None:
    """h2's own connection (HPACK's table carries over between blocks) and the
    one the ingress uses (frontend/hardening.py's, a stateless encoder)."""
    assert _send(_server(True, kind), blocks) == _send(_server(False, kind), blocks)


_OPS = st.lists(
    st.tuples(
        st.sampled_from([1, 3, 5, 7, 9, 11]),  # 1, 3: requests read whole; 5: a body still coming; 7: reset; 9, 11: never opened
        st.one_of(
            _BLOCK,
            st.sampled_from([[(b":status", b"103"), (b"link", b"</s.css>")], [(b":status", b"200"), (b"x-big", b"v" * 20_000)]]),
        ),
        st.booleans(),  # end_stream
    ),
    min_size=1, max_size=6,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_OPS, st.sampled_from([h2.connection.H2Connection, LeanH2Connection]), st.booleans())
@example([(1, [(b":status", b"200")], False), (1, [(b":status", b"200")], True)], LeanH2Connection, False)  # canonical trailers
def test_responses_framed_in_place_leave_the_same_bytes_and_stream_states_as_h2(
    ops: list[tuple[int, list[Any], bool]], kind: type[h2.connection.H2Connection], goaway: bool
) -> None:
    """Responses, trailers after them, informational heads, blocks past a
    frame (CONTINUATION), with and without END_STREAM, on streams read
    whole, still receiving, reset and never opened, a closed connection:
    the patched connection (canonical responses framed in place) raises
    what h2's raises, sends its bytes and leaves its streams as h2 does."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    request = [(":method", "POST"), (":path", "/"), (":scheme", "http"), (":authority", "x")]
    for sid in (1, 3, 5, 7):
        client.send_headers(sid, request, end_stream=sid != 5)
    client.reset_stream(7)
    wire = client.data_to_send()
    servers = []
    for patched in (True, False):
        server = (type("Patched", (CheckedWhenNeeded, kind), {}) if patched else kind)(
            config=h2.config.H2Configuration(client_side=False, header_encoding=None))  # fmt: skip
        server.initiate_connection()
        server.receive_data(wire)
        if goaway:
            server.close_connection()
        server.data_to_send()
        servers.append(server)

    def state(server: h2.connection.H2Connection) -> object:
        return {sid: (s.state_machine.state, s.state_machine.headers_sent, s.state_machine.trailers_sent,
                      s.request_method) for sid, s in server.streams.items()}  # fmt: skip

    for sid, block, end in ops:
        outcomes = []
        for server in servers:
            try:
                server.send_headers(sid, block, end_stream=end)
            except Exception as exc:  # the same refusal, whichever it is
                outcomes.append((type(exc).__name__, server.data_to_send()))
            else:
                outcomes.append(("sent", server.data_to_send()))
        assert outcomes[0] == outcomes[1], (sid, block[:3], end)
        assert state(servers[0]) == state(servers[1])


def test_a_canonical_response_takes_the_short_path_and_a_client_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A canonical response never reaches h2's ``send_headers``, and a stock
    client reads it back, END_STREAM and all."""
    calls: list[int] = []
    stock = h2.connection.H2Connection.send_headers
    monkeypatch.setattr(h2.connection.H2Connection, "send_headers", lambda self, *a, **k: (calls.append(1), stock(self, *a, **k))[1])
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    server = type("Patched", (CheckedWhenNeeded, LeanH2Connection), {})(
        config=h2.config.H2Configuration(client_side=False, header_encoding=None))  # fmt: skip
    server.initiate_connection()
    client.receive_data(server.data_to_send())
    calls.clear()
    client.send_headers(1, [(b":method", b"GET"), (b":path", b"/"), (b":scheme", b"http"), (b":authority", b"x")], end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200"), (b"content-type", b"text/plain")], end_stream=True)
    assert calls == [1]  # the client's request only
    events = client.receive_data(server.data_to_send())
    [response] = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert response.headers == [(b":status", b"200"), (b"content-type", b"text/plain")]
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


def test_canonical_is_a_response_block_of_plain_lowercase_fields() -> None:
    plain = [(b":status", b"200"), (b"content-type", b"text/event-stream"), (b"x-request-id", b"r-1")]
    assert canonical(plain)
    assert not canonical([])
    assert not canonical(plain[1:])  # no :status first: a trailer, or a request's
    assert not canonical([*plain, (b"X-Upper", b"v")])
    assert not canonical([*plain, (b"x-pad", b"v ")])
    assert not canonical([*plain, (b"connection", b"close")])
    assert not canonical([*plain, (b"te", b"trailers")])
    assert not canonical([*plain, (b"authorization", b"secret")])  # never-indexed: h2's path
    assert not canonical([*plain, (b":path", b"/")])
    assert not canonical([*plain, ("content-length", "1")])  # str, not bytes
    assert not canonical([*plain, (b"content-length", b"1", b"extra")])


# ---------------------------------------------------------------- received requests

_PSEUDO = st.sampled_from([
    (b":method", b"POST"), (b":method", b"GET"), (b":method", b"CONNECT"), (b":scheme", b"http"),
    (b":authority", b"127.0.0.1:8000"), (b":authority", b" x"), (b":path", b"/v1/completions"), (b":path", b""),
    (b":status", b"200"), (b":protocol", b"websocket"), (b":Path", b"/"),
])  # fmt: skip
_REQUEST_FIELD = st.one_of(
    st.tuples(st.sampled_from([
        b"content-type", b"content-length", b"user-agent", b"accept", b"x-request-id", b"authorization",
        b"Content-Type", b"host", b"cookie", b"te", b"connection", b"x:colon", b"", b"x y", b"\x7f", b"caf\xc3\xa9",
    ]), st.sampled_from([b"application/json", b"12", b"", b" pad", b"pad\t", b"127.0.0.1:8000", b"trailers", b"a\x00b",
                         b"caf\xc3\xa9", b"gzip, br"])),
    st.tuples(st.binary(max_size=6), st.binary(max_size=6)),
)  # fmt: skip
_REQUEST = st.builds(lambda pseudo, fields, shuffle: (pseudo + fields)[::-1] if shuffle else pseudo + fields,
                     st.one_of(st.just([(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"127.0.0.1:8000"),
                                        (b":path", b"/v1/completions")]),
                               st.lists(_PSEUDO, max_size=5)),
                     st.lists(_REQUEST_FIELD, max_size=5), st.booleans())  # fmt: skip


def _receive(patched: bool, blocks: list[list[Any]], trailers: bool) -> list[Any]:
    """Each block as a new stream's request headers (and, with ``trailers``,
    again as that stream's trailers), sent raw by a client that checks
    nothing: what the ingress's server connection made of each (its events,
    what it sent back) or what it raised."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False))
    client.initiate_connection()
    kind = type("Patched", (CheckedWhenNeeded, LeanH2Connection), {}) if patched else LeanH2Connection
    server = kind(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    out: list[Any] = []
    for i, block in enumerate(blocks):
        sid = 2 * i + 1
        try:
            client.send_headers(sid, block, end_stream=not trailers)
            if trailers:
                client.send_headers(sid, block, end_stream=True)
        except Exception as exc:  # the client's own h2 cannot send it: the same for both
            out.append(("client", type(exc).__name__))
            break
        try:
            events = server.receive_data(client.data_to_send())
        except Exception as exc:
            out.append(("raised", type(exc).__name__, server.data_to_send()))
            break
        out.append([(type(e).__name__, getattr(e, "stream_id", None), list(getattr(e, "headers", None) or []))
                    for e in events])  # fmt: skip
        out.append(server.data_to_send())
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(_REQUEST, min_size=1, max_size=STREAMS), st.booleans())
def test_a_received_request_is_taken_or_refused_as_h2_would(blocks: list[list[Any]], trailers: bool) -> None:
    """Requests (most of them canonical, some not in one way or another) and,
    with ``trailers``, the same block again as trailers (pseudo-headers
    there are refused): the same events, frames back and errors with the
    short path as with h2's own checks."""
    assert _receive(True, blocks, trailers) == _receive(False, blocks, trailers)


def test_canonical_request_is_the_four_pseudo_headers_then_plain_fields() -> None:
    base = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"h:1"), (b":path", b"/v1/completions")]
    fields = [(b"content-type", b"application/json"), (b"content-length", b"12"), (b"user-agent", b"")]
    assert canonical_request(base + fields)
    assert not canonical_request(base[:3] + fields)  # no :path
    assert not canonical_request([base[0], *fields, *base[1:]])  # a pseudo-header after a field
    assert not canonical_request(base + base[:1])  # twice
    assert not canonical_request([(b":method", b"CONNECT"), *base[1:]])
    assert not canonical_request([*base[:3], (b":path", b"")])
    for name, value in [(b"Content-Type", b"x"), (b"host", b"h:1"), (b"cookie", b"a=1"), (b"te", b"trailers"),
                        (b"connection", b"close"), (b"x y", b"1"), (b"a", b" padded"), (b"a", b"nul\x00")]:
        assert not canonical_request([*base, (name, value)]), (name, value)


async def test_the_servers_requests_and_responses_take_the_short_path(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over h2c, a plain client's request header blocks and every response
    block the served app and hypercorn send are canonical (they skip h2's
    passes); over HTTP/1.1 none is looked at."""
    seen: dict[str, list[bool]] = {"canonical": [], "canonical_request": []}
    for name, check in (("canonical", canonical), ("canonical_request", canonical_request)):
        def spy(headers: Any, check: Any = check, log: list[bool] = seen[name]) -> bool:
            log.append(check(headers))
            return log[-1]

        monkeypatch.setattr(h2_headers, name, spy)
    url = await nursery.start(serve, health_app, ServeOptions(graceful_timeout=0.1))
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    await sock.send_all(conn.data_to_send())
    with trio.fail_after(10):
        events = await _h2_batch(sock, conn, [1, 3])
    await sock.aclose()
    statuses = [dict(e.headers)[b":status"] for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert statuses == [b"200", b"200"]
    assert seen == {"canonical": [True, True], "canonical_request": [True, True]}
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/health")).text == "ok"
    assert seen == {"canonical": [True, True], "canonical_request": [True, True]}


def test_the_inbound_options_are_kept_where_the_decoder_sets_them() -> None:
    """RequestCheckingDecoder reads and sets h2's two inbound options where
    h2's descriptors keep them; if h2 moved them, this fails (and the
    decoder would break or check nothing)."""
    config = h2.config.H2Configuration(client_side=False)
    for name in ("validate_inbound_headers", "normalize_inbound_headers"):
        assert vars(h2.config.H2Configuration)[name].attr_name == f"_{name}"
        setattr(config, f"_{name}", False)
        assert getattr(config, name) is False

"""The sans-I/O HTTP/2 client against h2's own server state machine (a
second implementation: what one sends, the other must read), byte splits
included, and the connection errors the RFC asks of a client."""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import h2wire
from backends.h2wire import ClientConnection, ErrorCode, ProtocolError

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"), (b":authority", b"backend")]


def _server(**values: int) -> h2.connection.H2Connection:
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    if values:
        server.local_settings = h2.settings.Settings(client=False, initial_values={getattr(h2.settings.SettingCodes, k): v for k, v in values.items()})
    server.initiate_connection()
    return server


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


class _Pair:
    """A ClientConnection and an h2 server, bytes carried between them in
    the pieces ``cuts`` makes; the client's events collected."""

    def __init__(self, cuts: list[int] | None = None, client: ClientConnection | None = None, **server_settings: int) -> None:
        self.client = client or ClientConnection(stream_window=1 << 18, connection_window=1 << 24)
        self.server = _server(**server_settings)
        self.cuts = cuts or []
        self.events: list[h2wire.Event] = []
        self.server_events: list[h2.events.Event] = []
        self.client.initiate()
        self.pump()

    def pump(self) -> None:
        for _ in range(8):
            to_server, to_client = self.client.data_to_send(), self.server.data_to_send()
            if not to_server and not to_client:
                return
            if to_server:
                self.server_events += self.server.receive_data(to_server)
            for piece in _split(to_client, self.cuts) if to_client else []:
                self.events += self.client.receive(piece)

    def of(self, kind: type, sid: int | None = None) -> list:
        return [e for e in self.events if type(e) is kind and (sid is None or e.stream_id == sid)]


def test_a_request_and_its_streamed_answer_with_trailers_over_h2s_server() -> None:
    p = _Pair()
    assert p.of(h2wire.SettingsChanged)  # the server's SETTINGS, acknowledged
    sid = p.client.send_headers(REQUEST, end_stream=False)
    p.client.send_data(sid, b'{"prompt": "x"}', end_stream=True)
    p.pump()
    got = [e for e in p.server_events if isinstance(e, h2.events.RequestReceived)]
    assert got and list(got[0].headers) == REQUEST
    assert b"".join(e.data for e in p.server_events if isinstance(e, h2.events.DataReceived)) == b'{"prompt": "x"}'
    p.server.send_headers(sid, [(b":status", b"100")])  # informational: skipped
    p.server.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/event-stream")])
    for i in range(3):
        p.server.send_data(sid, f"data: {i}\n\n".encode())
    p.server.send_headers(sid, [(b"x-usage", b"3")], end_stream=True)  # trailers
    p.pump()
    (response,) = p.of(h2wire.Response, sid)
    assert response.headers == [(b":status", b"200"), (b"content-type", b"text/event-stream")]
    assert b"".join(e.data for e in p.of(h2wire.Data, sid)) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(p.of(h2wire.Ended, sid)) == 1
    assert p.client.open_streams == 0  # closed both ways


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 5000), max_size=20), pad=st.integers(0, 40), streams=st.integers(1, 4),
       header_bytes=st.integers(0, 40_000), frame=st.sampled_from([16384, 20000]))  # fmt: skip
def test_any_split_of_the_servers_bytes_gives_the_same_answers(cuts: list[int], pad: int, streams: int, header_bytes: int, frame: int) -> None:
    """Padding, a header block in CONTINUATION frames (a large header), many
    streams interleaved, a larger frame size: the same bodies and headers
    however the bytes are cut into reads."""
    p = _Pair(cuts, MAX_FRAME_SIZE=frame)
    sids = [p.client.send_headers(REQUEST, end_stream=True) for _ in range(streams)]
    p.pump()
    big = [(b"x-big", b"v" * header_bytes)] if header_bytes else []
    for sid in sids:
        p.server.send_headers(sid, [(b":status", b"200"), *big])
    for i in range(3):
        for sid in sids:
            p.server.send_data(sid, f"{sid}:{i};".encode() * 50, pad_length=pad or None)
    for sid in sids:
        p.server.end_stream(sid)
    p.pump()
    for sid in sids:
        (response,) = p.of(h2wire.Response, sid)
        assert response.headers == [(b":status", b"200"), *big]
        assert b"".join(e.data for e in p.of(h2wire.Data, sid)) == b"".join(f"{sid}:{i};".encode() * 50 for i in range(3))
        # the flow-controlled length counts the padding (and its length byte)
        assert sum(e.flow for e in p.of(h2wire.Data, sid)) == sum(50 * len(f"{sid}:{i};") + (pad + 1 if pad else 0) for i in range(3))
        assert p.of(h2wire.Ended, sid)


def test_our_windows_are_granted_and_enforced_and_credit_reopens_them() -> None:
    client = ClientConnection(stream_window=100, connection_window=65535)
    p = _Pair(client=client)
    sid = client.send_headers(REQUEST, end_stream=True)
    p.pump()
    p.server.send_headers(sid, [(b":status", b"200")])
    assert p.server.local_flow_control_window(sid) == 100  # our SETTINGS reached it
    p.server.send_data(sid, b"a" * 100)
    p.pump()
    assert p.server.local_flow_control_window(sid) == 0
    assert client.window_update(100, sid) and client.window_update(100)
    assert not client.window_update(0) and not client.window_update(0, sid)  # never a WINDOW_UPDATE of 0
    p.pump()
    assert p.server.local_flow_control_window(sid) == 100
    # A server that overruns the stream's window: a connection error.
    overrun = struct.pack(">I", 150)[1:] + bytes([0, 0]) + struct.pack(">I", sid) + b"b" * 150
    with pytest.raises(ProtocolError) as info:
        client.receive(overrun)
    assert info.value.code == ErrorCode.FLOW_CONTROL_ERROR


def test_the_servers_windows_bound_what_we_send_and_settings_move_them() -> None:
    p = _Pair(INITIAL_WINDOW_SIZE=10)
    sid = p.client.send_headers(REQUEST, end_stream=False)
    assert p.client.send_window_of(sid) == 10
    p.client.send_data(sid, b"0123456789", end_stream=False)
    assert p.client.send_window_of(sid) == 0
    with pytest.raises(ValueError):
        p.client.send_data(sid, b"x", end_stream=False)
    p.pump()
    p.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 30})  # +20 to every open stream
    p.pump()
    assert p.client.send_window_of(sid) == 20 and p.of(h2wire.WindowOpened)
    p.server.increment_flow_control_window(5, stream_id=sid)
    p.pump()
    assert p.client.send_window_of(sid) == 25
    p.client.send_data(sid, b"y" * 25, end_stream=True)
    p.pump()
    body = b"".join(e.data for e in p.server_events if isinstance(e, h2.events.DataReceived))
    assert body == b"0123456789" + b"y" * 25


def test_resets_goaway_and_ping() -> None:
    p = _Pair()
    a, b, c = (p.client.send_headers(REQUEST, end_stream=True) for _ in range(3))
    p.pump()
    p.server.reset_stream(a, h2.errors.ErrorCodes.REFUSED_STREAM)
    p.server.send_headers(b, [(b":status", b"200")])
    p.server.ping(b"12345678")
    p.pump()
    assert [(e.stream_id, e.error_code) for e in p.of(h2wire.Reset)] == [(a, ErrorCode.REFUSED_STREAM)]
    assert any(isinstance(e, h2.events.PingAckReceived) for e in p.server_events)  # we acked its PING
    assert p.client.reset_stream(c) and not p.client.reset_stream(c)  # once
    p.pump()
    assert any(isinstance(e, h2.events.StreamReset) and e.stream_id == c for e in p.server_events)
    # DATA in flight when our reset arrived: absorbed, the connection credited.
    late = p.client.receive(_raw(0, 0, c, b"late"))
    assert [(type(e), e.stream_id, e.flow) for e in late] == [(h2wire.Data, 0, 4)]
    # GOAWAY is an event; the streams up to its last id go on.
    goaway = struct.pack(">I", 8)[1:] + bytes([7, 0]) + struct.pack(">III", 0, b, 0)
    data = struct.pack(">I", 2)[1:] + bytes([0, 1]) + struct.pack(">I", b) + b"ok"
    events = p.client.receive(goaway + data)
    assert [type(e) for e in events] == [h2wire.GoAway, h2wire.Data, h2wire.Ended]
    assert (events[0].last_stream_id, events[1].data) == (b, b"ok")


def _raw(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (_raw(0, 0, 3, b"x"), ErrorCode.PROTOCOL_ERROR),  # DATA for a stream never opened
        (_raw(0, 0, 2, b"x"), ErrorCode.PROTOCOL_ERROR),  # an even stream: the server's, which we disabled
        (_raw(0, 0, 0, b"x"), ErrorCode.PROTOCOL_ERROR),  # DATA on stream 0
        (_raw(5, 4, 1, b"\0\0\0\2"), ErrorCode.PROTOCOL_ERROR),  # PUSH_PROMISE
        (_raw(9, 4, 1, b""), ErrorCode.PROTOCOL_ERROR),  # CONTINUATION out of place
        (_raw(6, 0, 0, b"1234"), ErrorCode.FRAME_SIZE_ERROR),  # a short PING
        (_raw(4, 0, 0, b"12345"), ErrorCode.FRAME_SIZE_ERROR),  # SETTINGS not in 6s
        (_raw(4, 0, 0, b"\0\4\x80\0\0\0"), ErrorCode.FLOW_CONTROL_ERROR),  # INITIAL_WINDOW_SIZE 2^31
        (_raw(8, 0, 0, b"\0\0\0\0"), ErrorCode.PROTOCOL_ERROR),  # a connection WINDOW_UPDATE of 0
        (_raw(8, 0, 0, b"\x7f\xff\xff\xff"), ErrorCode.FLOW_CONTROL_ERROR),  # a connection window over 2^31-1
        (_raw(0, 8, 1, b"\5abc"), ErrorCode.PROTOCOL_ERROR),  # padding longer than its frame
        (_raw(0, 0, 1, b"x" * 16385), ErrorCode.FRAME_SIZE_ERROR),  # over our max frame size
        (_raw(1, 4, 1, b"\xff\xff\xff\xff"), ErrorCode.COMPRESSION_ERROR),  # a header block that does not decode
    ],
)
def test_what_the_rfc_makes_a_connection_error(frame: bytes, code: int) -> None:
    client = ClientConnection()
    client.initiate()
    client.send_headers(REQUEST, end_stream=True)  # stream 1 is open
    with pytest.raises(ProtocolError) as info:
        client.receive(frame)
    assert info.value.code == code


def test_a_header_block_interrupted_by_another_frame_is_a_connection_error() -> None:
    client = ClientConnection()
    client.send_headers(REQUEST, end_stream=True)
    with pytest.raises(ProtocolError, match="interrupted"):
        client.receive(_raw(1, 0, 1, b"\x88") + _raw(0, 0, 1, b"x"))


def test_stream_errors_reset_that_stream_only() -> None:
    """DATA before a stream's response headers, and trailers without
    END_STREAM, reset the stream (RST_STREAM queued, a Reset event); the
    connection and its other streams go on."""
    client = ClientConnection()
    a, b = client.send_headers(REQUEST, end_stream=True), client.send_headers(REQUEST, end_stream=True)
    client.data_to_send()
    events = client.receive(_raw(0, 0, a, b"early") + _raw(1, 4, b, b"\x88") + _raw(1, 4, b, b"\x88"))
    kinds = [(type(e).__name__, e.stream_id) for e in events]
    assert kinds == [("Reset", a), ("Data", 0), ("Response", b), ("Reset", b)]
    sent = client.data_to_send()
    assert len(sent) == 26 and sent[3] == sent[16] == 3  # two RST_STREAM frames (13 bytes each)
    assert (int.from_bytes(sent[9:13], "big"), int.from_bytes(sent[22:26], "big")) == (ErrorCode.PROTOCOL_ERROR, ErrorCode.PROTOCOL_ERROR)
    assert client.open_streams == 0


def test_stream_ids_run_out_as_a_refusal() -> None:
    client = ClientConnection()
    client._next_id = 2**31 - 1
    client.send_headers(REQUEST, end_stream=True)
    with pytest.raises(ProtocolError):
        client.send_headers(REQUEST, end_stream=True)


def test_an_answer_that_ends_before_our_body_closes_the_stream_when_the_body_ends() -> None:
    """A server may answer (and end its side) before the request body is
    in; the stream closes once our side ends, and DATA after the server's
    END_STREAM is a stream error (STREAM_CLOSED)."""
    client = ClientConnection()
    sid = client.send_headers(REQUEST, end_stream=False)
    events = client.receive(_raw(1, 4 | 1, sid, b"\x88"))  # :status 200, END_STREAM
    assert [type(e) for e in events] == [h2wire.Response, h2wire.Ended]
    assert client.open_streams == 1 and client.send_window_of(sid) > 0
    client.send_data(sid, b"rest", end_stream=True)
    assert client.open_streams == 0
    other = client.send_headers(REQUEST, end_stream=False)
    client.receive(_raw(1, 4 | 1, other, b"\x88"))
    events = client.receive(_raw(0, 0, other, b"more"))
    assert [(type(e), e.stream_id) for e in events] == [(h2wire.Reset, other), (h2wire.Data, 0)]
    assert events[0].error_code == ErrorCode.STREAM_CLOSED


def test_a_header_block_that_never_ends_is_bounded() -> None:
    """CONTINUATION frames without END_HEADERS (the CONTINUATION flood) are
    a connection error once the block is past twice our header list limit."""
    client = ClientConnection(max_header_list_size=1000)
    client.send_headers(REQUEST, end_stream=True)
    client.receive(_raw(1, 0, 1, b"\x88"))
    with pytest.raises(ProtocolError) as info:
        for _ in range(10):
            client.receive(_raw(9, 0, 1, b"\0" * 500))
    assert info.value.code == ErrorCode.COMPRESSION_ERROR


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from([b"content-type", b"x-a", b"x-b", b"server", b"date"]),
                           st.binary(min_size=0, max_size=40)), max_size=6),
        min_size=1, max_size=8,
    )
)
def test_response_header_blocks_that_index_fields_decode_as_hpacks_decoder_reads_them(
    blocks: list[list[tuple[bytes, bytes]]],
) -> None:
    """Blocks from hpack's encoder, which indexes fields into the dynamic
    table (later blocks refer to earlier ones): each stream's headers are
    what hpack's own decoder reads from the same bytes."""
    import hpack

    encoder, reference = hpack.Encoder(), hpack.Decoder()
    client = ClientConnection()
    for fields in blocks:
        sid = client.send_headers(REQUEST, end_stream=True)
        block = encoder.encode([(b":status", b"200"), *fields])
        events = client.receive(_raw(1, 4 | 1, sid, block))  # HEADERS, END_HEADERS | END_STREAM
        headers = next(e for e in events if isinstance(e, h2wire.Response)).headers
        assert headers == [(bytes(n), bytes(v)) for n, v in reference.decode(block, raw=True)]

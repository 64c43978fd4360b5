"""The lean h2 connection: header blocks any HPACK decoder reads back
exactly (with a fresh or a shrunk dynamic table), our decoder reading
exactly what hpack's reads and refusing what it refuses, and h2's frame
handling unchanged but for its trace line."""

from __future__ import annotations

import inspect
import re
import textwrap

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
from hpack import Decoder, Encoder
from hpack.struct import HeaderTuple, NeverIndexedHeaderTuple
from hpack.table import HeaderTable
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.h2lite import CACHE_FIELDS, LeanDecoder, LeanH2Connection, StatelessEncoder, _integer

_static_names = sorted({n for n, _ in HeaderTable.STATIC_TABLE})
_names = st.one_of(st.sampled_from(_static_names), st.binary(min_size=1, max_size=40).map(lambda b: b.hex().encode()))
_values = st.one_of(st.sampled_from([v for _, v in HeaderTable.STATIC_TABLE]), st.binary(max_size=300))
_field = st.tuples(_names, _values, st.booleans())
_blocks = st.lists(st.lists(_field, max_size=12), min_size=1, max_size=5)


def _as_headers(block: list[tuple[bytes, bytes, bool]]) -> list[HeaderTuple]:
    return [NeverIndexedHeaderTuple(n, v) if s else HeaderTuple(n, v) for n, v, s in block]


@settings(max_examples=200, deadline=None)
@given(blocks=_blocks, table=st.sampled_from([4096, 256, 0]))
def test_every_block_decodes_to_its_fields_and_their_sensitivity(blocks: list[list[tuple[bytes, bytes, bool]]], table: int) -> None:
    """A decoder whose table the peer lowered (``table``) before the first
    block, as SETTINGS_HEADER_TABLE_SIZE does, reads every block; the
    sensitive fields come back never-indexed, the others indexable."""
    encoder, decoder = StatelessEncoder(), Decoder()
    decoder.max_allowed_table_size = table
    encoder.header_table_size = table  # what h2 does on the peer's SETTINGS
    for block in blocks:
        got = decoder.decode(encoder.encode(_as_headers(block)), raw=True)
        assert [(h[0], h[1]) for h in got] == [(n, v) for n, v, _ in block]
        assert [isinstance(h, NeverIndexedHeaderTuple) for h in got] == [s for _, _, s in block]
        assert len(decoder.header_table.dynamic_entries) == 0  # nothing indexed, ever


def test_plain_and_three_tuples_and_str_are_accepted_as_hpacks_encoder_accepts_them() -> None:
    headers = [(":method", "POST"), ("authorization", "Bearer k", True), (b"x-id", b"1"), ("x-t", "é")]
    decoded = Decoder().decode(StatelessEncoder().encode(headers), raw=True)
    assert Decoder().decode(Encoder().encode(headers), raw=True) == decoded
    assert isinstance(decoded[1], NeverIndexedHeaderTuple)


def test_static_fields_are_one_byte_and_the_first_block_announces_a_table_of_zero() -> None:
    encoder = StatelessEncoder()
    first = encoder.encode([(b":method", b"POST"), (b":scheme", b"http")])
    assert first == b"\x20\x83\x86"  # size update 0, then static indices 3 and 6
    assert encoder.encode([(b":method", b"POST")]) == b"\x83"  # once per connection


@pytest.mark.parametrize(("value", "bits", "want"), [(10, 5, b"\x0a"), (1337, 5, b"\x1f\x9a\x0a"), (42, 8, b"\x2a"), (31, 5, b"\x1f\x00"), (127, 7, b"\x7f\x00")])
def test_integers_are_rfc_7541s_examples(value: int, bits: int, want: bytes) -> None:
    assert _integer(value, bits, 0) == want  # RFC 7541 C.1, and each prefix's edge


def test_the_field_cache_is_bounded() -> None:
    encoder = StatelessEncoder()
    for i in range(CACHE_FIELDS + 100):
        encoder.encode([(b"x-request-id", str(i).encode())])
    assert len(encoder._cache) == CACHE_FIELDS


def test_a_lean_client_and_a_stock_h2_server_exchange_requests_and_a_table_size_change() -> None:
    """Over h2's own state machines: the server lowers its header table to
    0 and the client's requests still decode, stream after stream."""
    client = LeanH2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    for stream_id in (1, 3, 5):
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"),
                   (b":authority", b"127.0.0.1:8000"), (b"x-request-id", str(stream_id).encode())]  # fmt: skip
        client.send_headers(stream_id, headers, end_stream=True)
        events = server.receive_data(client.data_to_send())
        got = next(e for e in events if isinstance(e, h2.events.RequestReceived))
        assert list(got.headers) == headers


def test_h2s_receive_frame_is_still_the_one_lean_copies() -> None:
    """If this fails, h2 changed ``H2Connection._receive_frame``: copy it
    again into backends/h2lite.py, less its trace line."""
    def body(f: object) -> list[str]:
        src = textwrap.dedent(inspect.getsource(f))  # type: ignore[arg-type]
        src = re.sub(r'""".*?"""', "", src, flags=re.S)
        lines = [line.split("#")[0].rstrip() for line in src.splitlines()]
        return [line for line in lines if line.strip() and "logger.trace" not in line and not line.lstrip().startswith("def ")]

    assert body(h2.connection.H2Connection._receive_frame) == body(LeanH2Connection._receive_frame)


# ---------------------------------------------------------------- decoding


def _outcome(decoder: object, block: bytes) -> object:
    """The fields, or "error" for any refusal h2 turns into a connection error."""
    try:
        return [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]  # type: ignore[attr-defined]
    except (hpack.HPACKError, IndexError, TypeError, UnicodeDecodeError):
        return "error"


@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(st.lists(_field, max_size=12), min_size=1, max_size=6), huffman=st.booleans(),
       table=st.sampled_from([4096, 256, 0]))
def test_the_lean_decoder_reads_what_hpacks_encoder_writes_as_hpacks_decoder_does(
    blocks: list[list[tuple[bytes, bytes, bool]]], huffman: bool, table: int,
) -> None:
    """hpack's encoder indexes (so the dynamic table fills, evicts and,
    with ``table``, shrinks), Huffman-codes or not: block after block, both
    decoders give the same fields and keep the same table."""
    encoder, ours, theirs = Encoder(), LeanDecoder(), Decoder()
    encoder.header_table_size = table
    for block in blocks:
        data = encoder.encode(_as_headers(block), huffman=huffman)
        assert _outcome(ours, data) == _outcome(theirs, data) == [(n, v) for n, v, _ in block]
        assert list(ours.table) == [tuple(e) for e in theirs.header_table.dynamic_entries]


@settings(max_examples=500, deadline=None)
@given(prefix=st.lists(st.lists(_field, max_size=4), max_size=2), noise=st.binary(max_size=60))
def test_the_lean_decoder_refuses_what_hpack_refuses_and_reads_the_rest_alike(
    prefix: list[list[tuple[bytes, bytes, bool]]], noise: bytes,
) -> None:
    """Arbitrary bytes after a few real blocks (so there is a dynamic table
    to index into): the same fields, or an error from both."""
    encoder, ours, theirs = Encoder(), LeanDecoder(), Decoder()
    for block in prefix:
        data = encoder.encode(_as_headers(block))
        assert _outcome(ours, data) == _outcome(theirs, data)
    assert _outcome(ours, noise) == _outcome(theirs, noise)


def test_the_header_list_limit_counts_as_the_list_grows() -> None:
    """One 4 KiB field indexed, then referenced from a 40-byte block: the
    list is refused at the field that crosses the limit (RFC 9113 6.5.2
    sizes), not after building it whole."""
    encoder, decoder = Encoder(), LeanDecoder()
    decoder.max_header_list_size = 16 * 1024
    big = (b"x-big", b"v" * 4000)
    assert decoder.decode(encoder.encode([big]), raw=True) == [big]
    assert len(decoder.decode(encoder.encode([big] * 4), raw=True)) == 4  # 4 x 4037 bytes: within
    with pytest.raises(hpack.OversizedHeaderListError):
        decoder.decode(encoder.encode([big] * 5), raw=True)


def test_table_size_updates_must_open_the_block_and_stay_within_our_setting() -> None:
    decoder = LeanDecoder()
    decoder.max_allowed_table_size = 256
    with pytest.raises(hpack.InvalidTableSizeError):
        decoder.decode(b"\x3f\xe1\x1f", raw=True)  # an update to 4096
    assert decoder.decode(b"\x3f\xe1\x01\x82", raw=True) == [(b":method", b"GET")]  # to 256, then a field
    assert decoder.max_size == 256
    with pytest.raises(hpack.HPACKDecodingError):
        decoder.decode(b"\x82\x20", raw=True)  # a field, then an update
    shrunk = LeanDecoder()
    shrunk.max_allowed_table_size = 0  # our SETTINGS lowered it; the peer never says it followed
    with pytest.raises(hpack.InvalidTableSizeError):
        shrunk.decode(b"\x82", raw=True)


def test_a_guarded_connection_decodes_with_the_lean_decoder_and_keeps_h2s_list_limit() -> None:
    """Through h2's state machines: requests decode, and an oversized list
    is h2's DenialOfServiceError, as with hpack's decoder."""
    server = LeanH2Connection(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
    client = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
    assert isinstance(server.decoder, LeanDecoder)
    assert server.decoder.max_header_list_size == Decoder().max_header_list_size
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    request = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"),
               (b":authority", b"127.0.0.1"), (b"content-type", b"application/json")]  # fmt: skip
    client.send_headers(1, request, end_stream=True)
    got = next(e for e in server.receive_data(client.data_to_send()) if isinstance(e, h2.events.RequestReceived))
    assert list(got.headers) == request
    server.decoder.max_header_list_size = 1024
    client.send_headers(3, [*request, (b"x-big", b"v" * 2000)], end_stream=True)
    with pytest.raises(h2.exceptions.DenialOfServiceError):
        server.receive_data(client.data_to_send())


# ---------------------------------------------------------------- DATA frames


_REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"), (b":authority", b"x")]
_send = st.tuples(
    st.sampled_from([1, 3, 5, 7, 9]),  # 7: never opened; 9: reset by the client
    st.one_of(st.integers(0, 40), st.integers(0, 20_000)),  # sizes: small, and past a frame (16 KiB) or a window
    st.booleans(),  # end_stream
    st.one_of(st.none(), st.integers(0, 4)),  # pad_length
    st.booleans(),  # as a memoryview
)


def _state(conn: h2.connection.H2Connection) -> object:
    streams = {sid: (s.state_machine.state, s.outbound_flow_control_window) for sid, s in conn.streams.items()}
    return conn.outbound_flow_control_window, conn.state_machine.state, streams


@settings(max_examples=300, deadline=None)
@given(window=st.sampled_from([65_535, 100, 10]), sends=st.lists(_send, max_size=14), goaway=st.booleans())
def test_lean_send_data_frames_windows_and_states_as_h2s_does(
    window: int, sends: list[tuple[int, int, bool, int | None, bool]], goaway: bool
) -> None:
    """Two servers, h2's and the lean one, get the same client bytes and the
    same ``send_data`` calls: each call raises the same error or none, and
    leaves the same bytes to send, windows and stream states. Streams half
    closed by the request and open, ended, reset, never opened; windows that
    the data exceeds; frames too large; padding; memoryviews; a closed
    connection."""
    client = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.local_settings = h2.settings.Settings(client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    client.initiate_connection()
    client.send_headers(1, _REQUEST, end_stream=True)  # half closed (remote) at the server: a request read whole
    client.send_headers(3, _REQUEST)  # open: a request body still coming
    client.send_headers(5, _REQUEST, end_stream=True)
    client.send_headers(9, _REQUEST, end_stream=True)
    client.reset_stream(9)
    wire = client.data_to_send()
    servers = [cls(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
               for cls in (h2.connection.H2Connection, LeanH2Connection)]  # fmt: skip
    for server in servers:
        server.initiate_connection()
        server.receive_data(wire)
        for sid in (1, 3, 5):
            server.send_headers(sid, [(b":status", b"200")])
        if goaway:
            server.close_connection()
        server.data_to_send()
    stock, lean = servers
    for sid, size, end, pad, view in sends:
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        outcomes = []
        for server in servers:
            try:
                server.send_data(sid, memoryview(data) if view else data, end_stream=end, pad_length=pad)
            except Exception as exc:  # the same refusal, whichever it is
                outcomes.append(type(exc))
            else:
                outcomes.append(None)
        assert outcomes[0] == outcomes[1], (sid, size, end, pad)
        assert lean.data_to_send() == stock.data_to_send()
        assert _state(lean) == _state(stock)


def test_lean_send_data_frames_the_common_case_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A response's DATA within its windows never reaches h2's ``send_data``
    (ending the stream or not), and what it wrote reads back at a stock
    client as that data, the end, and nothing else."""
    client = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = LeanH2Connection(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.send_headers(1, _REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200")])
    calls: list[int] = []
    stock = h2.connection.H2Connection.send_data
    monkeypatch.setattr(h2.connection.H2Connection, "send_data", lambda self, *a, **k: (calls.append(1), stock(self, *a, **k))[1])
    server.send_data(1, b"data: one\n\n")
    server.send_data(1, b"data: two\n\n", end_stream=True)
    assert calls == []
    events = client.receive_data(server.data_to_send())
    assert [e.data for e in events if isinstance(e, h2.events.DataReceived)] == [b"data: one\n\n", b"data: two\n\n"]
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    with pytest.raises(h2.exceptions.StreamClosedError):
        server.send_data(1, b"late")  # closed: h2's own refusal
    assert calls == [1]


def test_indices_at_the_one_byte_edge_and_index_zero_read_as_hpack_reads_them() -> None:
    """Indexed fields and indexed names one below, at and past the prefix's
    one-byte limit (126, 127, 128 for a 7-bit prefix; 14, 15 for a 4-bit
    one) read the same entries as hpack's decoder, over a dynamic table of
    70 fields; index 0 is refused by both."""
    table = b"".join(b"\x40" + bytes([2]) + b"n%d" % (i % 10) + bytes([2]) + b"%02d" % i for i in range(70))  # with indexing
    reads = [b"\xfe", b"\xff\x00", b"\xff\x01", b"\x0e\x01v", b"\x0f\x00\x01v", b"\x7e\x01v", b"\x7f\x00\x01v"]
    for read in reads:
        ours, theirs = LeanDecoder(), Decoder()
        assert _outcome(ours, table) == _outcome(theirs, table)
        assert _outcome(ours, read) == _outcome(theirs, read) != "error", read
    for zero in (b"\x80", b"\x80\x82"):
        assert _outcome(LeanDecoder(), zero) == _outcome(Decoder(), zero) == "error"

"""frontend/serving.py: connections are not recycled after 1,000 requests,
closing a connection waits for a send in progress (hypercorn's send_eof
outside its send lock), and the hypercorn internals the patches rely on
still have the shape they had when the patches were written."""

from __future__ import annotations

import ast
import errno
import importlib.metadata
import inspect
import time
from functools import partial
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import msgspec
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.tcp_server import TCPServer

from frontend import hardening, serving
from frontend.serving import ServeOptions, reserve_port, serve

# ---------------------------------------------------------------- 1,000 requests


async def health_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _h2_batch(sock: trio.SocketStream, conn: h2.connection.H2Connection, stream_ids: list[int]) -> list[h2.events.Event]:
    headers = [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "127.0.0.1")]
    for stream_id in stream_ids:
        conn.send_headers(stream_id, headers, end_stream=True)
    await sock.send_all(conn.data_to_send())
    pending, seen = set(stream_ids), []
    while pending:
        data = await sock.receive_some(65536)
        assert data, "the server closed the connection"
        for event in conn.receive_data(data):
            seen.append(event)
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                pending.discard(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                return seen
        await sock.send_all(conn.data_to_send())
    return seen


async def test_an_h2_connection_serves_more_than_1000_requests(nursery: trio.Nursery) -> None:
    """hypercorn closes a connection after keep_alive_max_requests (default
    1,000) requests; ours never do by default: 1,100 requests on one h2
    connection all get 200 and no GOAWAY."""
    url = await nursery.start(serve, health_app, ServeOptions(graceful_timeout=0.1))
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    await sock.send_all(conn.data_to_send())
    statuses: list[bytes] = []
    stream_ids = iter(range(1, 2 * 1100, 2))
    with trio.fail_after(30):
        for _ in range(11):
            events = await _h2_batch(sock, conn, [next(stream_ids) for _ in range(100)])
            assert not [e for e in events if isinstance(e, h2.events.ConnectionTerminated | h2.events.StreamReset)]
            statuses += [dict(e.headers)[b":status"] for e in events if isinstance(e, h2.events.ResponseReceived)]
    await sock.aclose()
    assert statuses == [b"200"] * 1100


def test_keep_alive_max_requests_is_passed_to_hypercorn() -> None:
    assert ServeOptions(keep_alive_max_requests=5).hypercorn_config().keep_alive_max_requests == 5
    assert ServeOptions().hypercorn_config().keep_alive_max_requests > 2**31  # more than h2 stream ids


# ---------------------------------------------------------------- send_eof under the send lock


class CheckpointingStream:
    """A stream that, like trio's SocketStream, fails with BusyResourceError
    when two tasks send (data or EOF) at once, and checkpoints inside both."""

    def __init__(self, *, eof_gate: trio.Event | None = None, send_gate: trio.Event | None = None) -> None:
        self.busy = False
        self.sent: list[bytes] = []
        self.log: list[str] = []
        self.eof = self.closed = False
        self.in_eof = trio.Event()
        self.in_send = trio.Event()
        self.eof_gate = eof_gate
        self.send_gate = send_gate
        self.send_error: type[Exception] | None = None

    def _enter(self) -> None:
        if self.busy:
            raise trio.BusyResourceError("another task is using this stream")
        self.busy = True

    async def send_all(self, data: bytes) -> None:
        if self.eof or self.closed:
            raise trio.ClosedResourceError("can't send data after sending EOF")
        self._enter()
        try:
            self.in_send.set()
            if self.send_error is not None:
                raise self.send_error()
            if self.send_gate is not None:
                await self.send_gate.wait()
            await trio.lowlevel.checkpoint()
            if self.closed:
                raise trio.ClosedResourceError("closed while sending")
            self.sent.append(data)
            self.log.append("data")
        finally:
            self.busy = False

    async def send_eof(self) -> None:
        self._enter()
        try:
            self.in_eof.set()
            if self.eof_gate is not None:
                await self.eof_gate.wait()
            await trio.lowlevel.checkpoint()
            self.eof = True
            self.log.append("eof")
        finally:
            self.busy = False

    async def aclose(self) -> None:
        self.closed = True
        self.log.append("close")
        for gate in (self.eof_gate, self.send_gate):  # wakes blocked calls, as trio's notify_closing does
            if gate is not None:
                gate.set()
        await trio.lowlevel.checkpoint()


class RecordingProtocol:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def handle(self, event: object) -> None:
        self.events.append(event)


def tcp_server(stream: CheckpointingStream) -> tuple[TCPServer, RecordingProtocol]:
    server = TCPServer(None, HypercornConfig(), None, {}, stream)  # type: ignore[arg-type]
    protocol = RecordingProtocol()
    server.protocol = protocol  # type: ignore[assignment]
    return server, protocol


async def test_a_send_that_starts_while_eof_is_being_sent_does_not_raise_busy() -> None:
    """hypercorn sent EOF outside the send lock: a send_all that took the lock
    meanwhile raised BusyResourceError out of protocol_send. Now the send waits
    for the EOF, then fails as a closed stream, which the protocol is told."""
    gate = trio.Event()
    stream = CheckpointingStream(eof_gate=gate)
    server, protocol = tcp_server(stream)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.protocol_send, Closed())
            await stream.in_eof.wait()
            nursery.start_soon(server.protocol_send, RawData(b"late"))
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert stream.log == ["eof", "close"]
    assert stream.sent == []
    assert [type(e) for e in protocol.events] == [Closed, Closed]


async def test_closing_waits_for_the_send_in_progress_then_sends_eof() -> None:
    gate = trio.Event()
    stream = CheckpointingStream(send_gate=gate)
    server, _ = tcp_server(stream)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.protocol_send, RawData(b"body"))
            await stream.in_send.wait()
            nursery.start_soon(server.protocol_send, Closed())
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert stream.log == ["data", "eof", "close"]


async def test_a_send_that_fails_and_closes_under_the_lock_does_not_deadlock() -> None:
    """The task holding the send lock can itself close the connection (its
    send failed; the protocol reacts with Closed): it must not wait for itself."""
    stream = CheckpointingStream()
    stream.send_error = trio.BrokenResourceError
    server, protocol = tcp_server(stream)

    async def close_on_closed(event: object) -> None:
        protocol.events.append(event)
        if len(protocol.events) == 1:
            await server.protocol_send(Closed())

    protocol.handle = close_on_closed  # type: ignore[method-assign]
    with trio.fail_after(5):
        await server.protocol_send(RawData(b"x"))
    assert stream.log == ["eof", "close"]


async def test_a_send_stuck_on_a_peer_that_stopped_reading_does_not_keep_the_connection_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = CheckpointingStream(send_gate=trio.Event())  # never set: the peer never reads
    server, _ = tcp_server(stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.protocol_send, RawData(b"body"))
        await stream.in_send.wait()
        start = trio.current_time()
        await server.protocol_send(Closed())
        assert stream.closed
        assert trio.current_time() - start == pytest.approx(serving.CLOSE_SEND_WAIT)
    assert stream.log == ["close"] and stream.sent == []


async def test_a_cancelled_close_still_closes_the_socket() -> None:
    stream = CheckpointingStream(eof_gate=trio.Event())
    server, _ = tcp_server(stream)
    with trio.move_on_after(0.05):
        await server.protocol_send(Closed())
    assert stream.closed


# ---------------------------------------------------------------- the shape of patched internals

TESTED_SERIES = "0.18."


def _class_node(module: object, name: str) -> ast.ClassDef:
    tree = ast.parse(Path(inspect.getsourcefile(module) or "").read_text())  # type: ignore[arg-type]
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> dict[str, list[str]]:
    return {
        n.name: [a.arg for a in n.args.args]
        for n in cls.body
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)
    }


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    return {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Assign | ast.AnnAssign)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def _source(module: object) -> str:
    return Path(inspect.getsourcefile(module) or "").read_text()  # type: ignore[arg-type]


def test_hypercorn_is_the_series_the_patches_were_written_for() -> None:
    """If this fails, hypercorn was upgraded: re-read the internals patched in
    frontend/serving.py (_patch_hypercorn), re-run this file, then move
    TESTED_SERIES and the pin in pyproject.toml together."""
    assert importlib.metadata.version("hypercorn").startswith(TESTED_SERIES)


def test_the_h2_protocol_internals_the_patches_use_are_unchanged() -> None:
    from hypercorn.protocol import h2 as hypercorn_h2

    cls = _class_node(hypercorn_h2, "H2Protocol")
    methods = _methods(cls)
    assert methods["_handle_events"] == ["self", "events"]
    assert methods["stream_send"] == ["self", "event"]
    assert methods["_flush"] == ["self"]
    assert methods["_window_updated"] == ["self", "stream_id"]
    assert methods["_send_data"] == ["self", "stream_id"]
    assert methods["handle"] == ["self", "event"]  # Closed: the buffers are closed after it
    assert {"stream_buffers", "priority"} <= _self_attributes(cls)
    # the original _send_data we replace: pop, send_data, then end_stream when complete
    original = ast.get_source_segment(_source(hypercorn_h2), next(
        n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "_send_data"
    )) or ""
    for line in ("await self.stream_buffers[stream_id].pop(chunk_size)", "self.connection.end_stream(stream_id)",
                 "self.priority.remove_stream(stream_id)", "self.priority.block(stream_id)"):
        assert line in original, line
    assert _class_node(hypercorn_h2, "StreamBuffer")  # .complete: set_complete() and empty
    assert "return self._complete and len(self.buffer) == 0" in _source(hypercorn_h2)
    assert {"streams", "connection", "keep_alive_requests"} <= _self_attributes(cls)
    # DATA for an unknown stream is still a KeyError in _handle_events (patch 1)
    assert "self.streams[event.stream_id].handle(" in _source(hypercorn_h2)
    # the connection-level limit we lift is still compared this way (h2: >, h11: >=)
    assert "self.keep_alive_requests > self.config.keep_alive_max_requests" in _source(hypercorn_h2)
    # _wake_the_sender_only_for_a_buffer replaces _close_stream: pop, StreamClosed, wake the sender
    close = ast.get_source_segment(_source(hypercorn_h2), next(
        n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "_close_stream")) or ""
    assert [line.strip() for line in close.splitlines()[1:]] == [
        "if stream_id in self.streams:", "stream = self.streams.pop(stream_id)",
        "await stream.handle(StreamClosed(stream_id=stream_id))", "await self.has_data.set()"]


def test_the_h11_keep_alive_limit_is_unchanged() -> None:
    from hypercorn.protocol import h11 as hypercorn_h11

    assert "self.keep_alive_requests >= self.config.keep_alive_max_requests" in _source(hypercorn_h11)
    assert HypercornConfig.keep_alive_max_requests == 1000


def test_the_h11_internals_the_whole_response_path_uses_are_unchanged() -> None:
    """serving's whole_h11_send writes what H11Protocol.stream_send writes
    for Response (status >= 200), Body and EndBody, joined in one write."""
    from hypercorn.protocol import h11 as hypercorn_h11

    cls = _class_node(hypercorn_h11, "H11Protocol")
    source = ast.get_source_segment(_source(hypercorn_h11), next(
        n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "stream_send")) or ""
    for line in ('headers = list(chain(event.headers, self.config.response_headers("h11")))',
                 'headers.append((b"connection", b"close"))', "h11.Data(data=event.data)", "h11.EndOfMessage()"):  # fmt: skip
        assert line in source, line
    assert {"connection", "keep_alive_requests", "config", "send"} <= _self_attributes(cls)
    # _recycle_after_an_answer_given_at_content_length: keep-alive is decided on both sides being DONE
    recycle = ast.get_source_segment(_source(hypercorn_h11), next(
        n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "_maybe_recycle")) or ""
    assert "self.connection.our_state is h11.DONE" in recycle and "self.connection.their_state is h11.DONE" in recycle


def test_the_http_stream_internals_the_patches_use_are_unchanged() -> None:
    from hypercorn.protocol import events, http_stream

    assert http_stream.ASGIHTTPState.RESPONSE  # the state a stream is in mid-body
    cls = _class_node(http_stream, "HTTPStream")
    assert {"state", "closed", "response", "scope", "send", "config", "start_time", "stream_id"} <= _self_attributes(cls)
    assert "stream_id" in events.StreamClosed.__dataclass_fields__
    # the whole-response path (serving._send_whole_responses_in_one_write) holds the start as
    # app_send would take it, and closes as _send_closed does, less the EndBody
    source = _source(http_stream)
    assert 'if message["type"] == "http.response.start" and self.state == ASGIHTTPState.REQUEST:' in source
    closed = ast.get_source_segment(source, next(
        n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "_send_closed")) or ""
    for line in ("await self.send(EndBody(stream_id=self.stream_id))", "self.state = ASGIHTTPState.CLOSED",
                 "await self.config.log.access(self.scope, self.response, time() - self.start_time)",
                 "await self.send(StreamClosed(stream_id=self.stream_id))"):  # fmt: skip
        assert line in closed, line
    assert "suppress_body(self.scope[\"method\"], int(self.response[\"status\"]))" in source
    assert "build_and_validate_headers(self.response.get(\"headers\", []))" in source


def test_the_tcp_server_internals_the_patches_use_are_unchanged() -> None:
    from hypercorn.trio import tcp_server

    cls = _class_node(tcp_server, "TCPServer")
    methods = _methods(cls)
    assert methods["run"] == ["self"]
    assert methods["_close"] == ["self"]
    assert methods["protocol_send"] == ["self", "event"]
    assert {"send_lock", "stream", "protocol"} <= _self_attributes(cls)
    # protocol_send still sends under send_lock and closes through _close
    source = ast.get_source_segment(_source(tcp_server), next(
        n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "protocol_send"
    )) or ""
    assert "async with self.send_lock:" in source and "await self._close()" in source
    # frontend/hardening.py's IdleDeadline stands in for idle_task: the same calls, the same close
    assert methods["_initiate_server_close"] == ["self"] and methods["_idle_timeout"] == ["self"]
    assert {"idle_task", "context", "config"} <= _self_attributes(cls)
    calls = _source(tcp_server)
    assert "self.idle_task.restart(self._task_group, self._idle_timeout)" in calls
    assert "await self.idle_task.stop()" in calls


def test_the_hypercorn_entry_points_serve_uses_are_unchanged() -> None:
    from hypercorn.trio import serve as hypercorn_serve

    params = inspect.signature(hypercorn_serve).parameters
    assert {"shutdown_trigger", "task_status", "mode"} <= set(params)
    assert 'bind.startswith("fd://")' in _source(HypercornConfig)  # reuse_port hands over a socket this way


def test_the_patches_are_installed() -> None:
    from hypercorn.protocol import h2 as hypercorn_h2
    from hypercorn.protocol import h11 as hypercorn_h11

    assert getattr(hypercorn_h2.H2Protocol, "_headrace_patched", False)
    assert TCPServer._close.__module__ == serving.__name__
    # frontend/hardening.py's wrappers go outside serving's own
    for method in (TCPServer.run, TCPServer.protocol_send, TCPServer._read_data, hypercorn_h2.H2Protocol.__init__,
                   hypercorn_h2.H2Protocol._create_stream, hypercorn_h2.H2Protocol._handle_events,
                   hypercorn_h2.H2Protocol.stream_send, hypercorn_h11.H11Protocol._create_stream):  # fmt: skip
        assert method.__module__ == hardening.__name__, method
    assert hypercorn_h2.StreamBuffer is hardening.StreamBuffer
    assert HTTPStream.app_send.__module__ == serving.__name__


# ---------------------------------------------------------------- the shape of frontend/hardening.py's internals


def test_the_h2_series_the_guarded_connection_was_written_for() -> None:
    """hardening.GuardedH2Connection subclasses h2's H2Connection and
    overrides _receive_frame and _receive_headers_frame: if this fails, re-read
    them, re-run tests/hardening, then move this check (and pin h2 <5)."""
    assert importlib.metadata.version("h2").startswith("4.")


def test_the_h2_internals_the_guarded_connection_uses_are_unchanged() -> None:
    import h2.connection
    import h2.errors
    import h2.exceptions
    from hyperframe.frame import HeadersFrame

    cls = _class_node(h2.connection, "H2Connection")
    methods = _methods(cls)
    assert methods["_receive_frame"] == ["self", "frame"]
    assert methods["_receive_headers_frame"] == ["self", "frame"]
    assert methods["reset_stream"] == ["self", "stream_id", "error_code"]
    source = _source(h2.connection)
    # the frame loop calls _receive_frame, and answers any ProtocolError with GOAWAY(its code)
    assert "events.extend(self._receive_frame(frame))" in source
    assert "self._terminate_connection(e.error_code)" in source
    # the concurrency check we lift for a stream we then refuse
    headers = ast.get_source_segment(source, next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_receive_headers_frame"
    )) or ""
    for line in ("value = self.open_inbound_streams", "max_open_streams = self.local_settings.max_concurrent_streams",
                 "raise TooManyStreamsError(msg)", "stream.receive_headers("):  # fmt: skip
        assert line in headers, line
    assert isinstance(inspect.getattr_static(h2.connection.H2Connection, "open_inbound_streams"), property)
    assert h2.exceptions.DenialOfServiceError.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    # the dispatch table is built from bound methods in __init__, so a subclass's override is used
    conn = hardening.GuardedH2Connection()
    assert conn._frame_dispatch_table[HeadersFrame] == conn._receive_headers_frame


def test_the_h2_frame_buffer_and_header_decoding_the_guarded_connection_relies_on_are_unchanged() -> None:
    """_FrameBuffer peeks at FrameBuffer._data before h2 parses a frame (a
    SETTINGS ack with a payload: FRAME_SIZE_ERROR); HPACK decoding errors
    reach _receive_headers_frame as a plain ProtocolError caused by the
    HPACKError (made COMPRESSION_ERROR there); the connection reads through
    ``self.incoming_buffer``, which GuardedH2Connection replaces."""
    import h2.connection
    import h2.frame_buffer

    buffer = h2.frame_buffer.FrameBuffer(server=False)
    buffer.add_data(b"\0" * 9)
    assert isinstance(buffer._data, bytearray) and bytes(buffer._data) == b"\0" * 9
    source = _source(h2.connection)
    assert "self.incoming_buffer = FrameBuffer(server=not self.config.client_side)" in source
    assert "for frame in self.incoming_buffer:" in source
    assert "except (HPACKError, IndexError, TypeError, UnicodeDecodeError) as e:" in source
    assert 'msg = f"Error decoding header block: {e}"\n        raise ProtocolError(msg) from e' in source
    assert isinstance(hardening.GuardedH2Connection().incoming_buffer, hardening._FrameBuffer)


def test_the_hypercorn_tls_hooks_serving_uses_are_unchanged() -> None:
    """serving._Config hands hypercorn its own (reloadable) context through
    create_ssl_context, which worker_serve calls once per server."""
    from hypercorn import config as hypercorn_config
    from hypercorn.trio import run

    assert _methods(_class_node(hypercorn_config, "Config"))["create_ssl_context"] == ["self"]
    assert "ssl_context = config.create_ssl_context()" in _source(run)
    assert isinstance(hypercorn_config.Config.ssl_handshake_timeout, (int, float))


def test_the_hypercorn_internals_hardening_uses_are_unchanged() -> None:
    from hypercorn.protocol import h2 as hypercorn_h2
    from hypercorn.protocol import h11 as hypercorn_h11
    from hypercorn.trio import tcp_server

    h2_source = _source(hypercorn_h2)
    # the buffer is made by name, once per stream, and used through these methods only
    assert "self.stream_buffers[request.stream_id] = StreamBuffer(self.context.event_class)" in h2_source
    used = set(__import__("re").findall(r"self\.stream_buffers\[[^]]+\]\.(\w+)", h2_source))
    assert used <= {"push", "pop", "drain", "close", "set_complete", "complete"}, used
    # the connection is h2's, set up in __init__ as _guarded_connection copies it
    assert "self.connection = h2.connection.H2Connection(" in h2_source
    assert "self.connection.DEFAULT_MAX_INBOUND_FRAME_SIZE = config.h2_max_inbound_frame_size" in h2_source
    assert "self.connection.local_settings = h2.settings.Settings(" in h2_source
    # a protocol error while reading: flush (the GOAWAY) and close
    handle = ast.get_source_segment(h2_source, next(
        n for n in _class_node(hypercorn_h2, "H2Protocol").body if isinstance(n, ast.AsyncFunctionDef) and n.name == "handle"
    )) or ""
    assert "except h2.exceptions.ProtocolError:" in handle and "await self.send(Closed())" in handle
    # stream_send lets our WriteStalled through (it catches only these)
    assert "BufferCompleteError,\n            KeyError,\n            priority.MissingStreamError,\n            h2.exceptions.ProtocolError," in h2_source
    assert _methods(_class_node(hypercorn_h2, "H2Protocol"))["_create_stream"] == ["self", "request"]
    assert _methods(_class_node(hypercorn_h2, "H2Protocol"))["_close_stream"] == ["self", "stream_id"]
    # H11: _create_stream(request) and the error response we send for CL + TE
    h11_methods = _methods(_class_node(hypercorn_h11, "H11Protocol"))
    assert h11_methods["_create_stream"] == ["self", "request"]
    assert h11_methods["_send_error_response"] == ["self", "status_code"]
    assert "await self._create_stream(event)" in _source(hypercorn_h11)
    # TCPServer: the reader, the idle task, per-connection config read in run
    tcp = _source(tcp_server)
    methods = _methods(_class_node(tcp_server, "TCPServer"))
    assert methods["_read_data"] == ["self"]
    assert "await self.idle_task.restart(self._task_group, self._idle_timeout)" in tcp
    assert "with trio.move_on_after(self.config.keep_alive_timeout):" in tcp
    assert "self.config,\n                    self.context,\n                    task_group," in tcp  # ProtocolWrapper gets self.config


# ---------------------------------------------------------------- SO_REUSEPORT


def named_app(name: bytes) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": name})

    return app


async def test_servers_with_reuse_port_share_a_reserved_port(nursery: trio.Nursery) -> None:
    """Two servers bound with reuse_port to the port a reserve_port socket
    holds both accept connections on it (the kernel spreads them)."""
    reserved = reserve_port("127.0.0.1")
    port = reserved.getsockname()[1]
    try:
        for name in (b"a", b"b"):
            url = await nursery.start(serve, named_app(name), ServeOptions(port=port, reuse_port=True, graceful_timeout=0.1))
            assert url == f"http://127.0.0.1:{port}"
        seen: set[bytes] = set()
        with trio.fail_after(10):
            for _ in range(64):  # new connections; one server for all has odds 2**-63
                async with httpx.AsyncClient() as client:
                    seen.add((await client.get(f"http://127.0.0.1:{port}/")).content)
                if seen == {b"a", b"b"}:
                    break
        assert seen == {b"a", b"b"}
    finally:
        reserved.close()


async def test_a_port_someone_serves_cannot_be_reserved(nursery: trio.Nursery) -> None:
    """Not even by joining their SO_REUSEPORT group: a second router started
    on a port that others serve fails, as a single process does."""
    url = await nursery.start(serve, health_app, ServeOptions(reuse_port=True, graceful_timeout=0.1))
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError) as refused:
        reserve_port("127.0.0.1", port).close()
    # which address is taken: `headrace serve` binds the main port and the admin one
    assert refused.value.errno == errno.EADDRINUSE and f"(127.0.0.1:{port})" in str(refused.value)


async def test_a_response_ends_with_its_last_data_frame(nursery: trio.Nursery) -> None:
    """END_STREAM rides on the last DATA frame: one frame fewer per response
    (a streamed body's last chunk, and a whole JSON body)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/stream":
            await send({"type": "http.response.body", "body": b"one", "more_body": True})
            await send({"type": "http.response.body", "body": b"two", "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"whole"})

    url = await nursery.start(serve, app, ServeOptions())
    port = int(url.rsplit(":", 1)[1])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    frames: dict[int, list[tuple[bytes, bool]]] = {1: [], 3: []}
    for sid, path in ((1, "/stream"), (3, "/whole")):
        conn.send_headers(sid, [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "x")], end_stream=True)
    await stream.send_all(conn.data_to_send())
    ended: set[int] = set()
    with trio.fail_after(5):
        while ended != {1, 3}:
            for event in conn.receive_data(await stream.receive_some(65536)):
                if isinstance(event, h2.events.DataReceived):
                    frames[event.stream_id].append((event.data, event.stream_ended is not None))
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
            await stream.send_all(conn.data_to_send())
    await stream.aclose()
    for sid, body in ((1, b"onetwo"), (3, b"whole")):
        assert b"".join(data for data, _ in frames[sid]) == body
        assert all(data for data, _ in frames[sid]), frames  # no empty DATA frame just to end
        assert [end for _, end in frames[sid]][-1] and not any(end for _, end in frames[sid][:-1])


def test_the_date_header_is_cached_per_second_and_still_correct() -> None:
    from email.utils import parsedate_to_datetime

    config = ServeOptions().hypercorn_config()
    first, second = config.response_headers("h2"), config.response_headers("h2")
    dates = [v for k, v in first if k == b"date"]
    assert len(dates) == 1 and first == second
    assert abs(parsedate_to_datetime(dates[0].decode()).timestamp() - time.time()) < 2
    assert (b"server", b"hypercorn-h2") in first
    config.include_date_header = False
    assert not [k for k, _ in config.response_headers("h2") if k == b"date"]


async def test_a_stream_waiting_to_drain_when_its_connection_closes_does_not_hold_up_shutdown() -> None:
    """The app sent its last body, which waits on the client's flow-control
    window (16 bytes, never widened); the client then closes the connection.
    hypercorn 0.18 left the app waiting on that buffer until the graceful
    deadline: a SIGTERM after clients cut streams took the whole drain_timeout."""
    sent_last = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        sent_last.set()
        await send({"type": "http.response.body", "body": b"x" * 4096})

    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app, ServeOptions(graceful_timeout=20), shutdown=shutdown))
        stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.local_settings = h2.settings.Settings(client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16})
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "x")], end_stream=True)
        await stream.send_all(conn.data_to_send())
        with trio.fail_after(5):
            await sent_last.wait()
            got = b""
            while len(got) < 16:  # the first 16 bytes: the window is full
                for event in conn.receive_data(await stream.receive_some(65536)):
                    if isinstance(event, h2.events.DataReceived):
                        got += event.data
                await stream.send_all(conn.data_to_send())
        await trio.sleep(0.05)
        await stream.aclose()
        await trio.sleep(0.05)
        start = trio.current_time()
        shutdown.set()
        with trio.fail_after(5):  # not the 20 s graceful deadline
            while nursery.child_tasks:
                await trio.sleep(0.01)
        assert trio.current_time() - start < 2


# ---------------------------------------------------------------- a response's head leaves with its first body


def _writes_to_clients_of(port: int, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every socket write the server in this process makes on a connection
    accepted on ``port``: the immediate ones (hardening._write_now) and the
    locked ones (trio's send_all), in order."""
    writes: list[bytes] = []
    write_now, send_all = hardening._write_now, trio.SocketStream.send_all

    def ours(stream: Any) -> bool:
        return isinstance(stream, trio.SocketStream) and stream.socket.getsockname()[1] == port

    def counted_write_now(stream: Any, data: bytes) -> int:
        sent = write_now(stream, data)
        if ours(stream) and sent:
            writes.append(bytes(data[:sent]))
        return sent

    async def counted_send_all(self: trio.SocketStream, data: Any) -> None:
        if ours(self):
            writes.append(bytes(data))
        await send_all(self, data)

    monkeypatch.setattr(hardening, "_write_now", counted_write_now)
    monkeypatch.setattr(trio.SocketStream, "send_all", counted_send_all)
    return writes


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_promised_body_holds_the_head_and_both_leave_in_one_write(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, http: str
) -> None:
    """An app that promises its first body at once (frontend/server.py's
    streams: ``BODY_FOLLOWS``) gets its head written with that body: one
    socket write where hypercorn made two (HTTP/2: the HEADERS flush, then
    the send task's DATA; HTTP/1.1: the head, then the chunk). The head is
    held until then, and the rest of the body follows as before."""
    release, more = trio.Event(), trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")],
                    serving.BODY_FOLLOWS: True})  # fmt: skip
        await release.wait()  # a promise kept late: the head waits with it
        await send({"type": "http.response.body", "body": b"first-part", "more_body": True})
        await more.wait()
        await send({"type": "http.response.body", "body": b"second-part", "more_body": False})

    url = await nursery.start(serve, app, ServeOptions())
    port = int(url.rsplit(":", 1)[1])
    writes = _writes_to_clients_of(port, monkeypatch)
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    received = b""
    if http == "1.1":
        await sock.send_all(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.move_on_after(0.3):
            received += await sock.receive_some(65536)
        assert received == b"", received  # no head before the body it was promised with
        release.set()
        with trio.fail_after(5):
            while b"first-part" not in received:
                received += await sock.receive_some(65536)
        [write] = [w for w in writes if b"first-part" in w]
        assert write.startswith(b"HTTP/1.1 200") and write.endswith(b"first-part\r\n"), write
        more.set()
        with trio.fail_after(5):
            while not received.endswith(b"0\r\n\r\n"):
                received += await sock.receive_some(65536)
        assert b"second-part" in received and b"transfer-encoding: chunked" in received.lower()
    else:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "GET"), (":path", "/s"), (":scheme", "http"), (":authority", "x")], end_stream=True)
        await sock.send_all(conn.data_to_send())
        events: list[h2.events.Event] = []

        async def read(until: type) -> None:
            while not any(isinstance(e, until) for e in events):
                for event in conn.receive_data(await sock.receive_some(65536)):
                    events.append(event)
                    if isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                await sock.send_all(conn.data_to_send())

        with trio.move_on_after(0.3):
            await read(h2.events.ResponseReceived)
        assert not any(isinstance(e, h2.events.ResponseReceived) for e in events), events
        release.set()
        with trio.fail_after(5):
            await read(h2.events.DataReceived)
        [write] = [w for w in writes if b"first-part" in w]
        # a HEADERS frame (type 1) of stream 1 opens the write, the DATA frame (type 0) without END_STREAM ends it
        assert write[3] == 1 and int.from_bytes(write[5:9], "big") == 1, write
        data_frame = write[-(9 + len(b"first-part")):]
        assert data_frame[3] == 0 and not data_frame[4] & 0x1 and data_frame.endswith(b"first-part"), write
        more.set()
        with trio.fail_after(5):
            await read(h2.events.StreamEnded)
        body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
        assert body == b"first-partsecond-part"
    await sock.aclose()


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_head_without_the_promise_is_sent_at_once(nursery: trio.Nursery, http: str) -> None:
    """A streamed start without ``BODY_FOLLOWS`` (an app that may wait long
    for its first body) leaves at once, as hypercorn sends it."""
    release = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    url = await nursery.start(serve, app, ServeOptions())
    async with httpx.AsyncClient(http1=http == "1.1", http2=http == "2", timeout=5) as client:
        with trio.fail_after(5):
            async with client.stream("GET", url + "/s") as response:  # the head, before any body
                assert response.status_code == 200
                release.set()
                assert await response.aread() == b"late"


async def test_a_stream_that_fails_before_its_first_chunk_still_sends_its_head_first() -> None:
    """frontend/server.py sends a stream's start right before its first
    chunk; a stream that raises before any chunk sends the start all the
    same (then the server ends the stream: reset or close, as before)."""
    from frontend.server import BODY_FOLLOWS, Response, _Exchange, _send_response

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def broken(emit: Any) -> None:
        raise RuntimeError("before the first chunk")

    async def two(emit: Any) -> None:
        await emit(b"a")
        await emit(b"b", True)

    with pytest.raises(RuntimeError):
        await _send_response(send, Response(stream=broken), _Exchange())
    assert [m["type"] for m in sent] == ["http.response.start"] and sent[0][BODY_FOLLOWS]
    sent.clear()
    await _send_response(send, Response(stream=two), _Exchange())
    assert [(m["type"], m.get("body"), m.get("more_body")) for m in sent] == [
        ("http.response.start", None, None), ("http.response.body", b"a", True), ("http.response.body", b"b", False)]


async def test_a_streams_later_parts_but_its_last_go_by_the_servers_body_writer() -> None:
    """frontend/server.py: a stream's first part goes with its head by
    ``send``, its last by ``send`` (it ends the response), the parts between
    by the server's body writer where it offers one and takes them; a part
    the writer refuses goes by ``send``, in its place."""
    from frontend.server import Response, _Exchange, _send_response

    sent: list[tuple[str, bytes | None]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append((message["type"], message.get("body")))

    def writer(data: bytes) -> bool:
        sent.append(("writer", data))
        return data != b"refused"

    async def parts(emit: Any) -> None:
        for part in (b"head's", b"middle", b"refused", b"more"):
            await emit(part)
        await emit(b"last", True)

    await _send_response(send, Response(stream=parts), _Exchange(), writer)
    assert sent == [
        ("http.response.start", None), ("http.response.body", b"head's"), ("writer", b"middle"),
        ("writer", b"refused"), ("http.response.body", b"refused"), ("writer", b"more"),
        ("http.response.body", b"last"),
    ]


async def test_an_h2_stream_offers_a_body_writer_that_writes_parts_after_the_head_at_once(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP/2 a request's scope offers a body writer
    (serving.BODY_WRITER): after the head, each part it takes leaves in a
    socket write of its own, without an ASGI message through hypercorn's
    stream; it refuses (nothing sent) before the head, for a body the
    response may not have (HEAD), and once the stream has ended. HTTP/1.1
    offers none."""
    from frontend.server import BODY_WRITER

    seen: dict[str, list[Any]] = {}
    messages: list[dict[str, Any]] = []
    app_send = HTTPStream.app_send

    async def counted_app_send(self: Any, message: Any) -> None:
        messages.append(message)
        await app_send(self, message)

    monkeypatch.setattr(HTTPStream, "app_send", counted_app_send)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        writer = scope["extensions"].get(BODY_WRITER)
        said = seen[scope["method"] + " " + scope["http_version"]] = [writer is not None]
        if writer is None:
            await health_app(scope, receive, send)
            return
        said.append(writer(b"too early"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first;", "more_body": True})
        for i in range(3):
            said.append(writer(b"part-%d;" % i))
            await trio.sleep(0.005)
        await send({"type": "http.response.body", "body": b"last"})
        said.append(writer(b"too late"))

    url = await nursery.start(serve, app, ServeOptions())
    port = int(url.rsplit(":", 1)[1])
    writes = _writes_to_clients_of(port, monkeypatch)
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            assert (await client.get(url + "/h1")).text == "ok"
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        await sock.send_all(conn.data_to_send())
        body = await _h2_read(sock, conn, 1, "/stream")
        conn.send_headers(3, [(":method", "HEAD"), (":path", "/head"), (":scheme", "http"), (":authority", "x")], end_stream=True)
        await sock.send_all(conn.data_to_send())
        ended = False
        while not ended:
            events = conn.receive_data(await sock.receive_some(65536))
            assert not any(isinstance(e, h2.events.DataReceived) and e.data for e in events), events
            ended = any(isinstance(e, h2.events.StreamEnded) for e in events)
        await sock.aclose()
    assert body == b"first;part-0;part-1;part-2;last"
    assert seen["GET 1.1"] == [False]
    assert seen["GET 2"] == [True, False, True, True, True, False]
    assert seen["HEAD 2"] == [True, False, False, False, False, False]
    for i in range(3):  # each its own write: a DATA frame of stream 1 without END_STREAM
        [write] = [w for w in writes if b"part-%d;" % i in w]
        assert len(write) == 9 + 7 and write[3] == 0 and not write[4] & 0x1 and int.from_bytes(write[5:9], "big") == 1
    bodies = [m.get("body") for m in messages if m is not None and m["type"] == "http.response.body"]
    assert not any(b and b.startswith(b"part-") for b in bodies), bodies


def test_a_middleware_that_wraps_send_hides_the_body_writer_from_its_app() -> None:
    """without_body_writer: a copy of the scope without the writer (the
    server's scope untouched, its other extensions kept); a scope that
    offers none is passed as it is."""
    from frontend.server import BODY_WRITER, ON_DISCONNECT, without_body_writer

    hook, writer = object(), object()
    scope = {"type": "http", "extensions": {ON_DISCONNECT: hook, BODY_WRITER: writer}}
    hidden = without_body_writer(scope)
    assert hidden["extensions"] == {ON_DISCONNECT: hook} and hidden["type"] == "http"
    assert scope["extensions"] == {ON_DISCONNECT: hook, BODY_WRITER: writer}
    plain = {"type": "http", "extensions": {ON_DISCONNECT: hook}}
    assert without_body_writer(plain) is plain


async def test_parts_the_body_writer_cannot_send_at_once_go_through_the_buffer_in_order(nursery: trio.Nursery) -> None:
    """A client whose stream window is smaller than the parts: the writer
    refuses each part it has no window for (nothing framed), the app sends
    it instead (as frontend/server.py does), and every part arrives, in
    order, as the client opens its window."""
    from frontend.server import BODY_WRITER

    taken: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        writer = scope["extensions"][BODY_WRITER]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"<", "more_body": True})
        for i in range(30):
            part = b"%02d" % i * (1 + i % 7)
            taken.append(writer(part))
            if not taken[-1]:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b">"})

    url = await nursery.start(serve, app, ServeOptions())
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 8})
    await sock.send_all(conn.data_to_send())
    with trio.fail_after(10):
        body = await _h2_read(sock, conn, 1, "/small-window")
    await sock.aclose()
    assert body == b"<" + b"".join(b"%02d" % i * (1 + i % 7) for i in range(30)) + b">"
    assert any(taken) and not all(taken), taken  # some parts by the writer, some by send


async def test_an_answer_given_once_content_length_bytes_are_in_keeps_the_connection(nursery: trio.Nursery) -> None:
    """frontend/server.py answers as soon as ``content-length`` body bytes
    are in, which can be before hypercorn takes the request's end from h11;
    the connection must still be kept alive for the client's next request
    (hypercorn closed it, and a client that had sent its next request on it
    got no answer: 1 in 8 such requests here once the answer left at once).
    One HTTP/1.1 connection: a refusal of a 25 KB body, then a small
    request, 30 times; every answer comes, on that one connection."""
    from backends.mock import MockBackend, MockConfig
    from frontend.server import OpenAIServer

    url = await nursery.start(serve, OpenAIServer(MockBackend(MockConfig(max_context=4096))), ServeOptions())
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    big = msgspec.json.encode({"model": "mock", "prompt": " hello" * 4160, "max_tokens": 4})
    small = msgspec.json.encode({"model": "no-such-model", "prompt": "hi"})
    buffer = b""

    async def exchange(body: bytes, status: bytes) -> None:
        nonlocal buffer
        # the head, then the body in another write (as httpx sends them)
        await sock.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n" % len(body))  # fmt: skip
        await sock.send_all(body)
        with trio.fail_after(5):
            while b"\r\n\r\n" not in buffer:
                data = await sock.receive_some(65536)
                assert data, "the server closed the connection instead of answering"
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 " + status), head
            assert b"connection: close" not in head.lower(), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(buffer) < length:
                data = await sock.receive_some(65536)
                assert data, "the server closed the connection mid-answer"
                buffer += data
            buffer = buffer[length:]

    for _ in range(30):
        await exchange(big, b"400")
        await exchange(small, b"404")
    await sock.aclose()


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_head_request_gets_the_head_alone_and_the_connection_goes_on(nursery: trio.Nursery, http: str) -> None:
    """HEAD of a whole response (a held start with ``content-length``): the
    status and headers, no body, and the connection serves the next request."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")], serving.BODY_FOLLOWS: True})  # fmt: skip
        await send({"type": "http.response.body", "body": b"whole"})

    url = await nursery.start(serve, app, ServeOptions())
    async with httpx.AsyncClient(http1=http == "1.1", http2=http == "2", timeout=5) as client:
        for _ in range(3):
            head = await client.head(url + "/x")
            assert head.status_code == 200 and head.headers["content-length"] == "5" and head.content == b""
            got = await client.get(url + "/x")
            assert got.status_code == 200 and got.content == b"whole"
            assert got.http_version == ("HTTP/2" if http == "2" else "HTTP/1.1")


async def test_body_sent_right_before_an_app_fails_still_reaches_the_h2_client_before_the_reset(nursery: trio.Nursery) -> None:
    """An app that fails right after a ``send``, with no checkpoint between,
    had that body in the stream's buffer for the connection's send task; the
    reset for the failure dropped it. A stream relayed without a pump fails
    that way (a backend cut right after a token): the client lost the token."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await trio.sleep(0.05)  # "first" leaves on the send task's turn
        await send({"type": "http.response.body", "body": b"second", "more_body": True})
        raise RuntimeError("cut right after a send")

    url = await nursery.start(serve, app, ServeOptions())
    host, port = url.removeprefix("http://").split(":")
    sock = await trio.open_tcp_stream(host, int(port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with trio.fail_after(5):
        seen = await _h2_batch(sock, conn, [1])
    await sock.aclose()
    data = b"".join(e.data for e in seen if isinstance(e, h2.events.DataReceived))
    assert data == b"firstsecond"
    assert isinstance(seen[-1], h2.events.StreamReset) and seen[-1].error_code == h2.errors.ErrorCodes.INTERNAL_ERROR


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        name = task.name.rsplit(".", 1)[-1]
        self.by_name[name] = self.by_name.get(name, 0) + 1


async def _h2_read(sock: trio.SocketStream, conn: h2.connection.H2Connection, sid: int, path: str) -> bytes:
    headers = [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "x")]
    conn.send_headers(sid, headers, end_stream=True)
    await sock.send_all(conn.data_to_send())
    body, ended = b"", False
    while not ended:
        for event in conn.receive_data(await sock.receive_some(65536)):
            if isinstance(event, h2.events.DataReceived):
                body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            ended = ended or isinstance(event, h2.events.StreamEnded)
        await sock.send_all(conn.data_to_send())
    return body


async def test_the_h2_send_task_sleeps_while_the_connection_is_quiet(nursery: trio.Nursery) -> None:
    """On a quiet connection every answer leaves from its app's own task:
    a whole one with its head, a streamed one part by part (the last part
    with END_STREAM), and closing the stream no longer wakes the send task
    (hypercorn woke it once a request, and handed it every part: two
    scheduler turns a part). A part that does not fit one frame still goes
    through the send task, whole and in order."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        path = scope["path"]
        whole = path == "/whole"  # a declared length: sent whole (with its head) from this task
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"3")] if whole else []})
        if path == "/stream":
            for part in (b"one", b"two"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
                await trio.sleep(0.01)
        elif path == "/big":
            await send({"type": "http.response.body", "body": b"x" * 40_000, "more_body": True})
        await send({"type": "http.response.body", "body": b"end"})

    url = await nursery.start(serve, app, ServeOptions(h2_ingress="hypercorn"))  # the lean one has no send task
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    await sock.send_all(conn.data_to_send())
    steps = _Steps()
    with trio.fail_after(10):
        assert await _h2_read(sock, conn, 1, "/whole") == b"end"  # the connection's tasks are up
        trio.lowlevel.add_instrument(steps)
        try:
            for sid in range(3, 23, 4):
                assert await _h2_read(sock, conn, sid, "/whole") == b"end"
                assert await _h2_read(sock, conn, sid + 2, "/stream") == b"onetwoend"
            quiet = steps.by_name.get("send_task", 0)
            assert await _h2_read(sock, conn, 23, "/big") == b"x" * 40_000 + b"end"
        finally:
            trio.lowlevel.remove_instrument(steps)
    await sock.aclose()
    assert quiet == 0, steps.by_name
    assert steps.by_name.get("send_task", 0) > 0


async def test_a_direct_write_the_socket_takes_in_part_is_finished_in_order_by_a_task_of_its_own(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body part written from the app's task goes out as far as the socket
    takes it at once; the rest is left first in line for a flush task (the
    app does not wait on the client's socket: tests/hardening/
    test_slow_readers.py), and every byte arrives, in order, on every
    stream of the connection, whichever path each part took."""
    write_now = hardening._write_now
    partial = [0]

    def half(stream: Any, data: bytes) -> int:
        n = write_now(stream, data[: max(1, len(data) // 2)])
        partial[0] += n < len(data)
        return n

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(20):
            await send({"type": "http.response.body", "body": b"%s-%02d;" % (scope["path"][1:].encode(), i), "more_body": True})
            await trio.sleep(0.002)
        await send({"type": "http.response.body", "body": b"end"})

    monkeypatch.setattr(hardening, "_write_now", half)
    url = await nursery.start(serve, app, ServeOptions())
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    await sock.send_all(conn.data_to_send())
    bodies: dict[int, bytes] = {}
    with trio.fail_after(10):
        for sid, name in ((1, "a"), (3, "b"), (5, "c")):
            conn.send_headers(sid, [(":method", "GET"), (":path", f"/{name}"), (":scheme", "http"), (":authority", "x")], end_stream=True)
        await sock.send_all(conn.data_to_send())
        ended: set[int] = set()
        while ended != {1, 3, 5}:
            for event in conn.receive_data(await sock.receive_some(65536)):
                if isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
                elif isinstance(event, h2.events.ConnectionTerminated | h2.events.StreamReset):
                    raise AssertionError(event)
            await sock.send_all(conn.data_to_send())
    await sock.aclose()
    for sid, name in ((1, b"a"), (3, b"b"), (5, b"c")):
        assert bodies[sid] == b"".join(b"%s-%02d;" % (name, i) for i in range(20)) + b"end"
    assert partial[0] > 10

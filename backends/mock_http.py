"""A lean ASGI server for ``headrace mock``: HTTP/1.1 (h11) and cleartext
HTTP/2 with prior knowledge (h2), straight over trio sockets.

Why not hypercorn: the mock is a benchmarking tool and must cost little per
request, so that a two-core bench measures the router, not the mock. Under
hypercorn an app that answers with one ready 4 KB body costs 0.65 ms of CPU
per request over h2c and 0.53 ms over HTTP/1.1 (h2load / wrk, 8 connections),
twice the mock's whole budget of 0.3 ms: every message crosses hypercorn's
protocol, stream and event layers and is written on its own. Here an HTTP/2
stream is one task, an HTTP/1.1 request a call in its connection's task, and
a response head with the body that follows it goes out in one write::

    accept ── sniff the preface ─┬─ h11: request ─> app(scope, receive, send) ─> next request
                                 └─ h2:  read ─> h2 events ─┬─ stream task: app(...)
                                                            │     send ─> h2 state, wake writer
                                         writer task <──────┘ one send_all per wake-up

Behaviour matches what the mock relies on from hypercorn: ``http.disconnect``
once the response is complete or the client leaves; an app that ends before
its last body message closes the HTTP/1.1 connection and resets the HTTP/2
stream (INTERNAL_ERROR); an app error before the response head is a 500; no
cap on requests per connection. Graceful shutdown: stop accepting, and close
each connection once it is idle (HTTP/2: then GOAWAY, as hypercorn does), for
at most ``graceful_timeout``.

Not supported (``headrace mock --server hypercorn`` has them): TLS, the h2c
``Upgrade`` from HTTP/1.1 (such a request is answered over HTTP/1.1, as RFC
9113 allows), lifespan events, trailers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11
import trio

from backends.serving import ServeOptions

__all__ = ["LeanServer", "serve_lean"]

log = logging.getLogger(__name__)

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
READ_SIZE = 65536
MAX_STREAMS = 1000
HIGH_WATER = 256 * 1024  # bytes queued for a connection before a sender waits for the writer
WRITE_TIMEOUT = 30.0
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_DISCONNECT = {"type": "http.disconnect"}
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError)


async def serve_lean(
    app: ASGIApp,
    options: ServeOptions,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`backends.serving.serve`, on the lean server (no TLS)."""
    if options.certfile:
        raise ValueError("the lean server does not speak TLS; serve with hypercorn")
    server = LeanServer(app, graceful_timeout=options.graceful_timeout,
                        keep_alive_timeout=options.keep_alive_timeout)
    await server.serve(options.host, options.port, shutdown=shutdown, task_status=task_status)


def _scope(version: str, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
           client: Any, server: Any) -> dict[str, Any]:
    raw_path, _, query = target.partition(b"?")
    return {
        "type": "http", "asgi": _ASGI, "http_version": version, "scheme": "http",
        "method": method.decode("ascii"), "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path, "query_string": query, "root_path": "", "headers": headers,
        "client": client, "server": server,
    }


class LeanServer:
    """Serves ``app`` on every connection accepted until ``shutdown`` is set."""

    def __init__(self, app: ASGIApp, *, graceful_timeout: float = 5.0,
                 keep_alive_timeout: float = 75.0) -> None:
        self.app = app
        self.graceful_timeout = graceful_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.connections: set[_H1 | _H2] = set()
        self.draining = False
        self._changed = trio.Event()

    async def serve(self, host: str, port: int, *, shutdown: trio.Event | None = None,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        name = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(trio.serve_listeners, handler_nursery=connections),
                    self._handle, listeners)
                task_status.started(f"http://{name}:{bound[1]}")
                if shutdown is None:
                    await trio.sleep_forever()
                await shutdown.wait()
                accepting.cancel_scope.cancel()  # closes the listeners
            await self._drain()
            connections.cancel_scope.cancel()

    async def _drain(self) -> None:
        self.draining = True
        for connection in list(self.connections):
            connection.drain()
        with trio.move_on_after(self.graceful_timeout):
            while self.connections:
                await self._changed.wait()

    def _gone(self, connection: _H1 | _H2) -> None:
        self.connections.discard(connection)
        self._changed.set()
        self._changed = trio.Event()

    async def _handle(self, stream: trio.SocketStream) -> None:
        connection: _H1 | _H2 | None = None
        try:
            data = await self._sniff(stream)
            if data and not self.draining:
                connection = _H2(self, stream) if data.startswith(PREFACE) else _H1(self, stream)
                self.connections.add(connection)
                await connection.run(data)
        except* _CLOSED:
            pass  # the client went away
        except* Exception:  # one connection's failure must not stop the server
            log.exception("lean server: closing a connection after an error")
        finally:
            if connection is not None:
                self._gone(connection)
            await trio.aclose_forcefully(stream)

    async def _sniff(self, stream: trio.SocketStream) -> bytes:
        """The first bytes: enough to tell the HTTP/2 preface from a request line."""
        data = b""
        with trio.move_on_after(self.keep_alive_timeout):
            while len(data) < len(PREFACE) and PREFACE.startswith(data):
                chunk = await stream.receive_some(READ_SIZE)
                if not chunk:
                    break
                data += chunk
        return data


def _addresses(stream: trio.SocketStream) -> tuple[Any, Any]:
    try:
        peer, local = stream.socket.getpeername(), stream.socket.getsockname()
    except OSError:
        return None, None
    return (peer[0], peer[1]), (local[0], local[1])


# ---------------------------------------------------------------- HTTP/1.1


class _H1:
    """One HTTP/1.1 connection: requests one after another, each answered by
    a call of the app in this task."""

    def __init__(self, server: LeanServer, stream: trio.SocketStream) -> None:
        self.server, self.stream = server, stream
        self.conn = h11.Connection(h11.SERVER)
        self.client, self.local = _addresses(stream)
        self.idle_scope: trio.CancelScope | None = None
        self.closing = False
        self.broken = False

    def drain(self) -> None:
        self.closing = True
        if self.idle_scope is not None:
            self.idle_scope.cancel()

    async def run(self, data: bytes) -> None:
        self.conn.receive_data(data)
        while not self.closing and not self.broken:
            try:
                request = await self._next_request()
                if request is None:
                    return
                await self._exchange(request)
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc.error_status_hint)
                return
            if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                return  # Connection: close, a cut response, a body left unread
            self.conn.start_next_cycle()

    async def _next_request(self) -> h11.Request | None:
        with trio.move_on_after(self.server.keep_alive_timeout) as self.idle_scope:
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    await self.read()
                    continue
                self.idle_scope = None
                return event if isinstance(event, h11.Request) else None
        self.idle_scope = None
        return None

    async def read(self) -> None:
        self.conn.receive_data(await self.stream.receive_some(READ_SIZE))

    async def write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            await self.stream.send_all(data)
        except _CLOSED:
            self.broken = True

    async def _exchange(self, request: h11.Request) -> None:
        scope = _scope(request.http_version.decode(), request.method, request.target,
                       list(request.headers), self.client, self.local)
        exchange = _H1Exchange(self)
        try:
            await self.server.app(scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("lean server: error in the app on %s %s", scope["method"], scope["path"])
        if not exchange.started:
            await exchange.send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-length", b"0")]})
            await exchange.send({"type": "http.response.body"})
        elif not exchange.complete:
            self.broken = True  # ended mid-body: closing the connection is all HTTP/1.1 has

    async def _refuse(self, status: int) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            head = h11.Response(status_code=status, reason=_REASONS.get(status, b""),
                                headers=[(b"content-length", b"0"), (b"connection", b"close")])
            await self.write(self.conn.send(head) + self.conn.send(h11.EndOfMessage()))


class _H1Exchange:
    """``receive`` and ``send`` of one HTTP/1.1 request."""

    def __init__(self, h1: _H1) -> None:
        self.h1 = h1
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.body_done = self.started = self.complete = self.disconnected = False
        self._waiting: trio.CancelScope | None = None

    async def receive(self) -> dict[str, Any]:
        if self.body_done or self.disconnected:
            return await self._disconnect()
        conn = self.h1.conn
        if conn.they_are_waiting_for_100_continue:
            await self.h1.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if chunks:
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
                await self.h1.read()
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            else:  # the client closed mid-body
                self.disconnected = True
                return _DISCONNECT

    async def _disconnect(self) -> dict[str, Any]:
        """After the body: returns once the response is complete or the client
        has gone (reading on; a pipelined next request stays buffered in h11)."""
        with trio.CancelScope() as self._waiting:  # cancelled once the response is complete
            while not (self.complete or self.disconnected or self.h1.broken):
                data = await self.h1.stream.receive_some(READ_SIZE)
                if not data:
                    self.disconnected = True
                    break
                self.h1.conn.receive_data(data)
        self._waiting = None
        return _DISCONNECT

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", ()))
            return
        if kind != "http.response.body" or self.complete:
            return
        conn, out = self.h1.conn, b""
        if not self.started:
            self.started = True
            out = conn.send(h11.Response(status_code=self.status, headers=self.headers,
                                         reason=_REASONS.get(self.status, b"")))
        body = message.get("body", b"")
        if body:
            out += conn.send(h11.Data(data=body))
        if not message.get("more_body", False):
            out += conn.send(h11.EndOfMessage())
            self.complete = True
            if self._waiting is not None:
                self._waiting.cancel()
        await self.h1.write(out)


# ---------------------------------------------------------------- HTTP/2


class _H2:
    """One HTTP/2 connection: this task reads and feeds h2; each stream runs
    the app in a task of its own; one writer task sends what h2 queues."""

    def __init__(self, server: LeanServer, stream: trio.SocketStream) -> None:
        self.server, self.stream = server, stream
        # Our own headers are known good; a client's are not checked beyond what
        # framing needs (the mock is a test and benchmark tool: ~40 us less per request).
        config = h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=False,
            normalize_inbound_headers=False, validate_outbound_headers=False,
            normalize_outbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
        })
        self.client, self.local = _addresses(stream)
        self.streams: dict[int, _H2Stream] = {}
        self.nursery: trio.Nursery | None = None
        self.read_scope = trio.CancelScope()
        self.closed = self.draining = False
        self.last_stream = 0
        self.queued = 0  # body bytes handed to h2 since the writer last took its queue
        self._stopping = False
        self._dirty = trio.Event()
        self._window = trio.Event()  # flow-control credit arrived
        self._written = trio.Event()

    def drain(self) -> None:
        """Close once no stream is in flight (then GOAWAY), as hypercorn does: a
        GOAWAY under a live stream fails it in httpcore's client."""
        self.draining = True
        if not self.streams:
            self.read_scope.cancel()

    async def run(self, data: bytes) -> None:
        self.conn.initiate_connection()
        async with trio.open_nursery() as outer:
            outer.start_soon(self._writer)
            async with trio.open_nursery() as streams:
                self.nursery = streams
                self._receive(data)
                with self.read_scope:
                    await self._read_loop()
                self._close()
                streams.cancel_scope.cancel()
            self._stopping = True  # the writer sends what is queued, then returns
            self.flush()
            outer.cancel_scope.deadline = trio.current_time() + 1.0
        await self._last_words()

    async def _read_loop(self) -> None:
        while not self.closed:
            timeout = self.server.keep_alive_timeout if not self.streams else float("inf")
            with trio.move_on_after(timeout) as idle:
                data = await self.stream.receive_some(READ_SIZE)
            if idle.cancelled_caught or not data:
                return
            self._receive(data)

    def _receive(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.closed = True  # h2 has queued its GOAWAY
            self.flush()
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self._open(event)
            elif isinstance(event, h2.events.DataReceived):
                self._data(event)
            elif isinstance(event, h2.events.StreamEnded):
                if (s := self.streams.get(event.stream_id)) is not None:
                    s.body_done = True
                    s.wake()
            elif isinstance(event, h2.events.StreamReset):
                if (s := self.streams.get(event.stream_id)) is not None:
                    s.reset()
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._window.set()
                self._window = trio.Event()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True
        self.flush()

    def _open(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        self.last_stream = max(self.last_stream, sid)
        pseudo: dict[bytes, bytes] = {}
        headers: list[tuple[bytes, bytes]] = []
        for name, value in event.headers or ():
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                headers.append((name, value))
        scope = _scope("2", pseudo.get(b":method", b"GET"), pseudo.get(b":path", b"/"),
                       headers, self.client, self.local)
        scope["scheme"] = pseudo.get(b":scheme", b"http").decode("latin-1")
        stream = self.streams[sid] = _H2Stream(self, sid)
        assert self.nursery is not None
        self.nursery.start_soon(self._run_stream, stream, scope)

    def _data(self, event: h2.events.DataReceived) -> None:
        s = self.streams.get(event.stream_id)
        if s is None or s.closed:  # a stream we no longer read: credit it now
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        s.body.append((event.data, event.flow_controlled_length))
        s.wake()

    async def _run_stream(self, stream: _H2Stream, scope: dict[str, Any]) -> None:
        try:
            await self.server.app(scope, stream.receive, stream.send)
        except Exception:
            log.exception("lean server: error in the app on %s %s", scope["method"], scope["path"])
        finally:
            del self.streams[stream.sid]
            stream.finish()
            if self.draining and not self.streams:
                self.read_scope.cancel()

    # -------- writing

    def flush(self) -> None:
        """Have the writer send what h2 has queued."""
        self._dirty.set()

    async def wait_written(self) -> None:
        """Backpressure: wait while much is queued and not yet written."""
        while not self.closed and self.queued > HIGH_WATER:
            self.flush()
            await self._written.wait()

    async def wait_window(self) -> None:
        await self._window.wait()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            data = self.conn.data_to_send()
            self.queued = 0
            if data:
                try:
                    await self.stream.send_all(data)
                except _CLOSED:
                    self._close()
                    self.read_scope.cancel()
                    return
            self._written.set()
            self._written = trio.Event()
            if self._stopping:
                return

    def _close(self) -> None:
        self.closed = True
        for s in list(self.streams.values()):
            s.reset()
        self._window.set()
        self._written.set()

    async def _last_words(self) -> None:
        """A final GOAWAY (and whatever else is queued), if the peer still listens."""
        try:
            self.conn.close_connection(last_stream_id=self.last_stream)
        except h2.exceptions.ProtocolError:
            pass
        data = self.conn.data_to_send()
        if data:
            with trio.move_on_after(1.0):
                try:
                    await self.stream.send_all(data)
                except _CLOSED:
                    pass


class _H2Stream:
    """``receive`` and ``send`` of one HTTP/2 stream."""

    def __init__(self, h2c: _H2, sid: int) -> None:
        self.h2c, self.sid = h2c, sid
        self.body: list[tuple[bytes, int]] = []
        self.body_done = self.delivered = False
        self.started = self.complete = self.closed = False
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self._event: trio.Event | None = None

    def wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def _wait(self) -> None:
        self._event = trio.Event()
        await self._event.wait()

    def reset(self) -> None:
        """The client reset the stream or the connection is gone."""
        self.closed = True
        self.wake()

    async def receive(self) -> dict[str, Any]:
        conn = self.h2c.conn
        while True:
            if self.closed:
                return _DISCONNECT
            if self.body:
                chunks, self.body = self.body, []
                for _, length in chunks:
                    conn.acknowledge_received_data(length, self.sid)
                more = not self.body_done
                if more:
                    self.h2c.flush()  # credit now: the client may wait for it to send the rest
                self.delivered = not more
                return {"type": "http.request", "body": b"".join(c for c, _ in chunks),
                        "more_body": more}
            if self.body_done and not self.delivered:
                self.delivered = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if self.delivered and self.complete:
                return _DISCONNECT
            await self._wait()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", ()))
            return
        if kind != "http.response.body" or self.complete or self.closed:
            return
        body: bytes = message.get("body", b"")
        end = not message.get("more_body", False)
        try:
            if not self.started:
                self.started = True
                head = [(b":status", str(self.status).encode()), *self.headers]
                self.h2c.conn.send_headers(self.sid, head, end_stream=end and not body)
            elif end and not body:
                self.h2c.conn.end_stream(self.sid)
            if body:
                self.h2c.queued += len(body)
                await self._send_data(body, end)
            if end:
                self.complete = True
                self.wake()
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.reset()  # the client reset it, or the connection is closing
            return
        self.h2c.flush()
        await self.h2c.wait_written()

    async def _send_data(self, data: bytes, end: bool) -> None:
        conn = self.h2c.conn
        while data:
            size = min(len(data), conn.local_flow_control_window(self.sid),
                       conn.max_outbound_frame_size)
            if size <= 0:
                self.h2c.flush()
                await self.h2c.wait_window()
                if self.closed:
                    raise h2.exceptions.StreamClosedError(self.sid)
                continue
            conn.send_data(self.sid, data[:size], end_stream=end and size == len(data))
            data = data[size:]

    def finish(self) -> None:
        """The app returned: reset a response it left unfinished (or answer 500
        when it sent nothing), and credit any body it never read."""
        conn = self.h2c.conn
        for _, length in self.body:
            conn.acknowledge_received_data(length, self.sid)
        self.body = []
        if not self.complete and not self.closed:
            try:
                if self.started:
                    conn.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
                else:
                    conn.send_headers(self.sid, [(b":status", b"500"), (b"content-length", b"0")],
                                      end_stream=True)
            except h2.exceptions.ProtocolError:
                pass
        self.closed = True
        self.h2c.flush()

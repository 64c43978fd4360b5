"""A lean ASGI server for ``headrace mock``: HTTP/1.1 and cleartext HTTP/2
with prior knowledge, straight over trio sockets.

Why not hypercorn: the mock is a benchmarking tool and must cost little per
request, so that a two-core bench measures the router, not the mock. Under
hypercorn an app that answers with one ready 4 KB body costs 0.65 ms of CPU
per request over h2c and 0.53 ms over HTTP/1.1 (h2load / wrk, 8 connections),
twice the mock's whole budget of 0.3 ms: every message crosses hypercorn's
protocol, stream and event layers and is written on its own. Here an HTTP/2
stream is one task (or none: see ``answer_now``), an HTTP/1.1 request a call in
its connection's task, and a response head with the body that follows it goes
out in one write. HTTP/1.1 is parsed here, HTTP/2 framed by
``backends.mock_h2`` (h11 and h2 cost ~80 and ~150 us a request)::

    accept ── sniff the preface ─┬─ HTTP/1.1: head, body ─> answer_now() or app(...) inline
                                 └─ h2c: read ─> H2Core events ─┬─ body complete: answer_now()
                                                                └─ else a task: app(...)
                                      whoever queued bytes writes them (one write in flight)

Behaviour matches what the mock relies on from hypercorn: ``http.disconnect``
once the response is complete or the client leaves; an app that ends before
its last body message closes the HTTP/1.1 connection and resets the HTTP/2
stream (INTERNAL_ERROR); an app error before the response head is a 500; no
cap on requests per connection. Graceful shutdown: stop accepting, and close
each connection once it is idle (HTTP/2: then GOAWAY, as hypercorn does), for
at most ``graceful_timeout``.

One module for both protocols (~850 lines): their connections share the
accept loop, the scope, ``answer_now`` and the drain; HTTP/2's framing, the
part that stands alone, is ``backends.mock_h2``.

Not supported (``headrace mock --server hypercorn`` has them): TLS, the h2c
``Upgrade`` from HTTP/1.1 (such a request is answered over HTTP/1.1, as RFC
9113 allows), lifespan events, trailers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import unquote

import trio

from backends.mock_h2 import (
    CLOSED,
    DATA,
    END,
    INTERNAL_ERROR,
    PREFACE,
    REQUEST,
    RESET,
    WINDOW,
    H2Core,
    StreamGone,
)

__all__ = ["Answer", "AnswerNow", "LeanServer", "serve_lean"]

log = logging.getLogger(__name__)

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
# answer_now(scope, whole body) -> (status, headers, body), or None for "start the app"
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
AnswerNow = Callable[[dict[str, Any], bytes], Answer | None]
DEFER_BODY = 65536  # a body buffered past this size goes to the app as it comes
READ_SIZE = 65536
HIGH_WATER = 256 * 1024  # bytes queued on a connection before a sender waits for the write
WRITE_TIMEOUT = 30.0
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_DISCONNECT = {"type": "http.disconnect"}
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError)


class Options(Protocol):
    """What :func:`serve_lean` reads of ``frontend.serving.ServeOptions``."""

    host: str
    port: int
    certfile: str | None
    graceful_timeout: float
    keep_alive_timeout: float


async def serve_lean(
    app: ASGIApp,
    options: Options,
    *,
    answer_now: AnswerNow | None = None,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``frontend.serving.serve``, on the lean server (no TLS)."""
    if options.certfile:
        raise ValueError("the lean server does not speak TLS; serve with hypercorn")
    server = LeanServer(app, answer_now=answer_now, graceful_timeout=options.graceful_timeout,
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
    """Serves ``app`` on every connection accepted until ``shutdown`` is set.

    ``answer_now``, when given, is offered each request whose body is complete
    before the app is started for it: called in the connection's task, it must
    not block, and returns the whole response, or None to let the app answer.
    The mock answers its zero-delay generations so (no task, no ASGI messages
    per request: about a third of its CPU under a router's traffic)."""

    def __init__(self, app: ASGIApp, *, answer_now: AnswerNow | None = None,
                 graceful_timeout: float = 5.0, keep_alive_timeout: float = 75.0) -> None:
        self.app, self.answer_now = app, answer_now
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
                accepting.start_soon(self._reap)
                task_status.started(f"http://{name}:{bound[1]}")
                if shutdown is None:
                    await trio.sleep_forever()
                await shutdown.wait()
                accepting.cancel_scope.cancel()  # closes the listeners
            await self._drain()
            connections.cancel_scope.cancel()

    async def _reap(self) -> None:
        """Close connections idle for ``keep_alive_timeout``: one sweep every
        few seconds costs less than a timeout armed per read."""
        every = max(0.05, min(5.0, self.keep_alive_timeout / 4))
        while True:
            await trio.sleep(every)
            now = trio.current_time()
            for connection in list(self.connections):
                since = connection.idle_since
                if since is not None and now - since >= self.keep_alive_timeout:
                    connection.expire()

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

# h11 cost ~80 us per request here (header validation by regex, a state
# machine per event), a quarter of the mock's budget; the parser below reads
# what RFC 9112 clients send: a request line, headers, a body framed by
# Content-Length or chunked; keep-alive, pipelining, ``Expect: 100-continue``.
MAX_HEAD = 65536


class BadRequest(Exception):
    """A request that cannot be parsed: answered 400 and the connection closed."""


def parse_head(head: bytes) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]:
    """(method, target, version, headers with lowercased names) of a request head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[0].isalpha():
        raise BadRequest(lines[0][:100])
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name[-1:] in (b" ", b"\t") or line[:1] in (b" ", b"\t"):
            raise BadRequest(line[:100])
        headers.append((name.lower(), value.strip(b" \t")))
    return parts[0], parts[1], parts[2], headers


class _H1:
    """One HTTP/1.1 connection: requests one after another, each answered by
    a call of the app in this task."""

    def __init__(self, server: LeanServer, stream: trio.SocketStream) -> None:
        self.server, self.stream = server, stream
        self.buf = bytearray()
        self.eof = False
        self.client, self.local = _addresses(stream)
        self.idle_scope: trio.CancelScope | None = None  # while waiting for a request
        self.idle_since: float | None = None
        self.closing = False
        self.broken = False

    def drain(self) -> None:
        self.closing = True
        self.expire()

    def expire(self) -> None:
        if self.idle_scope is not None:
            self.idle_scope.cancel()

    async def run(self, data: bytes) -> None:
        self.buf += data
        while not self.closing and not self.broken:
            try:
                head = await self._next_head()
                if head is None:
                    return
                exchange = _H1Exchange(self, *parse_head(head))
                if not await self._answer_now(exchange):
                    await self._exchange(exchange)
            except BadRequest:
                await self.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n"
                                 b"connection: close\r\n\r\n")
                return
            if not (exchange.complete and exchange.body_done and exchange.keep_alive):
                return  # Connection: close, a cut response, a body left unread

    async def _next_head(self) -> bytes | None:
        self.idle_since = trio.current_time()
        with trio.CancelScope() as self.idle_scope:
            while True:
                while self.buf[:2] == b"\r\n":  # tolerated before a request line
                    del self.buf[:2]
                end = self.buf.find(b"\r\n\r\n")
                if end >= 0:
                    head = bytes(self.buf[:end])
                    del self.buf[: end + 4]
                    self.idle_scope = self.idle_since = None
                    return head
                if len(self.buf) > MAX_HEAD:
                    raise BadRequest("request head too large")
                if self.eof or not await self.read():
                    break
        self.idle_scope = self.idle_since = None
        return None

    async def read(self) -> bool:
        """More bytes into the buffer; False at the end of the stream."""
        data = await self.stream.receive_some(READ_SIZE)
        self.eof = not data
        self.buf += data
        return bool(data)

    async def write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            await self.stream.send_all(data)
        except _CLOSED:
            self.broken = True

    async def _answer_now(self, exchange: _H1Exchange) -> bool:
        """Answer with ``answer_now`` when the body is all here and it answers."""
        answer_now, size = self.server.answer_now, exchange.remaining
        if answer_now is None or exchange.chunked or len(self.buf) < size:
            return False
        answer = answer_now(exchange.scope(), bytes(self.buf[:size]))
        if answer is None:
            return False
        del self.buf[:size]
        exchange.remaining, exchange.body_done, exchange.delivered = 0, True, True
        status, headers, body = answer
        await exchange.send({"type": "http.response.start", "status": status, "headers": headers})
        await exchange.send({"type": "http.response.body", "body": body})
        return True

    async def _exchange(self, exchange: _H1Exchange) -> None:
        scope = exchange.scope()
        try:
            await self.server.app(scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("lean server: error in the app on %s %s", scope["method"], scope["path"])
        if not exchange.started:
            exchange.keep_alive = False
            await exchange.send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-length", b"0")]})
            await exchange.send({"type": "http.response.body"})
        elif not exchange.complete:
            self.broken = True  # ended mid-body: closing the connection is all HTTP/1.1 has
        if exchange.complete and not exchange.body_done and exchange.keep_alive:
            await exchange.skip_body()  # unread: read past it to reach the next request


class _H1Exchange:
    """``receive`` and ``send`` of one HTTP/1.1 request."""

    def __init__(self, h1: _H1, method: bytes, target: bytes, version: bytes,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self.h1, self.method, self.target, self.version = h1, method, target, version
        self.request_headers = headers
        fields: dict[bytes, bytes] = {}
        for name, value in headers:
            if name in (b"content-length", b"transfer-encoding", b"connection", b"expect"):
                if name in fields and (name == b"content-length" and fields[name] != value):
                    raise BadRequest("conflicting content-length")
                fields[name] = value if name not in fields else fields[name] + b"," + value
        connection = fields.get(b"connection", b"").lower()
        self.keep_alive = (b"close" not in connection if version == b"HTTP/1.1"
                           else b"keep-alive" in connection)
        coding = fields.get(b"transfer-encoding", b"").lower()
        self.chunked = bool(coding)
        if coding and coding.rsplit(b",", 1)[-1].strip() != b"chunked":
            raise BadRequest("unsupported transfer-encoding")
        length = fields.get(b"content-length", b"0")
        if not self.chunked and not length.isdigit():
            raise BadRequest("bad content-length")
        self.remaining = 0 if self.chunked else int(length)  # of a sized body, or of a chunk
        self.chunk_done = True  # chunked: between chunks
        self.continue_ = fields.get(b"expect", b"").lower() == b"100-continue"
        self.body_done = not self.chunked and self.remaining == 0
        self.delivered = False  # the last http.request message went to the app
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = self.complete = self.disconnected = False
        self.response_chunked = False
        self.to_send: int | None = None  # a sized response: bytes still owed
        self._waiting: trio.CancelScope | None = None

    def scope(self) -> dict[str, Any]:
        h1 = self.h1
        return _scope(self.version[5:].decode(), self.method, self.target,
                      self.request_headers, h1.client, h1.local)

    # -------- the request body

    async def receive(self) -> dict[str, Any]:
        if self.disconnected:
            return _DISCONNECT
        if self.body_done:
            if not self.delivered:
                self.delivered = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return await self._disconnect()
        if self.continue_ and not self.h1.buf:
            self.continue_ = False
            await self.h1.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await self._body()
        except EOFError:
            self.disconnected = True
            return _DISCONNECT
        self.delivered = self.body_done
        return {"type": "http.request", "body": body, "more_body": not self.body_done}

    async def _body(self) -> bytes:
        """What of the body is buffered (reading when nothing is)."""
        h1 = self.h1
        while True:
            if not self.chunked:
                if h1.buf:
                    take = bytes(h1.buf[: self.remaining])
                    del h1.buf[: len(take)]
                    self.remaining -= len(take)
                    self.body_done = self.remaining == 0
                    return take
            else:
                out = self._chunks()
                if out or self.body_done:
                    return out
            if h1.eof or not await h1.read():
                raise EOFError

    def _chunks(self) -> bytes:
        """Decode the complete chunks in the buffer (RFC 9112 7.1)."""
        buf, out = self.h1.buf, []
        while not self.body_done:
            if self.remaining:
                take = bytes(buf[: self.remaining])
                del buf[: len(take)]
                self.remaining -= len(take)
                out.append(take)
                if self.remaining:
                    break
                self.chunk_done = False
                continue
            if not self.chunk_done:  # the CRLF after a chunk's data
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise BadRequest("bad chunk")
                del buf[:2]
                self.chunk_done = True
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > 4096:
                    raise BadRequest("chunk size line too long")
                break
            size_text = bytes(buf[:end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise BadRequest("bad chunk size") from None
            if size == 0:  # the last chunk, then trailers up to an empty line
                close = buf.find(b"\r\n\r\n", end)
                if close < 0:
                    break
                del buf[: close + 4]
                self.body_done = True
                break
            del buf[: end + 2]
            self.remaining = size
        return b"".join(out)

    async def skip_body(self) -> None:
        with trio.move_on_after(5.0):
            while not self.body_done:
                try:
                    await self._body()
                except EOFError:
                    break
        if not self.body_done:
            self.keep_alive = False

    async def _disconnect(self) -> dict[str, Any]:
        """After the body: returns once the response is complete or the client
        has gone (reading on; a pipelined next request stays buffered)."""
        with trio.CancelScope() as self._waiting:  # cancelled once the response is complete
            while not (self.complete or self.disconnected or self.h1.broken or self.h1.eof):
                if not await self.h1.read():
                    break
        self.disconnected = self.disconnected or self.h1.eof
        self._waiting = None
        return _DISCONNECT

    # -------- the response

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", ()))
            return
        if kind != "http.response.body" or self.complete:
            return
        out = self._head() if not self.started else b""
        body: bytes = message.get("body", b"")
        end = not message.get("more_body", False)
        if body and self.method != b"HEAD" and self.status not in (204, 304):
            if self.response_chunked:
                out += b"%x\r\n%s\r\n" % (len(body), body)
            else:
                if self.to_send is not None:
                    body = body[: self.to_send]
                    self.to_send -= len(body)
                out += body
        if end:
            if self.response_chunked:
                out += b"0\r\n\r\n"
            self.complete = self.to_send in (None, 0) or self.method == b"HEAD"
            if not self.complete:
                self.h1.broken = True  # fewer bytes than its Content-Length: close
            if self._waiting is not None:
                self._waiting.cancel()
        await self.h1.write(out)

    def _head(self) -> bytes:
        self.started = True
        lines = [b"HTTP/1.1 %d %s" % (self.status, _REASONS.get(self.status, b""))]
        sized = False
        for name, value in self.headers:
            if name == b"content-length":
                sized = True
                self.to_send = int(value) if value.isdigit() else None
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
            if name != b"transfer-encoding":
                lines.append(name + b": " + value)
        if not sized and self.method != b"HEAD" and self.status not in (204, 304):
            if self.version == b"HTTP/1.1":
                self.response_chunked = True
                lines.append(b"transfer-encoding: chunked")
            else:
                self.keep_alive = False  # HTTP/1.0: the body ends with the connection
        if not self.keep_alive:
            lines.append(b"connection: close")
        elif self.version == b"HTTP/1.0":
            lines.append(b"connection: keep-alive")
        lines.append(b"\r\n")
        return b"\r\n".join(lines)


# ---------------------------------------------------------------- HTTP/2: the connection


class _H2:
    """One HTTP/2 connection: this task reads and feeds :class:`H2Core`; each
    stream runs the app in a task of its own. Whoever queues bytes writes
    them, unless a write is in flight: that writer sends them when its own
    write is done (no writer task to wake: ~15 us less per request)."""

    def __init__(self, server: LeanServer, stream: trio.SocketStream) -> None:
        self.server, self.stream = server, stream
        self.core = H2Core()
        self.client, self.local = _addresses(stream)
        self.streams: dict[int, _H2Stream] = {}
        self.nursery: trio.Nursery | None = None
        self.read_scope = trio.CancelScope()
        self.idle_since: float | None = trio.current_time()  # no stream open since
        self.closed = self.draining = False
        self._writing = False
        self._window: trio.Event | None = None  # for senders waiting for flow-control credit
        self._written: trio.Event | None = None  # for senders held back by HIGH_WATER

    def drain(self) -> None:
        """Close once no stream is in flight (then GOAWAY), as hypercorn does: a
        GOAWAY under a live stream fails it in httpcore's client."""
        self.draining = True
        self.expire()

    def expire(self) -> None:
        if not self.streams:
            self.read_scope.cancel()

    async def run(self, data: bytes) -> None:
        async with trio.open_nursery() as streams:
            self.nursery = streams
            self._receive(data)
            await self.flush()
            with self.read_scope:
                await self._read_loop()
            self._close()
            streams.cancel_scope.cancel()
        self.core.goaway()  # a final GOAWAY, if the peer still listens
        await self.flush(grace=1.0)

    async def _read_loop(self) -> None:
        while not self.closed:
            data = await self.stream.receive_some(READ_SIZE)
            if not data:
                return
            self._receive(data)
            await self.flush()

    def _receive(self, data: bytes) -> None:
        for event in self.core.receive(data):
            kind, sid = event[0], event[1]
            if kind == REQUEST:
                self._open(sid, event[2], event[3])
            elif kind == DATA:
                self._data(sid, event[2], event[3], event[4])
            elif kind == END:
                if (s := self.streams.get(sid)) is not None:
                    s.body_done = True
                    if s.deferred:
                        self._answer_or_start(s)
                    s.wake()
            elif kind == RESET:
                if (s := self.streams.get(sid)) is not None:
                    s.reset()
                    if s.deferred:  # no task owns it yet
                        self._forget(s)
            elif kind == WINDOW:
                self._wake_senders()
            elif kind == CLOSED:
                self.closed = True

    def _wake_senders(self) -> None:
        if self._window is not None:
            self._window.set()
            self._window = None

    def _open(self, sid: int, raw: list[tuple[bytes, bytes]], ended: bool) -> None:
        pseudo: dict[bytes, bytes] = {}
        headers: list[tuple[bytes, bytes]] = []
        for name, value in raw:
            if name[:1] == b":":
                pseudo[name] = value
            else:
                headers.append((name, value))
        scope = _scope("2", pseudo.get(b":method", b"GET"), pseudo.get(b":path", b"/"),
                       headers, self.client, self.local)
        scope["scheme"] = pseudo.get(b":scheme", b"http").decode("latin-1")
        self.idle_since = None
        stream = self.streams[sid] = _H2Stream(self, sid, scope)
        stream.body_done = ended
        if self.server.answer_now is None:
            self._start(stream)
        elif ended:
            self._answer_or_start(stream)
        else:
            stream.deferred = True  # until its body is here: answer_now may answer it

    def _data(self, sid: int, data: bytes, length: int, ended: bool) -> None:
        s = self.streams.get(sid)
        if s is None or s.closed:  # a stream we no longer read: credit it now
            self.core.credit(sid, length)
            return
        s.body.append((data, length))
        s.body_done = ended
        s.buffered += length
        if s.deferred and (ended or s.buffered > DEFER_BODY):
            self._answer_or_start(s)
        s.wake()

    def _start(self, stream: _H2Stream, answer: Answer | None = None) -> None:
        stream.deferred = False
        assert self.nursery is not None
        self.nursery.start_soon(self._run_stream, stream, answer)

    def _answer_or_start(self, stream: _H2Stream) -> None:
        """``answer_now``'s response queued here and now, if it gives one (and
        it fits the flow-control window); else the app's task."""
        answer_now = self.server.answer_now
        if not stream.body_done or answer_now is None:
            self._start(stream)
            return
        try:
            answer = answer_now(stream.scope, b"".join(c for c, _ in stream.body))
        except Exception:
            log.exception("lean server: error in answer_now on %s", stream.scope["path"])
            self.core.reset(stream.sid, INTERNAL_ERROR)
            stream.closed = True
            self._forget(stream)
            return
        if answer is None:
            self._start(stream)
            return
        for _, length in stream.body:
            self.core.credit(stream.sid, length)
        stream.body, stream.delivered = [], True
        status, headers, body = answer
        if len(body) > self.core.window(stream.sid):
            self._start(stream, answer)  # sent by a task that waits for credit
            return
        head = [(b":status", str(status).encode()), *headers]
        self.core.send_headers(stream.sid, head, not body)
        if body:
            self.core.send_data(stream.sid, body, True)
        stream.complete = stream.closed = True
        self._forget(stream)

    def _forget(self, stream: _H2Stream) -> None:
        del self.streams[stream.sid]
        if not self.streams:
            self.idle_since = trio.current_time()
            if self.draining:
                self.read_scope.cancel()

    async def _run_stream(self, stream: _H2Stream, answer: Answer | None) -> None:
        scope = stream.scope
        try:
            if answer is None:
                await self.server.app(scope, stream.receive, stream.send)
            else:
                status, headers, body = answer
                await stream.send({"type": "http.response.start", "status": status,
                                   "headers": headers})
                await stream.send({"type": "http.response.body", "body": body})
        except Exception:
            log.exception("lean server: error in the app on %s %s", scope["method"], scope["path"])
        finally:
            stream.finish()
            self._forget(stream)
            await self.flush()

    # -------- writing

    async def flush(self, *, grace: float = WRITE_TIMEOUT) -> None:
        """Send what the core has queued, for at most ``grace`` seconds a write
        (shielded: a write cut short by a cancellation would corrupt every
        stream of the connection)."""
        if self._writing:
            return  # the write in flight sends it next
        self._writing = True
        try:
            while data := self.core.data_to_send():
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + grace
                    await self.stream.send_all(data)
                if scope.cancelled_caught:
                    raise trio.BrokenResourceError("write timed out")
                if self._written is not None:
                    self._written.set()
                    self._written = None
        except _CLOSED:
            self._close()
            self.read_scope.cancel()
        finally:
            self._writing = False

    async def wait_written(self) -> None:
        """Backpressure: wait while much is queued behind a write in flight."""
        while not self.closed and len(self.core.out) > HIGH_WATER:
            if not self._writing:
                await self.flush()
                continue
            if self._written is None:
                self._written = trio.Event()
            await self._written.wait()

    async def wait_window(self) -> None:
        if self._window is None:
            self._window = trio.Event()
        await self._window.wait()

    def _close(self) -> None:
        self.closed = True
        for s in list(self.streams.values()):
            s.reset()
        self._wake_senders()
        if self._written is not None:
            self._written.set()


class _H2Stream:
    """``receive`` and ``send`` of one HTTP/2 stream."""

    def __init__(self, h2c: _H2, sid: int, scope: dict[str, Any]) -> None:
        self.h2c, self.sid, self.scope = h2c, sid, scope
        self.deferred = False  # not started: waiting for its body (for answer_now)
        self.buffered = 0
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
        core = self.h2c.core
        while True:
            if self.closed:
                return _DISCONNECT
            if self.body:
                chunks, self.body = self.body, []
                for _, length in chunks:
                    core.credit(self.sid, length)
                more = not self.body_done
                if more:
                    await self.h2c.flush()  # credit now: the client may wait for it to send the rest
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
        core = self.h2c.core
        try:
            if not self.started:
                self.started = True
                head = [(b":status", str(self.status).encode()), *self.headers]
                core.send_headers(self.sid, head, end and not body)
            elif end and not body:
                core.send_data(self.sid, b"", True)
            if body:
                await self._send_data(body, end)
        except StreamGone:
            self.reset()  # the client reset it, or the connection is closing
            return
        if end:
            self.complete = True
            self.wake()
        await self.h2c.flush()
        await self.h2c.wait_written()

    async def _send_data(self, data: bytes, end: bool) -> None:
        core = self.h2c.core
        while data:
            size = min(len(data), core.window(self.sid))
            if size <= 0:
                await self.h2c.flush()
                await self.h2c.wait_window()
                if self.closed:
                    raise StreamGone(self.sid)
                continue
            core.send_data(self.sid, data[:size], end and size == len(data))
            data = data[size:]

    def finish(self) -> None:
        """The app returned: reset a response it left unfinished (or answer 500
        when it sent nothing), and credit any body it never read."""
        core = self.h2c.core
        for _, length in self.body:
            core.credit(self.sid, length)
        self.body = []
        if not self.complete and not self.closed:
            if self.started:
                core.reset(self.sid, INTERNAL_ERROR)
            else:
                try:
                    core.send_headers(self.sid, [(b":status", b"500"), (b"content-length", b"0")],
                                      True)
                except StreamGone:
                    pass
        self.closed = True

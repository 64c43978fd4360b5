"""backends.h2client over real HTTP/2 on loopback: hypercorn (through
frontend.serving) for the ordinary paths, and a scripted h2 server on trio
sockets for the faults (GOAWAY mid-flight, refused and reset streams, a
server that floods abandoned streams, a server killed mid-stream)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest
import trio
import trio.testing

from backends import h2client
from backends.h2client import (
    ConnectError,
    ConnectionLost,
    H2Pool,
    H2Response,
    H2Unsupported,
    PoolClosed,
    PoolTimeout,
    RefusedStream,
    StreamReset,
)
from frontend.serving import ServeOptions, serve
from tests.backends.conftest import TLSFiles, eventually

MiB = 1 << 20


# ---------------------------------------------------------------- an ASGI app for hypercorn


class App:
    """/hello, /echo (the body back), /sse?n (n SSE events), /slow?n (n
    chunks 10 ms apart; records an http.disconnect)."""

    def __init__(self) -> None:
        self.disconnected = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        path = scope["path"]
        if path == "/slow":
            await self._slow(receive, send, int(scope["query_string"] or 1000))
            return
        kind = b"text/event-stream" if path == "/sse" else b"text/plain"
        headers = [(b"content-type", kind), (b"x-test", b"1"), (b"x-test", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if path == "/sse":
            for i in range(int(scope["query_string"] or 20)):
                chunk = f"data: {i} {len(body)}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            reply = body if path == "/echo" else b"hello"
            await send({"type": "http.response.body", "body": reply})

    async def _slow(self, receive: Any, send: Any, n: int) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                if (await receive())["type"] == "http.disconnect":
                    self.disconnected.set()
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            for i in range(n):
                await send({"type": "http.response.body", "body": b"x%d," % i, "more_body": True})
                await trio.sleep(0.01)
            await send({"type": "http.response.body", "body": b""})
            nursery.cancel_scope.cancel()


async def serve_app(
    nursery: trio.Nursery, app: App, certs: TLSFiles | None = None
) -> tuple[str, int]:
    options = ServeOptions(
        certfile=certs.certfile if certs else None,
        keyfile=certs.keyfile if certs else None,
        graceful_timeout=0.5,
    )
    url = await nursery.start(serve, app, options)
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


# ---------------------------------------------------------------- a scripted h2 server


class Gone(Exception):
    """The client reset the stream (or the connection went away)."""


class ServerConn:
    """One server-side connection; handlers call respond / send / goaway."""

    def __init__(self, stream: trio.SocketStream, max_streams: int) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams},
        )
        self.lock = trio.Lock()
        self.window = trio.Event()
        self.resets: dict[int, int] = {}
        self.sent: defaultdict[int, int] = defaultdict(int)
        self.ended: defaultdict[int, trio.Event] = defaultdict(trio.Event)
        self.closed = trio.Event()

    async def flush(self) -> None:
        async with self.lock:
            data = self.h2.data_to_send()
            if data:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise Gone from None

    def _check(self, sid: int) -> None:
        if sid in self.resets or self.closed.is_set():
            raise Gone

    async def respond(
        self, sid: int, status: int = 200, *, end: bool = False, headers: list[tuple[bytes, bytes]] = ()  # type: ignore[assignment]
    ) -> None:
        self._check(sid)
        self.h2.send_headers(sid, [(b":status", str(status).encode()), *headers], end_stream=end)
        await self.flush()

    async def send(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """Send as flow control allows (waiting for WINDOW_UPDATEs)."""
        view = memoryview(data)
        while True:
            self._check(sid)
            window = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if window > 0 or not view:
                n = min(window, len(view))
                self.h2.send_data(sid, view[:n].tobytes(), end_stream=end and n == len(view))
                self.sent[sid] += n
                view = view[n:]
                if not view:
                    await self.flush()
                    return
                continue
            poked = self.window  # taken before the flush, so no poke is missed
            await self.flush()
            await poked.wait()

    def poke(self) -> None:
        """Wake every handler waiting for window (or for the stream's end)."""
        self.window.set()
        self.window = trio.Event()

    async def goaway(self, last_stream_id: int) -> None:
        # h2 refuses frames after its own GOAWAY, so the frame is written by
        # hand: the server goes on serving streams up to last_stream_id.
        payload = struct.pack(">II", last_stream_id, 0)
        frame = struct.pack(">I", len(payload))[1:] + bytes([7, 0]) + struct.pack(">I", 0)
        async with self.lock:
            await self.stream.send_all(frame + payload)

    def abort(self) -> None:
        """Close the TCP connection with a reset, as a crashed host would."""
        self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.stream.socket.close()
        self.closed.set()
        self.poke()


Handler = Callable[[ServerConn, int, dict[bytes, bytes]], Awaitable[None]]


class ScriptedServer:
    def __init__(self, handler: Handler, *, max_streams: int = 100) -> None:
        self.handler = handler
        self.max_streams = max_streams
        self.conns: list[ServerConn] = []
        self.requests = 0
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> ScriptedServer:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._serve, listeners)
        return self

    def pool(self, **kw: Any) -> H2Pool:
        return H2Pool("127.0.0.1", self.port, **kw)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = ServerConn(stream, self.max_streams)
        self.conns.append(conn)
        conn.h2.initiate_connection()
        try:
            async with trio.open_nursery() as nursery:
                await conn.flush()
                while data := await stream.receive_some(65536):
                    self._dispatch(conn, conn.h2.receive_data(data), nursery)
                    await conn.flush()
                nursery.cancel_scope.cancel()
        except (Gone, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            conn.closed.set()
            conn.poke()

    def _dispatch(self, conn: ServerConn, events: list[Any], nursery: trio.Nursery) -> None:
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                self.requests += 1
                nursery.start_soon(self._handle, conn, ev.stream_id, dict(ev.headers))
            elif isinstance(ev, h2.events.DataReceived):
                conn.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                conn.ended[ev.stream_id].set()
            elif isinstance(ev, h2.events.StreamReset):
                conn.resets[ev.stream_id] = ev.error_code
                conn.poke()
            elif isinstance(ev, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                conn.poke()

    async def _handle(self, conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        try:
            await self.handler(conn, sid, headers)
        except (Gone, h2.exceptions.StreamClosedError):
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- ordinary paths


async def test_get_and_streamed_post_over_hypercorn(nursery: trio.Nursery) -> None:
    """A GET and a streamed POST share one connection; headers, status and
    every SSE chunk arrive; request() returns status, headers and body."""
    host, port = await serve_app(nursery, App())
    with trio.fail_after(5):
        async with H2Pool(host, port, headers={"User-Agent": "t"}) as pool:
            reply = await pool.request("GET", "/hello")
            assert (reply.status, reply.body) == (200, b"hello")
            assert (
                reply.headers["x-test"] == "1, 2" and reply.headers["content-type"] == "text/plain"
            )
            async with pool.stream("POST", "/sse?20", body=b"abc") as resp:
                assert resp.status == 200 and resp.http_version == "HTTP/2"
                assert (b"content-type", b"text/event-stream") in resp.raw_headers
                text = b"".join([chunk async for chunk in resp.aiter_bytes()])
            assert text == b"".join(b"data: %d 3\n\n" % i for i in range(20))
            stats = pool.statistics()
            assert stats.connections_opened == 1 and stats.streams_opened == 2
            assert stats.streams_cancelled == 0 and stats.connections[0].streams == 0


async def test_a_body_larger_than_the_servers_window_is_sent_whole(nursery: trio.Nursery) -> None:
    host, port = await serve_app(nursery, App())
    body = os.urandom(3 * MiB)
    with trio.fail_after(10):
        async with H2Pool(host, port) as pool:
            reply = await pool.request("POST", "/echo", body=body, limit=4 * MiB)
    assert reply.body == body


async def test_writes_the_socket_takes_at_once_go_out_without_send_all(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's frames are written straight to the socket when it takes
    them (no cancel scope, no ``send_all``); only the rest of a larger write
    goes through ``send_all``."""
    whole, partial_writes = [], []
    write_now = h2client.write_now

    def counted(stream: object, data: bytes) -> int:
        sent = write_now(stream, data)
        (whole if sent == len(data) else partial_writes).append(len(data))
        return sent

    monkeypatch.setattr(h2client, "write_now", counted)
    host, port = await serve_app(nursery, App())
    with trio.fail_after(5):
        async with H2Pool(host, port) as pool:
            assert (await pool.request("GET", "/hello")).body == b"hello"
            assert whole and not partial_writes
            body = os.urandom(3 * MiB)  # more than a socket takes at once: the rest through send_all
            reply = await pool.request("POST", "/echo", body=body, limit=4 * MiB)
    assert reply.body == body


async def test_a_peer_that_stops_reading_fails_the_connection_after_write_timeout(nursery: trio.Nursery) -> None:
    """A server that grants a large window and then never reads: the
    client's body fills the socket, its write blocks, and after
    ``write_timeout`` the connection fails (not a hang)."""

    async def stuck(stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: (1 << 31) - 1})
        conn.increment_flow_control_window((1 << 31) - 1 - 65535)
        await stream.send_all(conn.data_to_send())
        await trio.sleep_forever()  # reads nothing, ever

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, stuck, listeners)
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(10):
        async with H2Pool("127.0.0.1", port, write_timeout=0.5, connection_window=(1 << 31) - 1) as pool:
            started = trio.current_time()
            with pytest.raises(ConnectionLost, match="write blocked"):
                await pool.request("POST", "/x", body=b"\0" * (64 * MiB))
            assert trio.current_time() - started >= 0.5


async def test_tls_with_alpn_h2(nursery: trio.Nursery, tls_files: TLSFiles) -> None:
    host, port = await serve_app(nursery, App(), tls_files)
    with trio.fail_after(5):
        async with H2Pool(host, port, ssl_context=tls_files.client_context) as pool:
            assert (await pool.request("GET", "/hello")).body == b"hello"


async def test_tls_server_without_h2_raises_h2_unsupported(
    nursery: trio.Nursery, tls_files: TLSFiles
) -> None:
    """The adapter falls back to HTTP/1.1 on H2Unsupported."""
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls_files.certfile, tls_files.keyfile)
    context.set_alpn_protocols(["http/1.1"])

    async def handle(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, context, server_side=True)
        try:
            await tls.do_handshake()
            await tls.receive_some()
        except trio.BrokenResourceError:
            pass

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, handle, listeners)
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(5):
        async with H2Pool("127.0.0.1", port, ssl_context=tls_files.client_context) as pool:
            with pytest.raises(H2Unsupported, match=r"http/1\.1") as info:
                await pool.request("GET", "/")
    assert info.value.safe_to_retry


async def test_cleartext_http1_server_raises_h2_unsupported(nursery: trio.Nursery) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, handle, listeners)
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(5):
        async with H2Pool("127.0.0.1", port) as pool:
            with pytest.raises(H2Unsupported):
                await pool.request("GET", "/")


async def test_connection_refused_raises_connect_error() -> None:
    with trio.fail_after(5):
        async with H2Pool("127.0.0.1", free_port(), connect_timeout=1) as pool:
            with pytest.raises(ConnectError) as info:
                await pool.request("GET", "/")
    assert info.value.safe_to_retry


async def test_a_closed_pool_refuses_requests_and_fails_those_in_flight(
    nursery: trio.Nursery,
) -> None:
    host, port = await serve_app(nursery, App())
    pool = H2Pool(host, port)
    with trio.fail_after(5):
        async with pool.stream("GET", "/slow") as resp:
            await resp.aiter_bytes().__anext__()
            await pool.aclose()
            with pytest.raises(PoolClosed):
                await resp.read()
        with pytest.raises(PoolClosed):
            await pool.request("GET", "/hello")


async def test_an_idle_connection_past_idle_timeout_is_replaced(nursery: trio.Nursery) -> None:
    host, port = await serve_app(nursery, App())
    with trio.fail_after(5):
        async with H2Pool(host, port, idle_timeout=0.0) as pool:
            await pool.request("GET", "/hello")
            await trio.sleep(0.01)
            await pool.request("GET", "/hello")
            assert pool.statistics().connections_opened == 2
            assert len(pool.statistics().connections) == 1


async def _by_turns(host: str, port: int, one_cancelled: Callable[[H2Pool], Awaitable[None]],
                    one_complete: Callable[[H2Pool], Awaitable[None]], complete: list[bytes]) -> None:
    """20 streams that are cancelled and 20 that complete (``/slow?20``,
    appending their bodies to ``complete``) on one connection: every
    complete one got every chunk, and nothing is left open."""
    with trio.fail_after(5):
        async with H2Pool(host, port) as pool:
            async with trio.open_nursery() as inner:
                for _ in range(20):
                    inner.start_soon(one_cancelled, pool)
                    inner.start_soon(one_complete, pool)
            assert complete == [b"".join(b"x%d," % i for i in range(20))] * 20
            stats = pool.statistics()
            assert stats.connections_opened == 1 and stats.streams_cancelled == 20
            assert stats.connections[0].streams == 0


async def test_many_streams_share_one_connection_while_readers_are_cancelled(
    nursery: trio.Nursery,
) -> None:
    """40 streams read one connection by turns; the 20 cancelled after about
    five chunks (often while holding the reader role) hand it over, and the
    other 20 get every chunk."""
    host, port = await serve_app(nursery, App())
    complete: list[bytes] = []

    async def one_cancelled(pool: H2Pool) -> None:
        with trio.CancelScope() as scope:
            async with pool.stream("GET", "/slow?1000") as resp:
                async for _chunk in resp.aiter_bytes():
                    if scope.deadline == float("inf"):
                        scope.deadline = trio.current_time() + 0.05  # about five chunks
        assert scope.cancelled_caught

    async def one_complete(pool: H2Pool) -> None:
        async with pool.stream("GET", "/slow?20") as resp:
            complete.append(await resp.read())

    await _by_turns(host, port, one_cancelled, one_complete, complete)


# ---------------------------------------------------------------- spreading over connections


async def test_streams_beyond_max_concurrent_streams_open_more_connections(
    nursery: trio.Nursery,
) -> None:
    """The server allows 2 streams per connection: 5 held streams take 3
    connections; with max_connections=2 the 5th waits, then PoolTimeout."""
    gate = trio.Event()

    async def held(conn: ServerConn, sid: int, _: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        await gate.wait()
        await conn.send(sid, b"done", end=True)

    server = await ScriptedServer(held, max_streams=2).start(nursery)
    bodies: list[bytes] = []

    async def one(pool: H2Pool) -> None:
        bodies.append((await pool.request("GET", "/")).body)

    with trio.fail_after(5):
        async with server.pool(max_connections=3) as pool, trio.open_nursery() as inner:
            for _ in range(5):
                inner.start_soon(one, pool)
            await eventually(lambda: server.requests == 5, 2)
            assert [c.streams for c in pool.statistics().connections] == [2, 2, 1]
            assert len(server.conns) == 3
            gate.set()
        assert bodies == [b"done"] * 5

    gate = trio.Event()
    with trio.fail_after(5):
        async with (
            server.pool(max_connections=2, pool_timeout=0.2) as pool,
            trio.open_nursery() as inner,
        ):
            for _ in range(4):
                inner.start_soon(one, pool)
            await eventually(lambda: server.requests == 9, 2)
            with pytest.raises(PoolTimeout):
                await pool.request("GET", "/")
            gate.set()


# ---------------------------------------------------------------- GOAWAY, refused, reset


async def test_goaway_lets_streams_below_last_stream_id_finish_and_refuses_the_rest(
    nursery: trio.Nursery,
) -> None:
    """GOAWAY(last=3) with streams 1, 3, 5 open: 1 and 3 complete after it,
    5 raises RefusedStream, a new request goes to a new connection, and the
    old connection closes itself once its streams are done."""
    three, finish = trio.Event(), trio.Event()

    async def handler(conn: ServerConn, sid: int, _: dict[bytes, bytes]) -> None:
        if sid == 5:
            three.set()
            return  # never answered: the GOAWAY refuses it
        if conn is not server.conns[0]:
            await conn.respond(sid)
            await conn.send(sid, b"fresh", end=True)
            return
        await conn.respond(sid)
        await conn.send(sid, b"a")
        await finish.wait()
        await conn.send(sid, b"b", end=True)

    server = await ScriptedServer(handler).start(nursery)
    results: dict[str, object] = {}

    async def one(pool: H2Pool, name: str) -> None:
        try:
            results[name] = (await pool.request("GET", "/")).body
        except RefusedStream as exc:
            results[name] = exc

    with trio.fail_after(5):
        async with server.pool() as pool:
            async with trio.open_nursery() as inner:
                for n, name in enumerate(("s1", "s3", "s5"), 1):
                    inner.start_soon(one, pool, name)
                    await eventually(lambda n=n: server.requests == n, 2)  # type: ignore[misc]
                await three.wait()
                await server.conns[0].goaway(3)
                await eventually(lambda: "s5" in results, 2)
                assert (await pool.request("GET", "/")).body == b"fresh"
                assert len(server.conns) == 2
                finish.set()
            assert results["s1"] == results["s3"] == b"ab"
            assert isinstance(results["s5"], RefusedStream) and results["s5"].safe_to_retry
            await eventually(lambda: server.conns[0].closed.is_set(), 2)
            stats = pool.statistics()
            assert len(stats.connections) == 1 and not stats.connections[0].draining
            assert stats.streams_refused == 1


async def test_hypercorns_broken_goaway_fails_one_stream_fast_instead_of_hanging(
    nursery: trio.Nursery,
) -> None:
    """hypercorn 0.18 sends GOAWAY when a connection passes
    keep_alive_max_requests, while it opens the request's stream, and can
    then send nothing more on it (its h2 is CLOSED). The client's PING after
    GOAWAY makes hypercorn drop the connection: that one request fails at
    once with ConnectionLost (it would otherwise hang), the next ones go to a
    new connection."""

    class Options(ServeOptions):
        def hypercorn_config(self) -> Any:
            config = super().hypercorn_config()
            config.keep_alive_max_requests = 5
            return config

    # hypercorn's own protocol (frontend/lean_h2.py's GOAWAY lets the stream finish)
    url = await nursery.start(serve, App(), Options(graceful_timeout=0.5, h2_ingress="hypercorn"))
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    outcomes: list[str] = []
    with trio.fail_after(5):
        async with H2Pool(host, int(port)) as pool:
            for _ in range(10):
                try:
                    async with pool.stream("POST", "/sse?20") as resp:
                        await resp.read()
                    outcomes.append("ok")
                except ConnectionLost:
                    outcomes.append("lost")
            assert outcomes == ["ok"] * 5 + ["lost"] + ["ok"] * 4
            assert pool.statistics().connections_opened == 2


async def test_reset_streams_raise_refused_stream_or_stream_reset(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        if headers[b":path"] == b"/refuse":
            conn.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
        else:
            await conn.respond(sid)
            await conn.send(sid, b"partial")
            conn.h2.reset_stream(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        await conn.flush()

    server = await ScriptedServer(handler).start(nursery)
    with trio.fail_after(5):
        async with server.pool() as pool:
            with pytest.raises(RefusedStream):
                await pool.request("GET", "/refuse")
            with pytest.raises(StreamReset) as info:
                await pool.request("GET", "/reset")
            assert info.value.error_code == h2.errors.ErrorCodes.INTERNAL_ERROR
            assert pool.statistics().connections_opened == 1  # the connection lives on


# ---------------------------------------------------------------- flow control


def flood(size: int) -> Handler:
    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        if headers[b":path"] == b"/small":
            await conn.send(sid, b"ok", end=True)
        else:
            await conn.send(sid, b"\0" * size, end=True)

    return handler


async def test_abandoned_streams_do_not_stall_the_connection(nursery: trio.Nursery) -> None:
    """24 streams whose server sends 4 MiB each are abandoned after their
    first chunk: more than the 16 MiB connection window arrives for them, and
    all of it is credited, so a new request on the same connection is quick."""
    server = await ScriptedServer(flood(4 * MiB)).start(nursery)
    with trio.fail_after(10):
        async with server.pool(stream_window=MiB) as pool:  # 24 x 1 MiB: over the connection window
            for _ in range(24):
                async with pool.stream("GET", "/big") as resp:
                    async for _chunk in resp.aiter_bytes():
                        break
            with trio.fail_after(2):
                assert (await pool.request("GET", "/small")).body == b"ok"
            (conn,) = server.conns
            assert sum(conn.sent.values()) > 16 * MiB  # the window was credited
            stats = pool.statistics()
            assert stats.connections_opened == 1 and stats.streams_cancelled == 24
            assert conn.resets and set(conn.resets.values()) >= {h2.errors.ErrorCodes.CANCEL}
            window = stats.connections[0].inbound_window
            assert window >= 16 * MiB - 12 * MiB  # uncredited: < our quarter + h2's half


async def test_an_unread_stream_is_bounded_and_does_not_stall_its_neighbours(
    nursery: trio.Nursery,
) -> None:
    """With a 256 KiB stream window and a 1 MiB connection window, a stream
    nobody reads buffers at most 256 KiB while its neighbour reads 4 MiB on
    the same connection; read later, it still delivers everything."""
    server = await ScriptedServer(flood(4 * MiB)).start(nursery)
    with trio.fail_after(10):
        async with server.pool(stream_window=256 << 10, connection_window=MiB) as pool:
            async with pool.stream("GET", "/big") as idle:
                async with pool.stream("GET", "/big") as busy:
                    assert len(await busy.read()) == 4 * MiB
                assert idle.buffered_bytes <= 256 << 10
                assert pool.statistics().connections[0].buffered_bytes <= 256 << 10
                (conn,) = server.conns
                assert conn.sent[1] <= 256 << 10  # the server was held back on this stream only
                assert len(await idle.read()) == 4 * MiB
            assert pool.statistics().connections_opened == 1


# ---------------------------------------------------------------- failures and cancellation


async def test_a_server_that_dies_mid_stream_raises_connection_lost(tmp_path: Path) -> None:
    """A hypercorn process killed with SIGKILL mid-stream: the reader sees
    ConnectionLost; the next request cannot connect."""
    script = tmp_path / "server.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, trio
            from frontend.serving import ServeOptions, serve
            from tests.backends.test_h2client import App

            async def main():
                async with trio.open_nursery() as nursery:
                    url = await nursery.start(serve, App(), ServeOptions())
                    print(url, flush=True)

            trio.run(main)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(20):
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
        host, port = line.decode().strip().rsplit("//", 1)[1].rsplit(":", 1)
        with trio.fail_after(5):
            async with H2Pool(host, int(port), connect_timeout=1) as pool:
                async with pool.stream("GET", "/slow") as resp:
                    chunks = resp.aiter_bytes()
                    assert await chunks.__anext__()
                    proc.kill()
                    with pytest.raises(ConnectionLost):
                        while True:
                            await chunks.__anext__()
                assert pool.statistics().connections == ()
                with pytest.raises(ConnectError):
                    await pool.request("GET", "/hello")
    finally:
        proc.kill()
        await proc.wait()
        await proc.stdout.aclose()  # type: ignore[union-attr]


async def test_cancelling_a_stream_resets_it_and_the_app_sees_disconnect(
    nursery: trio.Nursery,
) -> None:
    app = App()
    host, port = await serve_app(nursery, app)
    with trio.fail_after(5):
        async with H2Pool(host, port) as pool:
            with trio.move_on_after(0.1):
                async with pool.stream("GET", "/slow") as resp:
                    async for _chunk in resp.aiter_bytes():
                        pass
            await eventually(app.disconnected.is_set, 1)
            stats = pool.statistics()
            assert stats.streams_cancelled == 1 and stats.connections[0].streams == 0
            assert (await pool.request("GET", "/hello")).body == b"hello"
            assert pool.statistics().connections_opened == 1


async def test_leaving_early_sends_rst_stream_cancel(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, sid: int, _: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        while True:
            await conn.send(sid, b"tick")
            await trio.sleep(0.005)

    server = await ScriptedServer(handler).start(nursery)
    with trio.fail_after(5):
        async with server.pool() as pool:
            async with pool.stream("GET", "/") as resp:
                async for _chunk in resp.aiter_bytes():
                    break
            await eventually(lambda: 1 in server.conns[0].resets, 1)
    assert server.conns[0].resets[1] == h2.errors.ErrorCodes.CANCEL


async def test_a_finished_stream_closes_without_a_write_and_an_unfinished_one_is_reset(nursery: trio.Nursery) -> None:
    """close_if_finished frees a finished stream's slot synchronously (no
    cancel scope, no await needed by its caller); it leaves an unfinished
    one to aclose, which resets it."""

    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        await conn.send(sid, b"all", end=headers[b":path"] == b"/done")

    server = await ScriptedServer(handler).start(nursery)
    with trio.fail_after(5):
        async with server.pool() as pool:
            async with pool.stream("GET", "/done") as resp:
                assert b"".join([c async for c in resp.aiter_bytes()]) == b"all"
                with trio.testing.assert_no_checkpoints():
                    assert resp.close_if_finished()
                assert pool.statistics().connections[0].streams == 0
            async with pool.stream("GET", "/open") as resp:
                async for _chunk in resp.aiter_bytes():
                    break
                assert not resp.close_if_finished()
                assert pool.statistics().connections[0].streams == 1
            await eventually(lambda: 3 in server.conns[0].resets, 1)
    assert server.conns[0].resets.get(1) is None  # the finished stream was never reset



async def test_ready_says_when_the_next_chunk_needs_no_wait(nursery: trio.Nursery) -> None:
    """``ready()`` is False while the stream has nothing buffered and has not
    ended (a read would wait for the peer), True once a chunk is buffered or
    the stream ended, and then ``__anext__`` returns without a checkpoint:
    the HTTP adapter times no silence around such a read."""
    go = trio.Event()

    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        await go.wait()
        conn.h2.send_data(sid, b"one")
        conn.h2.send_data(sid, b"two", end_stream=True)
        await conn.flush()  # both frames and the end in one write

    server = await ScriptedServer(handler).start(nursery)
    with trio.fail_after(5):
        async with server.pool() as pool, pool.stream("GET", "/") as resp:
            assert not resp.ready()
            go.set()
            assert await resp.__anext__() == b"onetwo"  # read together, taken together
            assert resp.ready()  # ended: the next call raises at once
            with trio.testing.assert_no_checkpoints(), pytest.raises(StopAsyncIteration):
                await resp.__anext__()


# ---------------------------------------------------------------- silences timed by the reader


async def test_next_within_gives_up_at_its_deadline_and_the_stream_goes_on(nursery: trio.Nursery) -> None:
    """``next_within(deadline)``: None once the deadline passes with nothing
    come (the stream still open: a later call gets what comes), a chunk as
    soon as one comes, StopAsyncIteration at the end."""
    go = trio.Event()

    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        await go.wait()
        await conn.send(sid, b"late", end=True)

    server = await ScriptedServer(handler).start(nursery)
    with trio.fail_after(5):
        async with server.pool() as pool, pool.stream("GET", "/") as resp:
            start = trio.current_time()
            assert await resp.next_within(start + 0.2) is None
            assert 0.2 <= trio.current_time() - start < 1.0
            go.set()
            assert await resp.next_within(trio.current_time() + 5) == b"late"
            with pytest.raises(StopAsyncIteration):
                await resp.next_within(trio.current_time() + 5)


@pytest.mark.parametrize("reader", ["silent", "flowing"])
async def test_a_parked_consumers_deadline_is_kept_while_another_reads(nursery: trio.Nursery, reader: str) -> None:
    """Two streams on one connection: the first consumer waits with a long
    deadline (the connection's reader), the second with a short one
    (parked behind it). The second gives up on time whether the reader
    waits on a silent socket (it brings the reader's deadline forward) or
    keeps receiving its own stream's chunks (checked after each read); the
    first is not disturbed, and a chunk that comes for the second is still
    delivered after."""
    go = trio.Event()

    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        if headers[b":path"] == b"/first":
            if reader == "flowing":
                for i in range(60):
                    await conn.send(sid, b"%d," % i)
                    await trio.sleep(0.01)
            await go.wait()
            await conn.send(sid, b"end", end=True)
        else:
            await go.wait()
            await conn.send(sid, b"second", end=True)

    server = await ScriptedServer(handler).start(nursery)
    firsts: list[bytes] = []
    gave_up: list[float] = []
    with trio.fail_after(10):
        async with server.pool() as pool, pool.stream("GET", "/first") as first, pool.stream("GET", "/second") as second:

            async def read_first() -> None:
                while True:
                    try:
                        chunk = await first.next_within(trio.current_time() + 5)
                    except StopAsyncIteration:
                        return
                    assert chunk is not None
                    firsts.append(chunk)

            async with trio.open_nursery() as inner:
                inner.start_soon(read_first)
                await trio.sleep(0.05)  # the first consumer reads (or waits on the socket) now
                start = trio.current_time()
                assert await second.next_within(start + 0.25) is None
                gave_up.append(trio.current_time() - start)
                go.set()
                assert await second.next_within(trio.current_time() + 5) == b"second"
            assert pool.statistics().connections_opened == 1
    assert 0.25 <= gave_up[0] < 1.0, gave_up
    assert b"".join(firsts).endswith(b"end")
    if reader == "flowing":
        assert b"".join(firsts) == b"".join(b"%d," % i for i in range(60)) + b"end"


async def test_timed_readers_cancelled_by_turns_hand_over_and_the_others_time_nothing_out(
    nursery: trio.Nursery,
) -> None:
    """As the test above with ``next_within``: 40 streams read one connection
    by turns, each timing its silences (short deadlines for the 20 that are
    cancelled after about five chunks, often holding the reader role and its
    scope); the other 20 get every chunk and never a spurious silence."""
    host, port = await serve_app(nursery, App())
    complete: list[bytes] = []
    silences: list[int] = []

    async def read_all(resp: H2Response, wait: float) -> bytes:
        out = b""
        while True:
            try:
                chunk = await resp.next_within(trio.current_time() + wait)
            except StopAsyncIteration:
                return out
            if chunk is None:
                silences.append(1)
                continue
            out += chunk

    async def one_cancelled(pool: H2Pool) -> None:
        with trio.move_on_after(0.05) as scope:
            async with pool.stream("GET", "/slow?1000") as resp:
                await read_all(resp, 0.5)
        assert scope.cancelled_caught

    async def one_complete(pool: H2Pool) -> None:
        async with pool.stream("GET", "/slow?20") as resp:
            complete.append(await read_all(resp, 5.0))

    await _by_turns(host, port, one_cancelled, one_complete, complete)
    assert silences == []


async def test_the_reader_role_skips_parked_tasks_cancelled_before_they_ran(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's stream ends in the same turn as four parked consumers
    are cancelled (their aborts ran, they have not): the role goes to the
    consumer parked after them, not to a cancelled one, which would leave
    without reading and strand the rest (the by-turns tests above hung on
    this about once in four)."""
    go = {b"/reader": trio.Event(), b"/survivor": trio.Event(), b"/cancelled": trio.Event()}

    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        await go[headers[b":path"]].wait()
        await conn.send(sid, b"news", end=True)

    scopes = [trio.CancelScope() for _ in range(4)]
    armed: list[int] = []
    real_read_some = h2client.read_some

    async def read_then_cancel(*args: Any, **kwargs: Any) -> bytes:
        data = await real_read_some(*args, **kwargs)
        if armed:  # in the reader's turn, before the parked tasks can run
            armed.clear()
            for scope in scopes:
                scope.cancel()
        return data

    monkeypatch.setattr(h2client, "read_some", read_then_cancel)
    server = await ScriptedServer(handler).start(nursery)
    got: list[bytes] = []

    async def consume(pool: H2Pool, path: str, scope: trio.CancelScope) -> None:
        with scope:
            async with pool.stream("GET", path) as resp:
                got.append(await resp.read())

    with trio.fail_after(5):
        async with server.pool() as pool, trio.open_nursery() as inner:
            inner.start_soon(consume, pool, "/reader", trio.CancelScope())
            await trio.testing.wait_all_tasks_blocked()  # reads the socket
            for scope in scopes:
                inner.start_soon(consume, pool, "/cancelled", scope)
                await trio.testing.wait_all_tasks_blocked()  # parked, in turn
            inner.start_soon(consume, pool, "/survivor", trio.CancelScope())
            await trio.testing.wait_all_tasks_blocked()  # parked last
            armed.append(1)
            go[b"/reader"].set()  # its last news: it leaves the role as the four are cancelled
            await trio.testing.wait_all_tasks_blocked()
            go[b"/survivor"].set()  # only a reader hands it its news
    assert got == [b"news", b"news"]
    assert all(scope.cancelled_caught for scope in scopes)


async def test_a_read_the_socket_already_holds_enters_no_cancel_scope(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader waits under a cancel scope only where the socket has
    nothing yet: bytes already there are read with none."""
    first, sent = trio.Event(), trio.Event()

    async def handler(conn: ServerConn, sid: int, headers: dict[bytes, bytes]) -> None:
        await conn.respond(sid)
        await first.wait()
        await conn.send(sid, b"waited")
        await sent.wait()
        await conn.send(sid, b"there", end=True)

    entered: list[int] = []
    enter = trio.CancelScope.__enter__

    def counted(self: trio.CancelScope) -> trio.CancelScope:
        entered.append(1)
        return enter(self)

    server = await ScriptedServer(handler).start(nursery)
    with trio.fail_after(5):
        async with server.pool() as pool, pool.stream("GET", "/") as resp:
            monkeypatch.setattr(trio.CancelScope, "__enter__", counted)
            assert await resp.next_within(trio.current_time() + 0.1) is None  # a silence: timed in a scope
            assert entered
            first.set()
            assert await resp.next_within(trio.current_time() + 5) == b"waited"
            sent.set()
            await trio.sleep(0.1)  # "there" sits in the socket, unread
            entered.clear()
            assert await resp.next_within(trio.current_time() + 5) == b"there"
            monkeypatch.undo()
    assert entered == []


# ---------------------------------------------------------------- the lean socket read


async def test_read_some_reads_waits_and_fails_as_trios_receive_some() -> None:
    """``read_some`` on a plain TCP stream: what is there at once, else a
    wait; b"" at the peer's end; a checkpoint either way (a cancelled caller
    is told even with data waiting); a reset peer is BrokenResourceError, a
    socket closed here ClosedResourceError, as trio's ``receive_some``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listeners[0].accept())  # type: ignore[arg-type]

        nursery.start_soon(accept)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await eventually(lambda: bool(accepted), 2)
        server = accepted[0]

        await server.send_all(b"ready")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(trio.Cancelled):
                await h2client.read_some(client, 100)  # data waits, but the caller is cancelled
        with trio.testing.assert_checkpoints():  # a schedule point too, even with the data there
            assert await h2client.read_some(client, 100) == b"ready"

        sent = trio.Event()

        async def later() -> None:
            await trio.sleep(0.05)
            await server.send_all(b"late")
            sent.set()

        nursery.start_soon(later)
        assert h2client.read_now(client, 100) is None  # nothing there yet: no wait, no read
        assert await h2client.read_some(client, 100, wait_first=True) == b"late"  # waited for it
        await sent.wait()
        await server.send_all(b"now")
        with trio.fail_after(2):
            while (now := h2client.read_now(client, 100)) is None:
                await trio.sleep(0.01)
        assert now == b"now"  # what is there, at once, without a checkpoint
        await server.send_eof()
        assert await h2client.read_some(client, 100) == b""

        other = await trio.open_tcp_stream("127.0.0.1", port)
        nursery.start_soon(accept)
        await eventually(lambda: len(accepted) == 2, 2)
        accepted[1].socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        accepted[1].socket.close()  # an RST
        with pytest.raises(trio.BrokenResourceError):
            await h2client.read_some(other, 100)
        await other.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await h2client.read_some(other, 100)
        await client.aclose()
        await server.aclose()
        for listener in listeners:
            await listener.aclose()

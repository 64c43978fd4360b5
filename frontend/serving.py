"""Serve an ASGI app with hypercorn's trio worker: the one HTTP stack shared by
the router, the engine server and the mock server.

HTTP/1.1, HTTP/2 cleartext (prior knowledge and Upgrade) and HTTP/2 over TLS
with ALPN (frontend/tls.py: TLS 1.2+, modern ciphers; :func:`reload_on_sighup`
re-reads the certificate files without dropping a connection). Graceful
shutdown: when ``shutdown`` is set, stop accepting and let in-flight streams
finish for up to ``graceful_timeout`` seconds.

Connections are not recycled after a number of requests (hypercorn closes
them after 1,000 by default: GOAWAY on HTTP/2, ``Connection: close`` on
HTTP/1.1), since every client of ours, the router's upstream pool included,
holds one connection for as long as it can. ``reuse_port`` binds with
``SO_REUSEPORT`` so that several processes serve one port (``headrace serve
--workers N``); :func:`reserve_port` holds such a port in the parent.

hypercorn's internals are patched in :func:`_patch_hypercorn`, against the
0.18 series, and by frontend/hardening.py (ingress limits: streams per
connection, bounded unsent output, write stalls, reset and control-frame
budgets, connection caps with a reserve for ``reserved_paths``, request
smuggling, secrets in library logs; ``ServeOptions(limits=...)``);
tests/frontend/test_serving.py checks that each patched method and
attribute still has the shape the patches rely on.
"""

from __future__ import annotations

import logging
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.handlers import format_date_time

import h2.errors
import h2.events
import h2.exceptions
import h11
import hypercorn.protocol as hypercorn_protocol
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import h2 as hypercorn_h2
from hypercorn.protocol import h11 as hypercorn_h11
from hypercorn.protocol.events import Body, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import build_and_validate_headers, suppress_body

from frontend import hardening
from frontend.h2_scheduler import RoundRobinStreams
from frontend.lean_h2 import GOAWAY_DELAY, lean_h2_protocol
from frontend.limits import DEFAULT_LIMITS, ConnectionLedger, Limits
from frontend.server import BODY_FOLLOWS, BODY_WRITER, ON_DISCONNECT, DisconnectHook
from frontend.tls import HANDSHAKE_TIMEOUT, Certificates

__all__ = ["Limits", "ServeOptions", "os_error_in", "reload_on_sighup", "reserve_port", "serve", "wait_for_signal"]

log = logging.getLogger(__name__)


# How long closing a connection waits for a send in progress to finish before
# it closes the socket anyway (a peer that stopped reading must not keep it).
CLOSE_SEND_WAIT = 5.0
# ServeOptions' HTTP/2 ingress when none is named ("hypercorn" or "lean").
DEFAULT_H2_INGRESS = "lean"


def _patch_hypercorn() -> None:
    """Fixes for hypercorn 0.18. The first three each let one client stop the
    whole server (an exception in a connection handler tears down hypercorn's
    server nursery):

    1. DATA for a stream hypercorn already closed (e.g. after we answered 413
       before the body ended) raised KeyError. Such frames are dropped here,
       still crediting flow control. A stream opened by a HEADERS frame in the
       same batch is not closed, so its DATA is kept.
    2. An HTTP/2 stream whose app ended mid-body was forgotten without a
       reset, so the client waited forever (HTTP/1.1 closes the connection).
    3. Any other exception out of one connection (a malformed h2c
       ``HTTP2-Settings`` header raised ``binascii.Error``) is logged and closes
       that connection only.
    4. Closing a connection sent EOF outside the send lock, so a send that
       started meanwhile raised ``BusyResourceError`` (see :func:`_close_under_send_lock`).

    And two for cost, :func:`_end_stream_with_the_last_data` and
    :func:`_schedule_streams_round_robin`, and one for shutdown,
    :func:`_release_buffers_when_the_connection_closes`.
    """
    protocol = hypercorn_h2.H2Protocol
    if getattr(protocol, "_headrace_patched", False):
        return
    handle_events = protocol._handle_events

    async def _handle_events(self: Any, events: list[h2.events.Event]) -> None:
        opened = {e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)}
        kept = []
        for event in events:
            if (
                isinstance(event, h2.events.DataReceived)
                and event.stream_id not in self.streams
                and event.stream_id not in opened
            ):
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            kept.append(event)
        await handle_events(self, kept)

    run = TCPServer.run

    async def _run(self: Any) -> None:
        try:
            await run(self)
        except* Exception as group:
            log.warning("closing a connection after an error in hypercorn: %r", group.exceptions)

    protocol._handle_events = _handle_events  # type: ignore[method-assign]
    protocol._headrace_patched = True  # type: ignore[attr-defined]
    TCPServer.run = _run  # type: ignore[method-assign]
    _goaway_after_the_last_byte()
    _reset_h2_stream_on_app_error()
    _close_under_send_lock()
    _schedule_streams_round_robin()
    _send_whole_responses_in_one_write()
    _recycle_after_an_answer_given_at_content_length()
    _call_the_app_back_on_disconnect()
    _wake_the_sender_only_for_a_buffer()
    _flush_what_was_left_first()


@dataclass(frozen=True)
class WholeResponse(StreamEvent):
    """A response whose status, headers and whole body are known at once."""

    status_code: int
    headers: list[tuple[bytes, bytes]]
    data: bytes


@dataclass(frozen=True)
class LastBody(StreamEvent):
    """A response's last body part, after its head: the part and the end of
    the stream leave together (HTTP/2: one DATA frame with END_STREAM,
    HTTP/1.1: the chunk and the terminator in one write)."""

    data: bytes


@dataclass(frozen=True)
class StartedResponse(WholeResponse):
    """A response's status and headers with the first part of a body that
    goes on (``data`` is not empty; no end of stream)."""


def _send_whole_responses_in_one_write() -> None:
    """hypercorn 0.18 sends a response's head as soon as the app sends
    ``http.response.start`` (over HTTP/2 a flush: the send lock and the socket
    write each a checkpoint), then hands the body to the connection's send
    task, which sends it on its next turn (one more checkpoint for the
    lock): four trips to the back of the scheduler's queue, each behind
    every other runnable task, before a 200-byte refusal is complete at the
    client. Under ``headrace bench overload`` those trips were most of a
    refusal's 8 ms p50 and 30-50 ms p99 (each 1-5 ms among token bursts).
    Over HTTP/1.1 the head, each body and the end each were a socket write.

    Here a start that declares ``content-length``, or whose app promises a
    body at once (:data:`BODY_FOLLOWS`), is held until that body (the ASGI
    spec lets a server wait for the first body message). A body that ends the
    response and fits the flow-control window then leaves with its head in
    one write from the app's own task, tried at once without a checkpoint
    (:class:`frontend.hardening.ImmediateRawData`); so does the first part
    of a streamed body (an SSE stream's head and first events: one write,
    where there were two, and none of the send task's turns before the
    first token reaches the client). Anything else (no window, trailers, an
    empty first part) goes the old way, in the old order."""
    stream_cls = HTTPStream
    app_send = stream_cls.app_send
    protocol = hypercorn_h2.H2Protocol
    stream_send = protocol.stream_send
    h11_protocol = hypercorn_h11.H11Protocol
    h11_stream_send = h11_protocol.stream_send

    async def held_app_send(self: Any, message: Any) -> None:
        held = getattr(self, "_headrace_start", None)
        if held is None:
            if _last_body(self, message):
                await self.send(LastBody(self.stream_id, bytes(message["body"])))
                await _closed_after_the_last_body(self)
                return
            if (
                message is not None
                and message["type"] == "http.response.start"
                and self.state == ASGIHTTPState.REQUEST
                and self.scope.get("http_version") in ("1.0", "1.1", "2")
                and not message.get("trailers", False)
                and int(message["status"]) >= 200
                and (message.get(BODY_FOLLOWS) or any(name.lower() == b"content-length" for name, _ in message.get("headers", ())))
            ):
                self._headrace_start = message
                return
            await app_send(self, message)
            return
        self._headrace_start = None
        status = int(held["status"])
        more = message is not None and bool(message.get("more_body", False))
        body = b"" if suppress_body(self.scope["method"], status) or message is None else bytes(message.get("body", b""))
        if message is None or message["type"] != "http.response.body" or (more and not body):
            await app_send(self, held)  # not a body to send with it: the start goes first, as before
            await app_send(self, message)
            return
        self.response = held
        self.state = ASGIHTTPState.RESPONSE
        headers = build_and_validate_headers(held.get("headers", []))
        if more:
            await self.send(StartedResponse(self.stream_id, status, headers, body))
            return
        await self.send(WholeResponse(self.stream_id, status, headers, body))
        await _closed_after_the_last_body(self)

    async def whole_stream_send(self: Any, event: Any) -> None:
        if isinstance(event, Body | EndBody | LastBody | WholeResponse):
            # A cancelled app's send raises here, before anything is framed or
            # written (hypercorn's send checkpointed on its send lock; these
            # paths may not take it). Raised later, a frame h2 counted as sent
            # would be lost, or cut, for every stream of the connection.
            await trio.lowlevel.checkpoint_if_cancelled()
        if isinstance(event, Body | EndBody | LastBody):
            if not await _send_directly(self, event):
                await _send_through_the_buffer(self, event)
            return
        if not isinstance(event, WholeResponse):
            await stream_send(self, event)
            return
        sid, data = event.stream_id, event.data
        end = not isinstance(event, StartedResponse)
        buffer = self.stream_buffers.get(sid)
        try:
            fits = buffer is not None and not buffer.buffer and len(data) <= _room(self.connection, sid)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return  # the client reset it meanwhile: nothing to send
        if not fits:
            await stream_send(self, Response(stream_id=sid, headers=event.headers, status_code=event.status_code))
            if data:
                await stream_send(self, Body(stream_id=sid, data=data))
            if end:
                await stream_send(self, EndBody(stream_id=sid))
            return
        try:
            headers = [(b":status", b"%d" % event.status_code), *event.headers, *self.config.response_headers("h2")]
            self.connection.send_headers(sid, headers, end_stream=end and not data)
            if data:
                self.connection.send_data(sid, data, end_stream=end)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        if end:
            await _ended(self, sid, buffer)
        _write_out(self)

    async def _send_through_the_buffer(self: Any, event: Any) -> None:
        if isinstance(event, LastBody):
            await stream_send(self, Body(stream_id=event.stream_id, data=event.data))
            await stream_send(self, EndBody(stream_id=event.stream_id))
        else:
            await stream_send(self, event)

    async def whole_h11_send(self: Any, event: Any) -> None:
        # Body, EndBody and LastBody as hypercorn writes them, and a
        # WholeResponse as its Response, Body and EndBody; each in one write,
        # without a scheduler turn when the socket takes it (the app's task
        # writes over HTTP/1.1 anyway).
        if not isinstance(event, Body | EndBody | LastBody | WholeResponse):
            await h11_stream_send(self, event)
            return
        await trio.lowlevel.checkpoint_if_cancelled()  # as whole_stream_send
        parts: list[h11.Response | h11.Data | h11.EndOfMessage] = []
        if isinstance(event, WholeResponse):
            headers = [*event.headers, *self.config.response_headers("h11")]
            if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            parts.append(h11.Response(headers=headers, status_code=event.status_code))
        if not isinstance(event, EndBody) and event.data:
            parts.append(h11.Data(data=event.data))
        if not isinstance(event, Body | StartedResponse):
            parts.append(h11.EndOfMessage())
        try:
            data = b"".join([self.connection.send(part) for part in parts])
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        await self.send(hardening.ImmediateRawData(data=data))

    stream_cls.app_send = held_app_send  # type: ignore[method-assign]
    protocol.stream_send = whole_stream_send  # type: ignore[method-assign]
    h11_protocol.stream_send = whole_h11_send  # type: ignore[method-assign]


def _last_body(stream: Any, message: Any) -> bool:
    """Whether ``message`` is the last, non-empty body of a response whose
    head has gone, and ends it (no trailers): :class:`LastBody`."""
    return (
        message is not None
        and message["type"] == "http.response.body"
        and stream.state == ASGIHTTPState.RESPONSE
        and not message.get("more_body", False)
        and bool(message.get("body"))
        and not stream.response.get("trailers", False)
        and stream.scope.get("http_version") in ("1.0", "1.1", "2")
        and not suppress_body(stream.scope["method"], int(stream.response["status"]))
    )


async def _closed_after_the_last_body(stream: Any) -> None:
    """hypercorn's ``HTTPStream._send_closed``, less its EndBody (the last
    body ended the stream)."""
    stream.state = ASGIHTTPState.CLOSED
    await stream.config.log.access(stream.scope, stream.response, time.time() - stream.start_time)
    await stream.send(StreamClosed(stream_id=stream.stream_id))


async def _send_directly(protocol: Any, event: Any) -> bool:
    """Write a body part (and the end of its stream, for EndBody and
    :class:`LastBody`) from the app's own task, as HTTP/1.1 does, when the
    connection is quiet: the stream's buffer is empty, no other stream
    waits for the send task, nobody is writing, and the part fits the
    flow-control window and one frame. hypercorn handed every part to the
    connection's send task: two scheduler turns a token (its wake-up, then
    its write's) where this takes none. Anything else (a busy connection,
    no window, a closed stream) goes through the buffer, as before: whether
    it was sent is the answer."""
    sid = event.stream_id
    end = not isinstance(event, Body)
    if not _frame_directly(protocol, sid, b"" if isinstance(event, EndBody) else event.data, end):
        return False
    if end:
        await _ended(protocol, sid, protocol.stream_buffers[sid])
    _write_out(protocol)
    return True


def _frame_directly(protocol: Any, sid: int, data: bytes, end: bool) -> bool:
    """Frame ``data`` (and the end of the stream, with ``end``) for
    :func:`_send_directly` where it may go: True if framed, False (nothing
    done) where not."""
    buffer = protocol.stream_buffers.get(sid)
    if not isinstance(buffer, hardening.StreamBuffer) or not buffer.empty or not protocol.priority.idle():
        return False
    if _free_socket(protocol) is None:
        return False
    connection = protocol.connection
    try:
        if len(data) > _room(connection, sid):
            return False
        if data:
            connection.send_data(sid, data, end_stream=end)
        else:
            connection.end_stream(sid)
    except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
        return False
    return True


class _BodyWriter:
    """An HTTP/2 stream's :data:`~frontend.server.BODY_WRITER`: a body part of
    a response whose head has gone, not its last, framed and written from
    the app's task as :func:`_send_directly` writes it, without the ASGI
    message, hypercorn's ``app_send`` and ``stream_send`` around it (and so
    without their checkpoint: the app's next wait is one). False, with
    nothing done, where the part must go by ``send``: the head not sent yet
    or the stream ended, a body the response may not have (HEAD, 204, 304),
    or anything :func:`_send_directly` would refuse (then the part, and every
    later one while it waits, goes through the stream's buffer, in order).

    It holds the connection and the stream's id, not the stream: the stream
    holds the scope that holds this, and the connection forgets the stream
    when it closes, so nothing here outlives a request in a cycle."""

    __slots__ = ("_bodied", "_protocol", "_sid")

    def __init__(self, protocol: Any, sid: int) -> None:
        self._protocol, self._sid = protocol, sid
        self._bodied: bool | None = None  # whether the response may have a body, once it started

    def __call__(self, data: bytes) -> bool:
        protocol, sid = self._protocol, self._sid
        stream = protocol.streams.get(sid)
        if stream is None or stream.closed or stream.state is not ASGIHTTPState.RESPONSE:
            return False
        if self._bodied is None:
            self._bodied = not suppress_body(stream.scope["method"], int(stream.response["status"]))
        if not self._bodied or not _frame_directly(protocol, sid, data, False):
            return False
        _write_out(protocol)
        return True


def _room(connection: Any, sid: int) -> int:
    """How much of a stream's data one DATA frame may carry now: its
    flow-control window, at most a frame (below 0: none)."""
    return min(connection.local_flow_control_window(sid), connection.max_outbound_frame_size)  # type: ignore[no-any-return]


async def _ended(protocol: Any, sid: int, buffer: Any) -> None:
    """A stream whose END_STREAM has been framed: its buffer and its place
    in the send order go (the send task's own cleanup, done where the end
    was sent)."""
    del protocol.stream_buffers[sid]
    protocol.priority.remove_stream(sid)
    await buffer.close()


def _free_socket(protocol: Any) -> trio.SocketStream | None:
    """The connection's plain TCP socket when nobody is writing to it (its
    server's send lock free), else None (busy, or TLS, which frames its own
    writes)."""
    server = getattr(protocol.send, "__self__", None)
    lock, stream = getattr(server, "send_lock", None), getattr(server, "stream", None)
    if type(stream) is not trio.SocketStream or not isinstance(lock, trio.Lock) or lock.locked():
        return None
    return stream


def _output(protocol: Any) -> bytes:
    """What an HTTP/2 connection has to write, in order: the rest of a
    write the socket took only in part, then what h2 has framed since."""
    data: bytes = protocol.connection.data_to_send()
    unsent = getattr(protocol, "_headrace_unsent", b"")
    if unsent:
        protocol._headrace_unsent = b""
        return unsent + data
    return data


def _write_out(protocol: Any) -> None:
    """Write the connection's output now, as far as its socket takes it
    without blocking and without a checkpoint (nothing else can write in
    between). What it does not take is left first in line
    (:func:`_output`) for a flush task of its own: the app's task never
    waits on a client's socket here, where a full one would hold it (and
    its cancellation) until the write-stall timeout."""
    data = _output(protocol)
    if not data:
        return
    stream = _free_socket(protocol)
    sent = hardening._write_now(stream, data) if stream is not None else 0
    if sent == len(data) or protocol.closed:
        return
    protocol._headrace_unsent = data[sent:]
    try:
        protocol.task_group.spawn(protocol._flush)
    except RuntimeError:  # the connection's task group is closing: so is the connection
        protocol._headrace_unsent = b""


def _flush_what_was_left_first() -> None:
    """H2Protocol._flush writes the rest of a partial direct write
    (:func:`_write_out`) before what h2 framed since."""
    protocol = hypercorn_h2.H2Protocol

    async def _flush(self: Any) -> None:
        data = _output(self)
        if data:
            await self.send(RawData(data=data))

    protocol._flush = _flush  # type: ignore[method-assign]


def _call_the_app_back_on_disconnect() -> None:
    """Each request's scope offers a :class:`~frontend.server.DisconnectHook`
    (under :data:`~frontend.server.ON_DISCONNECT`), called when its stream
    closes, before ``http.disconnect`` is queued for the app as before: the
    app learns of the disconnect without a task per request that waits on
    ``receive`` for it (one spawn and three scheduler turns a request, and
    one of the 16 task steps before its first byte; see bench/task_steps.py)."""
    handle = HTTPStream.handle

    async def hooked_handle(self: Any, event: Any) -> None:
        if isinstance(event, StreamClosed) and not self.closed and self.app_put is not None:
            hook = self.scope["extensions"].get(ON_DISCONNECT)
            if hook is not None:
                hook()
        await handle(self, event)
        if isinstance(event, Request) and self.app_put is not None:
            # The app's task is spawned, not yet run: it finds the hook (and
            # over HTTP/2 the body writer).
            extensions = self.scope["extensions"]
            extensions[ON_DISCONNECT] = DisconnectHook()
            protocol = getattr(self.send, "__self__", None)
            if isinstance(protocol, hypercorn_h2.H2Protocol):
                extensions[BODY_WRITER] = _BodyWriter(protocol, self.stream_id)

    HTTPStream.handle = hooked_handle  # type: ignore[method-assign]


def _wake_the_sender_only_for_a_buffer() -> None:
    """hypercorn 0.18 wakes an HTTP/2 connection's send task whenever a
    stream closes, so that it clears the stream's buffer. A response sent
    whole, or ended with its last DATA frame, has no buffer left by then:
    the send task woke, found nothing to send and slept again, a scheduler
    turn for every request. Wake it only when the closed stream still has
    a buffer (a reset, a stream closed with data unsent)."""
    protocol = hypercorn_h2.H2Protocol

    async def _close_stream(self: Any, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return
        await stream.handle(StreamClosed(stream_id=stream_id))
        if stream_id in self.stream_buffers:
            await self.has_data.set()

    protocol._close_stream = _close_stream  # type: ignore[method-assign]


def _recycle_after_an_answer_given_at_content_length() -> None:
    """An app may answer as soon as ``content-length`` body bytes are in
    (frontend/server.py's ``_read_body``), before hypercorn's reader has
    taken the request's end from h11 (it hands the last bytes to the app,
    a checkpoint, and takes the end after). hypercorn 0.18 then finds the
    client still sending its body when the response ends, and closes the
    connection instead of keeping it alive; a client that already sent its
    next request on it sees the server hang up without an answer. With the
    head and body written at once, from the app's task (above), httpx met
    that in 1 of 8 requests that followed a refusal on one connection.

    Here, before that decision, the request's end that h11 already holds
    is taken (what remains of a body already answered is dropped, as the
    app read it all); a body still in flight closes the connection, as
    before."""
    protocol = hypercorn_h11.H11Protocol
    maybe_recycle = protocol._maybe_recycle

    async def _maybe_recycle(self: Any) -> None:
        connection = self.connection
        if connection.our_state is h11.DONE:
            try:
                while connection.their_state is h11.SEND_BODY:
                    if connection.next_event() in (h11.NEED_DATA, h11.PAUSED):
                        break  # the body is still coming: closed below
            except h11.RemoteProtocolError:
                pass  # a malformed rest: closed below
        await maybe_recycle(self)

    protocol._maybe_recycle = _maybe_recycle  # type: ignore[method-assign]


def _goaway_after_the_last_byte() -> None:
    """While the server drains, hypercorn 0.18 sends GOAWAY and reports the
    connection idle (which closes it at once) as soon as the last app has
    returned, though the send task may still hold those streams' last DATA
    frames, and httpx (httpcore) fails every stream still reading when a
    GOAWAY arrives (2 or 3 of 10 streams, in a third of the test's runs).
    Here, draining, a connection whose streams are done says GOAWAY and idle
    only after its last byte has gone, and :data:`GOAWAY_DELAY` later
    (:func:`_goaway_if_drained`, from the send path)."""
    protocol = hypercorn_h2.H2Protocol
    original = protocol.stream_send

    async def stream_send(self: Any, event: Any) -> None:
        if not (isinstance(event, StreamClosed) and self.context.terminated.is_set()):
            await original(self, event)
            return
        await self._close_stream(event.stream_id)
        if self.streams:
            await self.send(Updated(idle=False))
            return
        self._headrace_goaway_pending = True
        await _goaway_if_drained(self)

    protocol.stream_send = stream_send  # type: ignore[method-assign]


async def _goaway_if_drained(protocol: Any) -> None:
    """GOAWAY and idle (then hypercorn closes) once a draining connection
    has no stream left and nothing left to send, :data:`GOAWAY_DELAY` after
    the last byte: httpcore (httpx) fails a stream that waits to read when a
    GOAWAY arrives, even when the same read brought that stream's last
    frames, so the GOAWAY goes in a later read."""
    if getattr(protocol, "_headrace_goaway_pending", False) and not protocol.streams and not protocol.stream_buffers:
        protocol._headrace_goaway_pending = False
        await trio.sleep(GOAWAY_DELAY)
        if protocol.closed:  # the client closed it meanwhile
            return
        protocol.connection.close_connection()
        await protocol._flush()
        await protocol.send(Updated(idle=True))


def _schedule_streams_round_robin() -> None:
    """hypercorn 0.18's ``H2Protocol.priority`` is a ``priority.PriorityTree``,
    which costs O(k log k) per DATA frame with k idle streams on the
    connection; :class:`frontend.h2_scheduler.RoundRobinStreams` takes its
    place (O(1), every stream with data one frame in turn)."""
    protocol = hypercorn_h2.H2Protocol
    init = protocol.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.priority = RoundRobinStreams()

    protocol.__init__ = __init__  # type: ignore[method-assign]


def _close_under_send_lock() -> None:
    """hypercorn 0.18's ``TCPServer._close`` calls ``send_eof()`` without the
    connection's ``send_lock``. ``send_eof`` checkpoints inside the stream's
    conflict detector, so a task that takes the (free) lock then and calls
    ``send_all`` gets ``trio.BusyResourceError``, which ``protocol_send`` does
    not catch: the connection is torn down with the error. Take the lock
    around ``send_eof``, so EOF follows any send in progress, and a send
    after it fails with ``ClosedResourceError`` (handled as a closed peer).

    The task that holds the lock may itself be closing (a send failed and the
    protocol reacted with ``Closed``): it sends EOF without re-taking it. A
    send stuck on a peer that stopped reading is waited for at most
    :data:`CLOSE_SEND_WAIT` seconds; the socket is closed in any case,
    cancelled or not (hypercorn skipped ``aclose`` when cancelled)."""

    async def _close(self: Any) -> None:
        try:
            lock: trio.Lock = self.send_lock
            if lock.statistics().owner is trio.lowlevel.current_task():
                await self.stream.send_eof()
            else:
                with trio.move_on_after(CLOSE_SEND_WAIT):
                    async with lock:
                        await self.stream.send_eof()
        except (trio.BrokenResourceError, AttributeError, trio.BusyResourceError, trio.ClosedResourceError):
            pass  # already gone, or a TLS stream (no half-close)
        finally:
            await self.stream.aclose()

    TCPServer._close = _close  # type: ignore[method-assign]


def _reset_h2_stream_on_app_error() -> None:
    """hypercorn 0.18 forgets an HTTP/2 stream whose app ended mid-body (an
    exception, or a return before the last ``http.response.body``) without
    resetting it, so the client waits forever. Over HTTP/1.1 it closes the
    connection. Make HTTP/2 equally loud: send RST_STREAM(INTERNAL_ERROR).

    Body the app handed over before it failed goes first, as far as the
    flow-control window lets it (HTTP/1.1 wrote it already): an app that
    fails right after a ``send``, without a checkpoint between, must not
    lose what that send took (it was still in the stream's buffer, for the
    connection's send task)."""
    protocol = hypercorn_h2.H2Protocol
    original = protocol.stream_send

    async def stream_send(self: Any, event: Any) -> None:
        if isinstance(event, StreamClosed):
            stream = self.streams.get(event.stream_id)
            if (
                isinstance(stream, HTTPStream)
                and stream.state == ASGIHTTPState.RESPONSE
                and not stream.closed
            ):
                try:
                    _send_buffered(self, event.stream_id)
                    self.connection.reset_stream(
                        event.stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR
                    )
                except h2.exceptions.ProtocolError:
                    pass
                else:
                    await self._flush()
                    await self._window_updated(event.stream_id)  # lets the sender drop its buffer
        await original(self, event)

    protocol.stream_send = stream_send  # type: ignore[method-assign]


def _send_buffered(protocol: Any, sid: int) -> None:
    """Hand h2 what a stream's buffer holds, as far as the window lets it."""
    buffer = protocol.stream_buffers.get(sid)
    if buffer is None or not buffer.buffer:
        return
    data = buffer.buffer
    room = min(len(data), protocol.connection.local_flow_control_window(sid))
    frame = protocol.connection.max_outbound_frame_size
    for at in range(0, room, frame):
        protocol.connection.send_data(sid, bytes(data[at : min(room, at + frame)]))
    del data[:room]


def _end_stream_with_the_last_data() -> None:
    """hypercorn 0.18 sends a response's last DATA frame, flushes, then sends
    an empty DATA frame with END_STREAM and flushes again: two frames and two
    socket writes where one does. Where the buffer is complete once the data
    is taken (the app's last ``http.response.body`` carried it), END_STREAM
    rides on that DATA frame. Same frames otherwise.

    And nothing is popped while the window is 0 (see frontend/hardening.py)."""
    protocol = hypercorn_h2.H2Protocol

    async def _send_data(self: Any, stream_id: int) -> None:
        try:
            buffer = self.stream_buffers[stream_id]
            chunk_size = max(0, _room(self.connection, stream_id))
            if chunk_size == 0 and not buffer.complete:
                # No window: leave the data buffered. hypercorn popped 0 bytes
                # here, which released the writer's high-water wait, so a
                # zero-window client made every stream buffer without bound.
                self.priority.block(stream_id)
                return
            data = await buffer.pop(chunk_size)
            if data:
                end = buffer.complete
                self.connection.send_data(stream_id, data, end_stream=end)
                await self._flush()
                if end:
                    del self.stream_buffers[stream_id]
                    self.priority.remove_stream(stream_id)
                    await _goaway_if_drained(self)
                    return
            else:
                self.priority.block(stream_id)
            if buffer.complete:
                self.connection.end_stream(stream_id)
                await self._flush()
                del self.stream_buffers[stream_id]
                self.priority.remove_stream(stream_id)
                await _goaway_if_drained(self)
        except (h2.exceptions.StreamClosedError, KeyError, h2.exceptions.ProtocolError):
            # The stream or connection closed while waiting to send: close
            # the buffer, as hypercorn does.
            await self.stream_buffers[stream_id].close()
            del self.stream_buffers[stream_id]
            self.priority.remove_stream(stream_id)
            await _goaway_if_drained(self)

    protocol._send_data = _send_data  # type: ignore[method-assign]


def _release_buffers_when_the_connection_closes() -> None:
    """hypercorn 0.18's H2Protocol stops its send task when the connection
    closes but leaves the streams' buffers open, so an app waiting in
    ``send`` for its last body to drain (or for room in a full buffer) waits
    on, holding its stream's task, until the server's graceful deadline: a
    SIGTERM after clients cut streams took the whole 30 s drain. Close every
    buffer with the connection, which wakes those waiters (their sends then
    go nowhere: the stream is closed)."""
    protocol = hypercorn_h2.H2Protocol
    handle = protocol.handle

    async def _handle(self: Any, event: Any) -> None:
        await handle(self, event)
        if isinstance(event, Closed):
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()

    protocol.handle = _handle  # type: ignore[method-assign]


_patch_hypercorn()
_end_stream_with_the_last_data()
_release_buffers_when_the_connection_closes()
hardening.install()  # after the patches above: its wrappers go outside theirs
hardening.protect_secrets_in_library_logs()
# ``h2_ingress="lean"``: HTTP/2 connections (cleartext and TLS) get
# frontend/lean_h2.py's protocol (hypercorn's ProtocolWrapper builds H2Protocol by this name).
hypercorn_protocol.H2Protocol = lean_h2_protocol(hypercorn_h2.H2Protocol)  # type: ignore[attr-defined]


class _Config(HypercornConfig):
    """hypercorn's config with the ``date`` header formatted once a second,
    not once per response (``wsgiref``'s formatter was ~1% of the router's
    CPU under load)."""

    _date_at = -1
    _date = b""
    # Read by frontend/hardening.py's patches (hypercorn hands every
    # connection this object): the limits, and who holds the connections.
    headrace_limits: Limits = DEFAULT_LIMITS
    headrace_connections: ConnectionLedger | None = None
    headrace_tls: Certificates | None = None  # the live context, reloaded in place
    headrace_h2_ingress = "lean"  # HTTP/2 on frontend/lean_h2.py; "hypercorn": on hypercorn's H2Protocol

    def create_ssl_context(self) -> ssl.SSLContext | None:
        if self.headrace_tls is not None:
            return self.headrace_tls.context
        return super().create_ssl_context()

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        headers = super().response_headers(protocol) if not self.include_date_header else None
        if headers is not None:
            return headers
        now = int(time.time())
        if now != self._date_at:
            self._date_at, self._date = now, format_date_time(now).encode("ascii")
        self.include_date_header = False
        try:
            return [(b"date", self._date), *super().response_headers(protocol)]
        finally:
            self.include_date_header = True


class ServeOptions:
    """Where and how to listen. ``port=0`` picks a free port.

    ``keep_alive_max_requests``: requests after which a connection is closed
    (GOAWAY over HTTP/2, ``Connection: close`` over HTTP/1.1); ``None``, the
    default, never. ``keep_alive_timeout``: seconds an idle connection is
    kept. ``reuse_port``: bind with ``SO_REUSEPORT``, so that other
    processes may serve the same port. ``limits``: streams, buffering,
    write stalls, budgets and connection caps (frontend/hardening.py).
    ``h2_ingress``: ``"lean"`` serves HTTP/2 (cleartext and TLS) with
    frontend/lean_h2.py's protocol, ``"hypercorn"`` with hypercorn's
    (patched here); HTTP/1.1 is hypercorn's either way. None:
    :data:`DEFAULT_H2_INGRESS` (lean).
    ``certfile`` and ``keyfile``: TLS (frontend/tls.py), loaded when serving
    starts; :meth:`reload_certificates` re-reads them."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
        graceful_timeout: float = 30.0,
        keep_alive_timeout: float = 60.0,
        keep_alive_max_requests: int | None = None,
        access_log: bool = False,
        reuse_port: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        h2_ingress: str | None = None,
    ) -> None:
        h2_ingress = DEFAULT_H2_INGRESS if h2_ingress is None else h2_ingress
        if h2_ingress not in ("hypercorn", "lean"):
            raise ValueError(f"h2_ingress: 'hypercorn' or 'lean', not {h2_ingress!r}")
        self.h2_ingress = h2_ingress
        self.host = host
        self.port = port
        self.certfile = certfile
        self.keyfile = keyfile
        self.graceful_timeout = graceful_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.keep_alive_max_requests = keep_alive_max_requests
        self.access_log = access_log
        self.reuse_port = reuse_port
        self.limits = limits
        self.tls: Certificates | None = None  # made by hypercorn_config()

    def reload_certificates(self) -> bool:
        """Re-read the certificate files: new connections get what they hold
        now, connections already open keep theirs. False (logged, the old
        certificate still served) when there is no TLS or the files are bad."""
        if self.tls is None:
            return False
        try:
            self.tls.reload()
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS certificate reload from %s failed, still serving the old one: %s", self.certfile, exc)
            return False
        log.info("TLS certificate reloaded from %s (new connections get it)", self.certfile)
        return True

    def hypercorn_config(self) -> HypercornConfig:
        config = _Config()
        host = f"[{self.host}]" if ":" in self.host else self.host
        config.bind = [f"{host}:{self.port}"]
        config.certfile = self.certfile
        config.keyfile = self.keyfile
        config.alpn_protocols = ["h2", "http/1.1"]
        if self.certfile is not None and self.keyfile is not None:
            if self.tls is None:
                self.tls = Certificates(self.certfile, self.keyfile, config.alpn_protocols)
            config.headrace_tls = self.tls
            config.ssl_handshake_timeout = HANDSHAKE_TIMEOUT
        config.graceful_timeout = self.graceful_timeout
        config.keep_alive_timeout = self.keep_alive_timeout
        # hypercorn compares the count with > (h2) or >= (h11); an int is needed.
        limit = self.keep_alive_max_requests
        config.keep_alive_max_requests = sys.maxsize if limit is None else limit
        # Advertised; a stream over it is refused, not a connection error.
        config.h2_max_concurrent_streams = self.limits.max_concurrent_streams
        limits = config.headrace_limits = self.limits
        config.headrace_connections = ConnectionLedger(
            limits.connection_cap(), limits.max_connections_per_client, limits.reserved_connections
        )
        config.accesslog = "-" if self.access_log else None
        config.errorlog = "-"
        config.headrace_h2_ingress = self.h2_ingress
        return config


def _bind(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        # The address in the message: `headrace serve` binds two ports (the
        # main one and the admin one, by default the main + 1).
        raise OSError(exc.errno, f"{exc.strerror or exc} ({host}:{port})") from exc
    return sock


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError (a port in use, a bad certificate path) that stopped a
    server, inside the trio exception groups around it, if that is all
    they hold: a command says it in a line instead of a traceback."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """Bind (without listening) a ``SO_REUSEPORT`` socket to ``host:port``, so
    that processes serving with ``reuse_port=True`` can share the port while
    the caller holds it; ``port=0`` picks one (read it from ``getsockname``).
    A socket that does not listen is given no connections. Close it when done.

    The port must be free: it is first bound without ``SO_REUSEPORT``, which
    fails (``OSError``, address in use) if anyone serves it, even another
    ``SO_REUSEPORT`` group that we would otherwise silently join."""
    with _bind(host, port, reuse_port=False) as probe:
        port = probe.getsockname()[1]
    return _bind(host, port, reuse_port=True)


async def serve(
    app: Callable[..., Any],
    options: ServeOptions,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set; ``task_status.started`` gets the
    base URL actually bound (``http://127.0.0.1:54321``)."""

    class _Started:
        def started(self, binds: list[str] | None = None) -> None:
            url = (binds or [""])[0]
            task_status.started(url)

    config = options.hypercorn_config()
    ledger = getattr(config, "headrace_connections", None)
    if ledger is not None and options.limits.reserved_connections:
        app = hardening.reserve_gate(app, ledger, options.limits.reserved_paths)
    if options.reuse_port:
        # hypercorn sets SO_REUSEPORT only in its own multi-worker mode, which
        # its trio ``serve`` does not run: hand it a socket bound here (an
        # ``fd://`` bind; hypercorn takes the descriptor over).
        config.bind = [f"fd://{_bind(options.host, options.port, reuse_port=True).detach()}"]
    trigger = shutdown.wait if shutdown is not None else None
    await hypercorn_serve(
        app,
        config,
        shutdown_trigger=trigger,
        task_status=_Started(),
        mode="asgi",
    )


async def reload_on_sighup(*options: ServeOptions) -> None:
    """On each SIGHUP, re-read every listener's TLS certificate (a rotated
    certificate takes effect without a restart or a dropped connection).
    Installed with or without TLS: SIGHUP's default action would end the
    process, and a reload signal sent by habit (logrotate, a config
    manager) must never take a server down."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            if not any(o.tls is not None for o in options):
                log.info("SIGHUP: no TLS listener, nothing to reload")
            for o in options:
                o.reload_certificates()


async def wait_for_signal(shutdown: trio.Event) -> None:
    """Set ``shutdown`` on the first SIGTERM or SIGINT (graceful drain)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: draining", signal.Signals(signum).name)
            shutdown.set()
            return

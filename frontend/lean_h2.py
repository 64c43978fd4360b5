"""A lean HTTP/2 protocol for the ingress: ``[server] h2_ingress = "lean"``
(the default; ``"hypercorn"`` serves with hypercorn's own, patched).

hypercorn's ``H2Protocol`` hands every request to an ``HTTPStream``, every
ASGI message to an event object, every body to a queue for the app and
every response part to a buffer that the connection's send task drains on
its turn; frontend/serving.py patches most of those paths to go around
themselves (a whole response in one write, a part written from the app's
task, a body writer). This protocol is those shortcuts as the design, in
hypercorn's place for HTTP/2 connections, cleartext and TLS (HTTP/1.1
keeps hypercorn's protocol): hypercorn's ``TCPServer`` still accepts, reads,
writes under its send lock and times out idle connections, with
frontend/hardening.py's patches on it (connection caps and the reserve, the
write stall, the idle deadline), and h2 still parses and frames, as
:class:`~frontend.hardening.GuardedH2Connection` (budgets, refused and
reset streams, RFC 9113's error codes)::

    TCPServer reads ─> handle(RawData) ─> h2 events ─┬─ a request: its stream, the app's task
                                                     ├─ body: kept for receive(), credited as read
                                                     └─ window: streams waiting for it framed
    the app's send ─> framed by h2 ─> _write(): the socket takes what it can now (no checkpoint);
                      the rest, and parts that do not fit, go out from one flush task

Over TLS the socket cannot be written around the ``SSLStream`` that frames
its records: every write goes out from the flush task, under the same send
lock and write stall.

What a stream holds unsent is bounded as frontend/hardening.py bounds it
(``stream_buffer_bytes``, and its share of ``connection_buffer_bytes``);
a client that takes none of a stream's output for ``write_stall_timeout``
gets that stream reset (CANCEL) and the app ``http.disconnect``. Request
bodies are credited to the client as the app reads them (hypercorn
credited on receipt and bounded the rest by blocking the connection's
reader on a queue of ten messages).

ASGI: ``http`` scopes only (``http_version`` "2"), with the router's
extensions (:data:`~frontend.server.ON_DISCONNECT`,
:data:`~frontend.server.BODY_WRITER`); no trailers, server push, early
hints or lifespan ``state`` (the router uses none); a CONNECT request is
refused (405). The head of a response whose start says a body follows
(:data:`~frontend.server.BODY_FOLLOWS`, or ``content-length``) waits for
that body and leaves with it.
"""

from __future__ import annotations

from collections import deque
from time import time
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.http_stream import ASGIHTTPState
from hypercorn.utils import UnexpectedMessageError, build_and_validate_headers, suppress_body

from frontend import hardening
from frontend.hardening import GuardedH2Connection, reset_stalled
from frontend.limits import DEFAULT_LIMITS, Limits
from frontend.server import BODY_FOLLOWS, BODY_WRITER, ON_DISCONNECT, DisconnectHook

__all__ = ["LeanH2Protocol"]


_ASGI = {"spec_version": "2.1", "version": "3.0"}
_DISCONNECT = {"type": "http.disconnect"}
# Bytes framed but not yet written, past which a part waits in its stream's
# buffer instead (a client not reading its socket must not grow this).
OUT_HIGH = 64 * 1024
# Draining, how long after a connection's last byte its GOAWAY follows (hypercorn's
# protocol too, frontend/serving.py): it goes in a later read than the last stream's end.
GOAWAY_DELAY = 0.1


class LeanH2Protocol:
    """One HTTP/2 connection, for hypercorn's ``ProtocolWrapper``
    (the same constructor, ``initiate`` and ``handle`` as ``H2Protocol``)."""

    def __init__(self, app: Any, config: Any, context: Any, task_group: Any, connection_state: Any,
                 ssl: bool, client: Any, server: Any, send: Any) -> None:
        self.app, self.config, self.context = app, config, context
        self.task_group, self.send = task_group, send
        self.client, self.server = client, server
        self.scheme = "https" if ssl else "http"
        limits = getattr(config, "headrace_limits", None)
        self.limits: Limits = limits if isinstance(limits, Limits) else DEFAULT_LIMITS
        connection = GuardedH2Connection(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
        connection.DEFAULT_MAX_INBOUND_FRAME_SIZE = config.h2_max_inbound_frame_size
        connection.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: config.h2_max_concurrent_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: config.h2_max_header_list_size,
        })
        connection.guard(self.limits, client)
        self.connection = connection
        self.streams: dict[int, _Stream] = {}
        self.unsent = hardening._Unsent(self.limits.connection_buffer_bytes)
        self.closed = False
        self.requests = 0
        self.stalled = 0  # streams given up for a client that read nothing
        self._out = b""  # framed, not yet written: behind a write in flight
        self._writing = False  # the flush task runs
        self._flushed: trio.Event | None = None  # set when it ends
        self._ready: deque[_Stream] = deque()  # streams with parts to frame, in turn
        self._blocked: set[_Stream] = set()  # ... waiting for the client's window
        self._goaway_pending = False
        self._idle = True  # as the server counts it: idle from the start
        tcp = getattr(send, "__self__", None)  # hypercorn's TCPServer: its socket and send lock
        self._lock: trio.Lock | None = getattr(tcp, "send_lock", None)
        self._socket = getattr(tcp, "stream", None)  # the same for the connection's life

    @property
    def idle(self) -> bool:
        return not self.streams

    # ------------------------------------------------------------ reading

    async def initiate(self, headers: list[tuple[bytes, bytes]] | None = None, settings: bytes | None = None) -> None:
        if settings is not None:  # h2c Upgrade from HTTP/1.1: stream 1 is that request
            self.connection.initiate_upgrade_connection(settings)
        else:
            self.connection.initiate_connection()
        self._write()
        if headers is not None:
            await self._open(1, headers, ended=True)

    async def handle(self, event: Any) -> None:
        if type(event) is RawData:
            try:
                events: list[Any] = self.connection.receive_data(event.data)
            except h2.exceptions.ProtocolError:
                self._write()  # h2's GOAWAY
                await self.send(Closed())
                return
            terminated = False
            opened = False  # a request of this read's, its task not yet given a turn
            for e in events:
                kind = type(e)
                if kind is h2.events.DataReceived:
                    self._data(e)
                elif kind is h2.events.RequestReceived:
                    if opened:
                        # A turn for the others (the new requests' tasks among
                        # them) before the next request of this read, as
                        # hypercorn's queue to the app gave one. Without it the
                        # added TTFT p99 at 450 req/s was worse in 3 of 3
                        # alternated pairs (+3.95 / +3.09 / +4.79 ms against
                        # +3.19 / +2.79 / +4.21 with it). Not before the
                        # request's own body and end, which usually follow its
                        # headers in the same read: its task then finds the
                        # whole body on its first turn, instead of waiting for
                        # it (a cancel scope, a park and one more turn).
                        await trio.lowlevel.checkpoint()
                    await self._open(e.stream_id, e.headers, ended=e.stream_ended is not None)
                    opened = True
                elif kind is h2.events.StreamEnded:
                    stream = self.streams.get(e.stream_id)
                    if stream is not None:
                        stream.body_done = True
                        stream.wake()
                elif kind is h2.events.StreamReset:
                    stream = self.streams.get(e.stream_id)
                    if stream is not None:
                        self._close(stream)
                elif kind is h2.events.WindowUpdated:
                    self._unblock(e.stream_id)
                elif kind is h2.events.RemoteSettingsChanged:
                    if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in e.changed_settings:
                        self._unblock(0)
                elif kind is h2.events.ConnectionTerminated:
                    terminated = True
            self._frame_ready()
            self._write()
            if terminated:
                await self.send(Closed())
            else:
                await self._maybe_idle()
        elif isinstance(event, Closed):
            self._connection_closed()

    async def _open(self, sid: int, raw: list[tuple[bytes, bytes]], *, ended: bool) -> None:
        connection = self.connection
        if self.closed:  # closed during the turn after the read's previous request
            return
        if self._retiring():
            # Draining, or past keep_alive_max_requests: refused (the client
            # may retry it elsewhere), and no more wanted; GOAWAY follows
            # once the streams in flight have ended (_maybe_idle).
            connection.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            if connection.local_settings.max_concurrent_streams:
                connection.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})
            return
        method = target = authority = None
        host = b""
        headers: list[tuple[bytes, bytes]] = [(b"host", b"")]
        for name, value in raw:
            if name[0] == 58:  # b":"
                if name == b":method":
                    method = value
                elif name == b":path":
                    target = value
                elif name == b":authority":
                    authority = value
            elif name == b"host":
                host = value
            else:
                headers.append((name, value))
        headers[0] = (b"host", authority if authority is not None else host)
        stream = _Stream(self, sid)
        if target is None or method is None:  # CONNECT (h2 checked every other request has both)
            stream.refuse(405)
            return
        path, _, query = target.partition(b"?")
        try:
            decoded = unquote(path.decode("ascii"))
            verb = method.decode("ascii").upper()
        except UnicodeDecodeError:
            stream.refuse(400)
            return
        hook = stream.hook = DisconnectHook()
        stream.scope = {
            "type": "http", "http_version": "2", "asgi": _ASGI, "method": verb, "scheme": self.scheme,
            "path": decoded, "raw_path": path, "query_string": query, "root_path": self.config.root_path,
            "headers": headers, "client": self.client, "server": self.server,
            "extensions": {ON_DISCONNECT: hook, BODY_WRITER: _BodyWriter(self, sid)},
        }
        stream.body_done = ended
        first = not self.streams
        self.streams[sid] = stream
        self.unsent.join()
        if self.config.accesslog:
            stream.started_at = time()
        self.requests += 1
        self.task_group.spawn(self._run, stream)
        if first and self._idle:
            self._idle = False
            await self.send(Updated(idle=False))

    def _data(self, e: Any) -> None:
        stream = self.streams.get(e.stream_id)
        if stream is None or stream.closed:  # no longer read: credit it now
            self.connection.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            return
        stream.body.append(e.data)
        stream.unacked += e.flow_controlled_length
        stream.wake()

    # ------------------------------------------------------------ the app

    async def _run(self, stream: _Stream) -> None:
        try:
            await self.app(stream.scope, stream.receive, stream.send, trio.to_thread.run_sync, trio.from_thread.run)
        except trio.Cancelled:
            raise
        except BaseExceptionGroup as error:
            _, others = error.split(trio.Cancelled)
            if others is None:
                raise
            await self.config.log.exception("Error in ASGI Framework")
        except Exception:
            await self.config.log.exception("Error in ASGI Framework")
        finally:
            stream.finish()
            self._write()
            if not self.closed:
                with trio.CancelScope(shield=True):
                    await self._maybe_idle()

    def _retiring(self) -> bool:
        return bool(self.context.terminated.is_set() or self.requests >= self.config.keep_alive_max_requests)

    async def _maybe_idle(self) -> None:
        """Tell the server when the last stream is gone: idle (its keep-alive
        deadline starts), or, draining or past ``keep_alive_max_requests``,
        GOAWAY once the last byte is out. Not before: h2-based clients
        (httpx's httpcore) fail the streams they are still reading when a
        GOAWAY arrives, whatever its last stream id."""
        if self.streams or self.closed or self._idle:
            return
        self._idle = True
        if self._retiring():
            if not self._goaway_pending:
                self._goaway_pending = True
                self.task_group.spawn(self._goaway_when_drained)
            return
        await self.send(Updated(idle=True))

    async def _goaway_when_drained(self) -> None:
        if self._writing:  # the last bytes go first
            flushed = self._flushed = trio.Event()
            await flushed.wait()
        await trio.sleep(GOAWAY_DELAY)
        if self.closed or self.streams:
            self._goaway_pending = False
            return
        self.connection.close_connection()
        self._write()
        await self.send(Updated(idle=True))

    # ------------------------------------------------------------ writing

    def _write(self) -> None:
        """Write what h2 has framed, as far as the socket takes it now,
        without a checkpoint; the rest goes from the flush task, first in line."""
        data = self.connection.data_to_send()
        if not data:
            return
        if self._writing:
            self._out += data
            return
        lock = self._lock
        sent = hardening._write_now(self._socket, data) if lock is not None and not lock.locked() else 0
        if self.closed or (sent == len(data) and not self._ready):
            return
        # The rest, or parts left unframed at OUT_HIGH: the flush task frames
        # and writes on until none is left.
        self._out = data[sent:]
        self._writing = True
        try:
            self.task_group.spawn(self._flush)
        except RuntimeError:  # the connection's task group is closing: so is the connection
            self._out, self._writing = b"", False

    async def _flush(self) -> None:
        try:
            while not self.closed:
                if not self._out:
                    self._frame_ready()
                    self._out = self.connection.data_to_send()
                    if not self._out:
                        break
                data, self._out = self._out, b""
                await self.send(RawData(data=data))  # under the send lock; a stalled socket closes the connection
        finally:
            self._writing = False
            self._out = b""
            if self._flushed is not None:
                self._flushed.set()
                self._flushed = None

    def _frame_ready(self) -> None:
        """Frame the parts streams hold, a frame a stream in turn, as far as
        the client's windows let them and while little is unsent."""
        ready, connection = self._ready, self.connection
        while ready and len(self._out) + len(connection._data_to_send) < OUT_HIGH:
            stream = ready.popleft()
            if stream.closed:
                continue
            sid = stream.sid
            try:
                room = min(connection.local_flow_control_window(sid), connection.max_outbound_frame_size)
            except h2.exceptions.ProtocolError:  # the stream or the connection is closed
                self._close(stream)
                continue
            pending = stream.pending
            if room <= 0 and pending:
                self._blocked.add(stream)
                continue
            chunk = bytes(pending[:room])
            del pending[: len(chunk)]
            end = stream.end_pending and not pending
            try:
                if chunk:
                    connection.send_data(sid, chunk, end_stream=end)
                elif end:
                    connection.end_stream(sid)
            except h2.exceptions.ProtocolError:  # the stream or the connection is closed
                self._close(stream)
                continue
            stream.taken(len(chunk))
            if end:
                stream.end_pending = False
                stream.end_framed = True
                stream.wake()
            elif pending:
                ready.append(stream)

    def _unblock(self, sid: int) -> None:
        blocked = self._blocked
        if not blocked:
            return
        if sid == 0:
            self._ready.extend(blocked)
            blocked.clear()
            return
        stream = self.streams.get(sid)
        if stream is not None and stream in blocked:
            blocked.discard(stream)
            self._ready.append(stream)

    def _queue(self, stream: _Stream) -> None:
        if stream not in self._blocked and stream not in self._ready:
            self._ready.append(stream)
        if not self._writing:
            self._frame_ready()

    # ------------------------------------------------------------ closing

    def _close(self, stream: _Stream) -> None:
        """The stream is over for the app (answered, reset, given up, or the
        connection closed): ``http.disconnect``, the hook, its buffer freed."""
        if stream.closed:
            return
        stream.closed = True
        if self.streams.pop(stream.sid, None) is not None:
            self.unsent.leave()
        if stream.pending:
            self.unsent.take(len(stream.pending))
            stream.pending = bytearray()
        self._blocked.discard(stream)
        if stream.unacked:
            unacked, stream.unacked = stream.unacked, 0
            try:
                self.connection.acknowledge_received_data(unacked, stream.sid)
            except h2.exceptions.ProtocolError:
                pass
        stream.body = []
        if stream.hook is not None:
            stream.hook()
        stream.wake()

    def _give_up(self, stream: _Stream) -> None:
        """The client took none of the stream's output for the write-stall
        timeout: reset it, and the app hears ``http.disconnect``."""
        self.stalled += 1
        reset_stalled(self.connection, self.client, stream.sid, self.limits, self.stalled)
        self._close(stream)
        self._write()

    def _connection_closed(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in list(self.streams.values()):
            self._close(stream)
        self._ready.clear()
        self._blocked.clear()


class _BodyWriter:
    """The stream's :data:`~frontend.server.BODY_WRITER`: a part framed and
    written at once, without the ASGI message, where it may go now (the
    head sent, nothing waiting before it, room in the window and in the
    output); False, nothing done, otherwise (it then goes by ``send``). It
    holds the connection and the stream's id, not the stream (the stream
    holds the scope that holds this)."""

    __slots__ = ("_protocol", "_sid")

    def __init__(self, protocol: LeanH2Protocol, sid: int) -> None:
        self._protocol, self._sid = protocol, sid

    def __call__(self, data: bytes) -> bool:
        protocol = self._protocol
        stream = protocol.streams.get(self._sid)
        if stream is None or not stream.head_sent or stream.suppressed or not stream.direct(data, False):
            return False
        protocol._write()
        return True


class _Stream:
    """One request: its body for ``receive``, its response's state for ``send``."""

    __slots__ = (
        "_blocked_since", "_received", "_room", "body", "body_done", "closed", "delivered", "end_framed", "end_pending",
        "head", "head_sent", "hook", "pending", "protocol", "scope", "sid", "started", "started_at", "status",
        "suppressed", "unacked",
    )

    def __init__(self, protocol: LeanH2Protocol, sid: int) -> None:
        self.protocol, self.sid = protocol, sid
        self.scope: dict[str, Any] = {}
        self.hook: DisconnectHook | None = None
        self.body: list[bytes] = []
        self.unacked = 0  # body bytes not yet credited to the client
        self.body_done = self.delivered = self.closed = False
        self.started = self.head_sent = self.suppressed = False
        self.end_pending = self.end_framed = False
        self.status = 200
        self.head: list[tuple[bytes, bytes]] | None = None  # a start held for its first body
        self.pending = bytearray()  # response bytes not yet framed
        self.started_at = 0.0
        self._received: trio.Event | None = None  # receive() waits on it
        self._room: trio.Event | None = None  # send() waits on it
        self._blocked_since: float | None = None

    def wake(self) -> None:
        if self._received is not None:
            self._received.set()
            self._received = None
        if self._room is not None:
            self._room.set()
            self._room = None

    def refuse(self, status: int) -> None:
        """Answer a request the app will not see."""
        connection = self.protocol.connection
        try:
            connection.send_headers(self.sid, [(b":status", b"%d" % status), (b"content-length", b"0")], end_stream=True)
        except h2.exceptions.ProtocolError:
            pass  # the client reset it meanwhile

    # -------- receive

    async def receive(self) -> dict[str, Any]:
        while (message := self.receive_ready()) is None:
            event = self._received = trio.Event()
            await event.wait()
        return message

    def receive_ready(self) -> dict[str, Any] | None:
        """The message :meth:`receive` would return without waiting, or
        None where it would wait (frontend/server.py's ``_queued``: a body
        already here is read without a cancel scope for its timeout)."""
        if self.body:
            chunks, self.body = self.body, []
            if self.unacked:
                unacked, self.unacked = self.unacked, 0
                protocol = self.protocol
                try:
                    protocol.connection.acknowledge_received_data(unacked, self.sid)
                except h2.exceptions.ProtocolError:
                    pass
                protocol._write()
            more = not self.body_done
            self.delivered = not more
            return {"type": "http.request", "body": b"".join(chunks), "more_body": more}
        if self.body_done and not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if self.closed:
            return _DISCONNECT
        return None

    # -------- send

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started:
                raise UnexpectedMessageError(ASGIHTTPState.REQUEST, kind)
            if self.closed:
                await trio.lowlevel.checkpoint()  # an app that sends on regardless must not hold the loop
                return  # reset or given up: the part goes nowhere
            if self.end_pending or self.end_framed:
                raise UnexpectedMessageError(ASGIHTTPState.CLOSED, kind)
            await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled app's part is not framed
            body = message.get("body", b"")
            end = not message.get("more_body", False)
            await self._emit(b"" if self.suppressed or not body else bytes(body), end)
            return
        if kind == "http.response.start":
            if self.started:
                raise UnexpectedMessageError(ASGIHTTPState.RESPONSE, kind)
            self.started = True
            self.status = status = int(message["status"])
            headers = message.get("headers", ())
            self.head = build_and_validate_headers(headers)
            self.suppressed = suppress_body(self.scope["method"], status)
            if not (message.get(BODY_FOLLOWS) or any(name.lower() == b"content-length" for name, _ in headers)):
                self._send_head(False)
                self.protocol._write()
            return
        raise UnexpectedMessageError(ASGIHTTPState.RESPONSE if self.started else ASGIHTTPState.REQUEST, kind)

    def _send_head(self, end: bool) -> bool:
        head, self.head = self.head, None
        assert head is not None
        self.head_sent = True
        protocol = self.protocol
        try:
            protocol.connection.send_headers(
                self.sid, [(b":status", b"%d" % self.status), *head, *protocol.config.response_headers("h2")],
                end_stream=end)
        except h2.exceptions.ProtocolError:  # the stream or the connection is closed
            protocol._close(self)
            return False
        return True

    def direct(self, data: bytes, end: bool) -> bool:
        """Frame ``data`` (and the end) now, if nothing waits before it and
        it fits the window, a frame, and the output."""
        protocol = self.protocol
        if self.pending or self.closed or protocol._writing or protocol._ready:
            return False
        connection = protocol.connection
        try:
            if len(data) > min(connection.local_flow_control_window(self.sid), connection.max_outbound_frame_size):
                return False
            if data:
                connection.send_data(self.sid, data, end_stream=end)
            elif end:
                connection.end_stream(self.sid)
        except h2.exceptions.ProtocolError:  # the stream or the connection is closed
            return False
        return True

    async def _emit(self, data: bytes, end: bool) -> None:
        protocol = self.protocol
        if not self.head_sent:
            if not self._send_head(end and not data):
                return
            if end and not data:
                self.end_framed = True
        if data or (end and not self.end_framed):
            if not self.direct(data, end):
                self.pending += data
                protocol.unsent.add(len(data))
                self.end_pending = end
                protocol._queue(self)
            elif end:
                self.end_framed = True
        protocol._write()
        if self.end_pending or len(self.pending) >= min(protocol.limits.stream_buffer_bytes, protocol.unsent.share):
            await self._wait_room()
        if end and not self.closed:
            self._answered()

    async def _wait_room(self) -> None:
        """Until the stream holds less than it may (for the last part: until
        it is all framed), or it closes; the client taking none of it for
        the write-stall timeout gives the stream up."""
        protocol = self.protocol
        limits = protocol.limits
        while not self.closed and (self.end_pending or len(self.pending) >= min(limits.stream_buffer_bytes, protocol.unsent.share)):
            if self._blocked_since is None:  # since the stream's bytes were last taken
                self._blocked_since = trio.current_time()
            event = self._room = trio.Event()
            with trio.move_on_at(self._blocked_since + limits.write_stall_timeout) as waited:
                await event.wait()
            if waited.cancelled_caught:
                protocol._give_up(self)
                return

    def taken(self, n: int) -> None:
        """``n`` of the stream's bytes were framed: progress."""
        if n:
            self.protocol.unsent.take(n)
            self._blocked_since = None
            self.wake()

    def _answered(self) -> None:
        protocol = self.protocol
        if protocol.config.accesslog:
            protocol.task_group.spawn(protocol.config.log.access, self.scope,
                                      {"status": self.status, "headers": []}, time() - self.started_at)
        protocol._close(self)

    def finish(self) -> None:
        """The app returned: answer 500 if it sent nothing, reset a response
        it left unfinished (INTERNAL_ERROR), and close. What the app sent
        before it failed goes first, as far as the client's window takes it
        now (parts held only behind a write in flight, as every part is over
        TLS while the flush task writes); what waits for the window goes
        with the stream."""
        protocol = self.protocol
        if self.closed:
            return
        connection = protocol.connection
        if not self.head_sent:  # nothing sent, or a start held for a body that never came
            self.head = None
            self.refuse(500)
        elif not self.end_framed:
            try:
                self._frame_what_fits()
                connection.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            except h2.exceptions.ProtocolError:
                pass
        protocol._close(self)

    def _frame_what_fits(self) -> None:
        pending, connection, sid = self.pending, self.protocol.connection, self.sid
        while pending:
            room = min(connection.local_flow_control_window(sid), connection.max_outbound_frame_size)
            if room <= 0:
                return
            chunk = bytes(pending[:room])
            del pending[:room]
            connection.send_data(sid, chunk)
            self.taken(len(chunk))


def lean_h2_protocol(factory: Any) -> Any:
    """hypercorn's ``H2Protocol`` constructor, replaced by one that builds a
    :class:`LeanH2Protocol` for a connection whose server asked for it
    (``config.headrace_h2_ingress == "lean"``): cleartext (prior knowledge
    or the h2c Upgrade) and TLS (ALPN ``h2``) alike."""

    def build(app: Any, config: Any, context: Any, task_group: Any, state: Any, ssl: bool,
              client: Any, server: Any, send: Any) -> Any:
        if getattr(config, "headrace_h2_ingress", "hypercorn") == "lean":
            return LeanH2Protocol(app, config, context, task_group, state, ssl, client, server, send)
        return factory(app, config, context, task_group, state, ssl, client, server, send)

    return build


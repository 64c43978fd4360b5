"""Ingress limits for hypercorn 0.18: one slow or hostile client must never
hurt the others (issue 17). Installed by frontend/serving.py with its other
hypercorn patches; tests/frontend/test_serving.py checks the shape of every
internal used here, tests/hardening/ attacks a real router with raw clients.

What each limit stops, and where it acts::

    accept ─> ConnectionLedger.admit        total / per client address caps; the last
              (TCPServer.run)               ``reserved`` slots serve ``reserved_paths`` only
    read   ─> GuardedH2Connection           reset budget (Rapid Reset) and control-frame
              (h2, frame by frame)          budget (PING / SETTINGS / PRIORITY / empty DATA
                                            floods): GOAWAY(ENHANCE_YOUR_CALM), close;
                                            a stream over MAX_CONCURRENT_STREAMS: its own
                                            RST_STREAM(REFUSED_STREAM); a malformed header
                                            block: RST_STREAM(PROTOCOL_ERROR), not GOAWAY;
                                            RFC 9113's codes where h2 4.x gives PROTOCOL_ERROR
                                            (HPACK: COMPRESSION_ERROR; a SETTINGS ack with a
                                            payload: FRAME_SIZE_ERROR)
           ─> H11: Content-Length plus      400 and close (RFC 9112 6.1): no smuggled
              Transfer-Encoding             request behind it is ever read
    write  ─> StreamBuffer.push / drain     at most ``stream_buffer_bytes`` unsent per stream,
              (the app's ``send``)          and at most its share of ``connection_buffer_bytes``
                                            (the budget over the connection's open streams, at
                                            least MIN_SHARE each); blocked ``write_stall_timeout``:
                                            RST_STREAM(CANCEL) and ``http.disconnect`` to the app
                                            (which cancels its backend request)
           ─> TCPServer.protocol_send       one socket write blocked ``write_stall_timeout``
                                            (the client stopped reading): close the connection
    before ─> frontend/call.py channel      events not yet written: at most CHANNEL_EVENTS
              the write                     and CHANNEL_TEXT_BYTES of text per call; past
                                            that the call stops reading its backend, whose
                                            HTTP/2 window (backends/h2client.py) then closes

Why the buffer is replaced rather than patched: hypercorn's ``_send_data``
pops ``min(window, frame size)`` bytes, which is 0 on a zero window, and a pop
of fewer than low-water bytes releases the writer's high-water wait; so a
client that advertises ``SETTINGS_INITIAL_WINDOW_SIZE=0`` let every stream
buffer without bound (59 -> 229 MB in 40 s with 100 streams). Here only bytes
actually taken wake a writer, and serving.py's ``_send_data`` no longer pops
on a zero window.

Why a share and not one connection-wide limit: HTTP/2 lets a client stall
one stream by its flow control while the others flow (the router does
exactly that upstream, for a slow client of its own). A limit on the
connection's total made every stream wait once the stalled ones had filled
it: with 50 stalled streams on the router's connection to an engine server,
a neighbour's request on that connection waited the whole stall timeout
(9.3 s). With shares, a stalled stream holds at most its share; a stream
whose output flows is drained as it writes and never waits on the others.
The connection then holds at most max(``connection_buffer_bytes``,
streams x MIN_SHARE), 1.6 MiB at 100 streams, whether the client stalls
its streams or the whole socket.

The limits, budgets and ledger are plain objects in frontend/limits.py.
frontend/lean_h2.py, the default protocol for HTTP/2, reads with
:class:`GuardedH2Connection` and bounds its output by the same limits
itself (no StreamBuffer there); the TCPServer patches here serve it as well.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import hpack.exceptions
import msgspec
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import h2 as hypercorn_h2
from hypercorn.protocol import h11 as hypercorn_h11
from hypercorn.protocol.h2 import BufferCompleteError
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.utils import parse_socket_addr
from hyperframe.frame import DataFrame, PingFrame, PriorityFrame, RstStreamFrame, SettingsFrame

from backends.h2client import read_some, write_now
from backends.h2lite import LeanH2Connection
from frontend.h2_headers import CheckedWhenNeeded
from frontend.limits import DEFAULT_LIMITS, Budget, ConnectionLedger, Limits
from frontend.wire import error_body

__all__ = [
    "RESERVE_IDLE_TIMEOUT",
    "GuardedH2Connection",
    "ImmediateRawData",
    "StreamBuffer",
    "WriteStalled",
    "install",
    "protect_secrets_in_library_logs",
    "reserve_gate",
    "reset_stalled",
]

log = logging.getLogger(__name__)


RESERVE_IDLE_TIMEOUT = 2.0  # seconds a connection in the reserve may sit idle
MIN_SHARE = 16 * 1024  # the least unsent output a stream may hold, however many share its connection


# ---------------------------------------------------------------- bounded output


class WriteStalled(Exception):
    """A stream's client took none of its output for ``write_stall_timeout``."""


class _Unsent:
    """Bytes a connection holds for its client, over all its streams, and
    each open stream's share of ``limit``; the buffers waiting on their
    share are woken when it grows (a stream closed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.streams = 0
        self.waiting: set[StreamBuffer] = set()

    @property
    def share(self) -> int:
        return max(MIN_SHARE, self.limit // max(1, self.streams))

    def add(self, n: int) -> None:
        self.bytes += n

    def take(self, n: int) -> None:
        self.bytes -= n

    def join(self) -> None:
        self.streams += 1

    def leave(self) -> None:
        self.streams -= 1
        waiting, self.waiting = self.waiting, set()
        for buffer in waiting:
            buffer._wake()


_UNBOUNDED = _Unsent(sys.maxsize)


class StreamBuffer:
    """hypercorn's ``StreamBuffer`` (same methods), bounded: ``push`` returns
    once the stream holds under ``limit`` bytes and under its share of the
    connection's budget, and raises :class:`WriteStalled` when that takes
    ``stall`` seconds; ``drain`` likewise. Only bytes actually taken by
    ``pop`` (sent) wake a writer: a pop of 0 bytes (zero window) releases
    nobody."""

    def __init__(self, event_class: object = None) -> None:
        self.buffer = bytearray()
        self._complete = self._closed = False
        self._taken = trio.Event()
        self._blocked_since: float | None = None  # blocked, and nothing taken since
        self.unsent = _UNBOUNDED
        self._attached = False  # counted in unsent.streams
        self.limit = DEFAULT_LIMITS.stream_buffer_bytes
        self.stall = DEFAULT_LIMITS.write_stall_timeout

    def attach(self, unsent: _Unsent, limits: Limits) -> None:
        """Count this buffer in its connection's ``unsent`` from now on."""
        self.unsent.take(len(self.buffer))
        unsent.add(len(self.buffer))
        unsent.join()
        self._attached = True
        self.unsent, self.limit, self.stall = unsent, limits.stream_buffer_bytes, limits.write_stall_timeout

    @property
    def complete(self) -> bool:
        return self._complete and not self.buffer

    @property
    def empty(self) -> bool:
        """Open, with nothing waiting to be sent: a write may bypass it."""
        return not self.buffer and not self._complete

    def set_complete(self) -> None:
        self._complete = True

    async def close(self) -> None:
        self._complete = self._closed = True
        self.unsent.take(len(self.buffer))
        self.buffer = bytearray()
        self._wake()
        if self._attached:
            self._attached = False
            self.unsent.leave()

    async def push(self, data: bytes) -> None:
        if self._complete:
            raise BufferCompleteError()
        self.buffer.extend(data)
        self.unsent.add(len(data))
        await self._wait(self._over)

    async def pop(self, max_length: int) -> bytes:
        data = bytes(self.buffer[:max_length])
        if data:
            del self.buffer[: len(data)]
            self._blocked_since = None
            self.unsent.take(len(data))
            self._wake()
        return data

    async def drain(self) -> None:
        await self._wait(lambda: bool(self.buffer))

    def _over(self) -> bool:
        return len(self.buffer) >= min(self.limit, self.unsent.share)

    def _wake(self) -> None:
        self._taken.set()
        self._taken = trio.Event()

    async def _wait(self, blocked: Callable[[], bool]) -> None:
        """Until not ``blocked()``: woken by our own bytes taken, by closing,
        or by our share growing (another stream closed). The stall clock
        runs from the first wait after our last bytes were taken: room made
        by other streams does not reset it, only progress of our own."""
        if not blocked():
            return
        if self._blocked_since is None:
            self._blocked_since = trio.current_time()
        deadline = self._blocked_since + self.stall
        try:
            while blocked() and not self._closed:
                self.unsent.waiting.add(self)
                with trio.move_on_at(deadline) as waited:
                    await self._taken.wait()
                if waited.cancelled_caught:
                    raise WriteStalled()
        finally:
            self.unsent.waiting.discard(self)


# ---------------------------------------------------------------- h2: refuse, don't die


class GuardedH2Connection(CheckedWhenNeeded, LeanH2Connection):
    """h2's server connection, spending two budgets frame by frame (a read
    of 64 KiB holds thousands of frames: a check per read would let a Rapid
    Reset client open 2,400 streams before it) and with two connection
    errors made stream errors (RFC 9113 5.1.2 and 8.1.1 allow both):

    - a HEADERS frame that opens a stream over our MAX_CONCURRENT_STREAMS:
      h2 raises TooManyStreamsError (GOAWAY, every stream lost); here the
      header block is still decoded (HPACK state must follow) and the stream
      is refused with RST_STREAM(REFUSED_STREAM), which the client may retry;
    - a malformed request header block (uppercase or connection-specific
      names, bad pseudo-headers, a bad content-length): RST_STREAM(PROTOCOL_ERROR)
      on that stream only.

    A response header block that is already canonical goes out without h2's
    outbound normalization and validation (:class:`~frontend.h2_headers.CheckedWhenNeeded`).

    Budgets: RST_STREAM frames received for streams younger than
    ``premature_reset`` and streams we refused or reset for their headers
    spend the reset budget; PING, SETTINGS, PRIORITY frames and
    empty DATA frames without END_STREAM spend the control budget. Over
    either, h2 answers :class:`~h2.exceptions.DenialOfServiceError` as it
    answers any protocol error: GOAWAY (here ENHANCE_YOUR_CALM), and hypercorn
    closes the connection."""

    _lifting = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incoming_buffer = _FrameBuffer(server=not self.config.client_side)
        self.guard(DEFAULT_LIMITS, None)

    def guard(self, limits: Limits, peer: object) -> None:
        """Spend ``limits``' budgets; ``peer`` names the client in the log."""
        self.limits, self.peer = limits, peer
        self.resets = Budget(limits.reset_burst, limits.reset_rate)
        self.opened: dict[int, float] = {}  # stream -> when, for streams younger than premature_reset
        self.control = Budget(limits.control_burst, limits.control_rate)

    @property
    def open_inbound_streams(self) -> int:
        return 0 if self._lifting else super().open_inbound_streams

    def _receive_frame(self, frame: Any) -> list[Any]:
        kind = type(frame)
        if kind is RstStreamFrame:
            opened = self.opened.pop(frame.stream_id, None)
            if opened is not None and trio.current_time() - opened < self.limits.premature_reset:
                self._spend(self.resets, "stream resets")
        elif kind in _CONTROL_FRAMES or (kind is DataFrame and not frame.data and "END_STREAM" not in frame.flags):
            self._spend(self.control, "control frames")
        events: list[Any] = super()._receive_frame(frame)
        return events

    def _spend(self, budget: Budget, what: str) -> None:
        if not budget.spend(trio.current_time()):
            log.warning("closing the HTTP/2 connection from %s: %s over %d at once or %g/s (GOAWAY ENHANCE_YOUR_CALM)",
                        self.peer, what, budget.burst, budget.rate)
            raise h2.exceptions.DenialOfServiceError(f"{what} over budget")

    def _opening(self, sid: int) -> None:
        """Remember when ``sid`` opened; forget streams past premature_reset."""
        now = trio.current_time()
        opened = self.opened
        while opened:
            first = next(iter(opened))
            if now - opened[first] < self.limits.premature_reset:
                break
            del opened[first]
        opened[sid] = now

    def _receive_headers_frame(self, frame: Any) -> tuple[list[Any], list[Any]]:
        sid = frame.stream_id
        new = sid not in self.streams
        if new:
            self._opening(sid)
        over = new and sid % 2 == 1 and self.open_inbound_streams >= self.local_settings.max_concurrent_streams
        self._lifting = over
        try:
            frames, events = super()._receive_headers_frame(frame)
        except h2.exceptions.ProtocolError as exc:
            if type(exc) is h2.exceptions.ProtocolError and isinstance(exc.__cause__, hpack.exceptions.HPACKError):
                # RFC 9113 4.3 (h2 says PROTOCOL_ERROR); an oversized list stays
                # DenialOfServiceError, ENHANCE_YOUR_CALM.
                raise _CompressionError(str(exc)) from exc
            # Only a new stream's own header block: every other failure
            # (connection state, stream ids, HPACK) stays a connection error.
            if not (new and type(exc) is h2.exceptions.ProtocolError and sid in self.streams):
                raise
            return self._reset_new(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR, [], [])
        finally:
            self._lifting = False
        if over:
            return self._reset_new(sid, h2.errors.ErrorCodes.REFUSED_STREAM, frames, events)
        return frames, events

    def _reset_new(self, sid: int, code: int, frames: list[Any], events: list[Any]) -> tuple[list[Any], list[Any]]:
        self.reset_stream(sid, code)
        self._spend(self.resets, "streams refused or reset")
        kept = [e for e in events if getattr(e, "stream_id", None) != sid]
        return frames, kept


_CONTROL_FRAMES = (PingFrame, SettingsFrame, PriorityFrame)


class _CompressionError(h2.exceptions.ProtocolError):
    """A header block that does not decode: the HPACK state is lost with it."""

    error_code = h2.errors.ErrorCodes.COMPRESSION_ERROR


class _FrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, but a SETTINGS ack with a payload is
    FRAME_SIZE_ERROR (RFC 9113 6.5), not h2's PROTOCOL_ERROR."""

    def __next__(self) -> Any:
        head = self._data[:9]
        if len(head) == 9 and head[3] == 0x4 and head[4] & 0x1 and int.from_bytes(head[:3], "big"):
            raise h2.exceptions.FrameDataMissingError("a SETTINGS ack with a payload")
        return super().__next__()


def _guarded_connection(old: h2.connection.H2Connection, limits: Limits, peer: object) -> GuardedH2Connection:
    """A :class:`GuardedH2Connection` set up as hypercorn set up ``old``."""
    conn = GuardedH2Connection(config=old.config)
    conn.DEFAULT_MAX_INBOUND_FRAME_SIZE = old.DEFAULT_MAX_INBOUND_FRAME_SIZE
    conn.local_settings = old.local_settings
    conn.guard(limits, peer)
    _uncycled(old)  # hypercorn's, replaced: freed now, not by a collection
    return conn


def _uncycled(connection: h2.connection.H2Connection) -> None:
    """Break an h2 connection's reference cycle: its frame dispatch table
    holds its own bound methods. For a connection that is done with."""
    connection._frame_dispatch_table = {}


# ---------------------------------------------------------------- per-connection state


class _Guard:
    """One HTTP/2 connection's output ledger, and its streams given up."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.unsent = _Unsent(limits.connection_buffer_bytes)
        self.stalled = 0


def _limits_of(config: object) -> Limits:
    limits = getattr(config, "headrace_limits", None)
    return limits if isinstance(limits, Limits) else DEFAULT_LIMITS


def _guard_of(protocol: Any) -> _Guard:
    guard: _Guard | None = getattr(protocol, "_headrace_guard", None)
    if guard is None:
        guard = protocol._headrace_guard = _Guard(_limits_of(protocol.config))
    return guard


def reset_stalled(connection: h2.connection.H2Connection, client: object, stream_id: int, limits: Limits,
                  stalled: int) -> None:
    """RST_STREAM(CANCEL) for a stream whose client read nothing for the
    write-stall timeout, the ``stalled``-th on its connection: logged as a
    warning the first time, at debug after (one slow client, one warning)."""
    level = logging.WARNING if stalled == 1 else logging.DEBUG
    log.log(level, "HTTP/2 client %s read nothing of stream %d for %.0f s: stream reset (%d on this connection)",
            client, stream_id, limits.write_stall_timeout, stalled)
    try:
        connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
    except h2.exceptions.ProtocolError:
        pass


async def _give_up(protocol: Any, stream_id: int) -> None:
    """A stream's client read nothing for the write-stall timeout: reset the
    stream and tell the app it is gone (its backend request is cancelled)."""
    guard = _guard_of(protocol)
    guard.stalled += 1
    reset_stalled(protocol.connection, protocol.client, stream_id, guard.limits, guard.stalled)
    # Flushed first: once the app is told, it is cancelled, flush and all.
    await protocol._flush()
    buffer = protocol.stream_buffers.get(stream_id)
    if buffer is not None:
        await buffer.close()
    await protocol._close_stream(stream_id)  # http.disconnect: the app cancels its work
    await protocol._window_updated(stream_id)  # the sender forgets the stream


# ---------------------------------------------------------------- the patches


def _patch_h2_protocol() -> None:
    protocol = hypercorn_h2.H2Protocol
    hypercorn_h2.StreamBuffer = StreamBuffer  # type: ignore[assignment, misc]
    init, create_stream = protocol.__init__, protocol._create_stream
    handle_events, stream_send = protocol._handle_events, protocol.stream_send

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        limits = _limits_of(self.config)
        self.connection = _guarded_connection(self.connection, limits, self.client)
        self._headrace_guard = _Guard(limits)

    async def _create_stream(self: Any, request: h2.events.RequestReceived) -> None:
        await create_stream(self, request)
        buffer = self.stream_buffers.get(request.stream_id)
        if isinstance(buffer, StreamBuffer):
            guard = _guard_of(self)
            buffer.attach(guard.unsent, guard.limits)

    async def _handle_events(self: Any, events: list[h2.events.Event]) -> None:
        # Priority signals are deprecated (RFC 9113 5.3.2) and ignored: hypercorn
        # put every PRIORITY frame's stream in a tree that fails at 1,000.
        await handle_events(self, [e for e in events if not isinstance(e, h2.events.PriorityUpdated)])

    async def _stream_send(self: Any, event: Any) -> None:
        try:
            await stream_send(self, event)
        except WriteStalled:
            await _give_up(self, event.stream_id)

    protocol.__init__ = __init__  # type: ignore[method-assign]
    protocol._create_stream = _create_stream  # type: ignore[method-assign]
    protocol._handle_events = _handle_events  # type: ignore[method-assign]
    protocol.stream_send = _stream_send  # type: ignore[method-assign]


def _patch_tcp_server() -> None:
    """A socket write blocked for the write-stall timeout closes the
    connection (hypercorn's write is shielded and waits forever); a
    connection over the caps is closed as soon as it is accepted; a client
    gone (end of file) gives its socket back at once, not after the
    keep-alive timeout (hypercorn's idle task held it that long); the
    keep-alive timeout itself is one task per connection, not one per idle
    spell (:class:`IdleDeadline`)."""
    protocol_send, run, read_data = TCPServer.protocol_send, TCPServer.run, TCPServer._read_data

    async def _read_data(self: Any) -> None:
        if self.config.read_timeout:
            await read_data(self)
        else:
            await _read_without_deadline(self)
        self._headrace_read_done = True
        self.idle_task.end()  # an IdleDeadline: the __init__ below installs it

    async def _protocol_send(self: Any, event: Any) -> None:
        if isinstance(event, Updated) and getattr(self, "_headrace_read_done", False):
            return  # no idle wait for a client that is gone
        if not isinstance(event, RawData):
            await protocol_send(self, event)
            return
        lock: trio.Lock = self.send_lock
        if isinstance(event, ImmediateRawData) and not lock.locked():
            lock.acquire_nowait()
            try:
                sent = _write_now(self.stream, event.data)
                if sent < len(event.data):
                    await _send_locked(self, event.data[sent:])
            finally:
                lock.release()
            return
        async with lock:
            await _send_locked(self, event.data)

    async def _read_without_deadline(self: Any) -> None:
        # hypercorn's loop less its ``fail_after(read_timeout or inf)``: a
        # cancel scope a read (~5 us on a slow core, 1% of a request) for a
        # deadline that never comes. The keep-alive timeout is IdleDeadline's.
        stream = self.stream
        while True:
            try:
                data = await read_some(stream, MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            await self.protocol.handle(RawData(data))
            if not data:
                break
        await self.protocol.handle(Closed())

    async def _send_locked(self: Any, data: bytes) -> None:
        stall = _limits_of(self.config).write_stall_timeout
        try:
            # Shielded: a write cut in half would corrupt the stream; bounded instead.
            with trio.CancelScope(shield=True, deadline=trio.current_time() + stall) as scope:
                await self.stream.send_all(data)
            if scope.cancelled_caught:
                log.warning("closing a connection: a write made no progress for %.0f s", stall)
                await self.protocol.handle(Closed())
                await self.stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())

    async def _run(self: Any) -> None:
        try:
            await _admitted_run(self)
        finally:
            _dismantle(self)

    async def _admitted_run(self: Any) -> None:
        ledger: ConnectionLedger | None = getattr(self.config, "headrace_connections", None)
        client = _peer(self.stream) if ledger is not None else None
        if ledger is None or client is None:
            await run(self)
            return
        admission = ledger.admit(client)
        if admission == "refused":
            await self.stream.aclose()
            return
        if admission == "reserve":
            # One request, and a short idle wait: idle connections must not
            # sit in the reserve that probes need.
            self.config = copy.copy(self.config)
            self.config.keep_alive_timeout = min(self.config.keep_alive_timeout, RESERVE_IDLE_TIMEOUT)
            self.config.keep_alive_max_requests = 1
        try:
            await run(self)
        finally:
            ledger.release(client)

    init = TCPServer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.idle_task = IdleDeadline(self)

    TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
    TCPServer.run = _run  # type: ignore[method-assign]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
    TCPServer.__init__ = __init__  # type: ignore[method-assign]


def _dismantle(server: Any) -> None:
    """Break the reference cycles of a finished connection's objects, so
    that they are freed when its task ends instead of by a collection: the
    server's protocol holds the server's bound ``protocol_send``, its
    :class:`IdleDeadline` the server, and h2's connection its own bound
    frame handlers. A connection lives long enough to be promoted to the
    collector's oldest generation, where its garbage waited for a full
    collection: ~70 objects a connection, with their buffers and header
    caches."""
    wrapper = server.__dict__.pop("protocol", None)
    server.idle_task = None
    connection = getattr(getattr(wrapper, "protocol", None), "connection", None)
    if isinstance(connection, h2.connection.H2Connection):
        _uncycled(connection)


class IdleDeadline:
    """hypercorn's keep-alive timeout (``TCPServer.idle_task``) without a
    task per idle spell. hypercorn 0.18 cancels its idle task whenever the
    connection gets busy and starts a new one (``nursery.start``: a spawn,
    and the caller waits a scheduler turn for it) whenever it goes idle again:
    with one request at a time on a connection, that is every request, at the
    end of its answer. Here one watcher task per connection, started at its
    first idle spell, waits under a cancel scope with a deadline. The
    behaviour is hypercorn's: an idle connection closes ``keep_alive_timeout``
    after it went idle, or at once when the server shuts down (a busy one
    once it is idle again). The same two methods as hypercorn's
    ``TrioSingleTask`` (``action``, the server's own ``_idle_timeout``, is
    what this does), and :meth:`end` for a connection whose reading is over.

    Going busy and idle again (every request) only notes when: a deadline
    set on each (two a request: trio's deadline bookkeeping, 0.65% of a
    streamed request's instructions) is not needed, since the deadline only
    moves later. When it passes, the watcher looks: idle for the whole
    timeout, it closes; idle for less, it waits for the rest; busy, it
    waits with no deadline until the connection is idle again, which sets
    one (at most once a timeout, not once a request)."""

    __slots__ = ("_ended", "_idle", "_idle_since", "_scope", "_server")

    def __init__(self, server: Any) -> None:
        self._server = server
        self._scope: trio.CancelScope | None = None
        self._idle = False
        self._idle_since = 0.0
        self._ended = False

    async def restart(self, task_group: Any, action: object) -> None:
        """The connection is idle: it closes ``keep_alive_timeout`` from now."""
        self._idle = True
        self._idle_since = trio.current_time()
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=self._deadline())
            task_group._nursery.start_soon(self._watch, name="hypercorn idle deadline")
        elif self._scope.deadline == math.inf:  # the watcher found it busy: waiting for this
            self._scope.deadline = self._deadline()

    async def stop(self) -> None:
        """The connection is busy (its deadline, if it passes, finds it so)."""
        self._idle = False

    def end(self) -> None:
        """Reading is over (the client left, or the connection closed): the
        watcher goes without closing anything, so the connection's task group
        can end."""
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    def _deadline(self) -> float:
        if not self._idle:
            return math.inf  # busy: the next idle spell sets one
        if self._server.context.terminated.is_set():
            return -math.inf  # shutting down: an idle connection goes now
        timeout: float = self._server.config.keep_alive_timeout
        return self._idle_since + timeout

    async def _watch(self) -> None:
        terminated = self._server.context.terminated
        while True:
            assert self._scope is not None
            with self._scope:
                if terminated.is_set():
                    await trio.sleep_forever()  # busy at shutdown: ends at the next idle spell (deadline now)
                await terminated.wait()
            if self._ended:
                return
            if self._idle and trio.current_time() >= self._deadline():
                break  # idle for the whole timeout, or shutting down
            self._scope = trio.CancelScope(deadline=self._deadline())  # none while busy
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()


# (a module attribute: tests count the immediate writes by replacing it)
_write_now = write_now


@dataclass(frozen=True)
class ImmediateRawData(RawData):
    """Bytes to write now if they can be: when the connection's send lock is
    free and the socket takes them all, they are written without a
    checkpoint (frontend/serving.py sends a whole small response so, from
    the app's task). Otherwise, or for the rest, the usual locked send."""


def _peer(stream: Any) -> tuple[str, int] | None:
    sock = getattr(getattr(stream, "transport_stream", stream), "socket", None)
    try:
        return parse_socket_addr(sock.family, sock.getpeername()) if sock is not None else None
    except OSError:
        return None


def _patch_h11_framing() -> None:
    """RFC 9112 6.1: a request with both Content-Length and Transfer-Encoding
    may be a smuggling attempt; h11 frames it by Transfer-Encoding and keeps
    the connection, so what the length hid was read as a second request.
    Answer 400 with ``Connection: close`` and read nothing more."""
    protocol = hypercorn_h11.H11Protocol
    create_stream = protocol._create_stream

    async def _create_stream(self: Any, request: Any) -> None:
        names = {name.lower() for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            await self._send_error_response(400)
            await self.send(Closed())
            return
        await create_stream(self, request)

    protocol._create_stream = _create_stream  # type: ignore[method-assign]


def install() -> None:
    """Install the patches once (frontend/serving.py calls this at import)."""
    if getattr(TCPServer, "_headrace_hardened", False):
        return
    _patch_h2_protocol()
    _patch_tcp_server()
    _patch_h11_framing()
    TCPServer._headrace_hardened = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the reserve


def reserve_gate(app: Callable[..., Any], ledger: ConnectionLedger, paths: frozenset[str]) -> Callable[..., Any]:
    """``app``, except that a connection in the reserve is answered 503 for
    any path but ``paths`` (and closed, over HTTP/1.1)."""
    body = msgspec.json.encode(error_body("the server is at its connection limit; retry", "server_error", None, "overloaded"))

    async def gated(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in paths or not ledger.is_reserve(scope.get("client")):
            await app(scope, receive, send)
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]
        if scope.get("http_version") in ("1.0", "1.1"):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return gated


# ---------------------------------------------------------------- secrets in logs

# A credential header's name, the separator after it (": ", "', b'", "=") and its value.
_SECRET_HEADERS = re.compile(
    r"(authorization|proxy-authorization|x-api-key|api-key|cookie|set-cookie)(['\"]?\s*[:,=]\s*b?['\"]?)([^'\"\r\n,)]*)",
    re.IGNORECASE,
)
_PROTOCOL_LOGGERS = ("hpack", "h2", "hyperframe")


class _DropDebug(logging.Filter):
    """hpack's DEBUG records are header blocks, decoded (``authorization:
    Bearer <key>``) or encoded: none may ever be written."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO


class _Redact(logging.Filter):
    """Values of credential headers in a record's message become ``<redacted>``."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _SECRET_HEADERS.sub(lambda m: m.group(1) + m.group(2) + "<redacted>", message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def protect_secrets_in_library_logs() -> None:
    """Hold the HTTP/2 libraries' loggers at INFO and drop their DEBUG
    records whatever level is set later (``--log-level DEBUG`` made hpack
    log ``authorization: Bearer <key>``); redact credential headers in
    hypercorn's error and access logs."""
    for name in _PROTOCOL_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    for name in ("hpack.hpack", "hpack.table"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDebug) for f in logger.filters):
            logger.addFilter(_DropDebug())
    for name in ("hypercorn.error", "hypercorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Redact) for f in logger.filters):
            logger.addFilter(_Redact())

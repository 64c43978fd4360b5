"""A lean HTTP/2 client for the router's upstream connections: trio +
:mod:`backends.h2wire` (a sans-I/O client side of HTTP/2; it replaced h2,
whose general state machines were ~11% of the router's CPU per request).

Why not httpx: opening a request through httpx/httpcore cost the router ~20%
of its CPU and reading the upstream another ~24%; httpcore drops an abandoned
HTTP/2 stream without a reset (its data then eats the connection window until
the shared connection wedges), and h2 4.x treats GOAWAY as the end of the
connection, failing the streams the server promised to finish.

Shape::

    H2Pool(host, port)                      one per backend; no background task
      ├── H2Connection  (one trio stream, one h2wire.ClientConnection)
      │     ├── _Stream 1   <- H2Response (async with pool.stream(...) as resp)
      │     └── _Stream 3
      └── H2Connection  (opened when every other one is full)

**No reader task: the reader role.** The adapter owns the pool with just
``__init__`` + ``aclose()``, without a nursery, so there is no task to run a
per-connection reader in. Instead (as httpcore does with its read lock) the
task that needs bytes reads them: a consumer waiting on its stream becomes the
connection's reader if nobody is, reads a batch from the socket, feeds h2wire and
dispatches the events to every stream's buffer, waking the parked tasks whose
stream got news; it stops once its own stream has news and hands the role to
one parked task. Waking is per stream (``trio.lowlevel`` park/reschedule), so a
read costs O(streams that got data), not O(streams). Structured concurrency
holds: every read runs in some request's task, under that request's cancel
scope. A cancelled ``receive_some`` loses nothing (SocketStream, and SSLStream
after its handshake); a cancelled ``send_all`` would cut a frame in half, so
writes are shielded and bounded by ``write_timeout`` instead. Writes coalesce:
whoever writes drains h2wire's whole buffer; others just append to it::

    request task A              request task B            socket
        │ wait(A): reader ─────────────────────────────────> receive_some
        │ <─ DATA(B), DATA(A) ── dispatch: B.buf, wake B
        │ A has news: hand the role over (B, if parked)
        ▼ consume                    ▼ consume / become reader

**Flow control.** Local SETTINGS give each stream a 256 KiB window and the
connection a 16 MiB one. Received bytes are credited to the *connection* at
once (in batches of a quarter window), so a stream whose consumer stops can
never stall its neighbours; they are credited to the *stream* only as its
consumer takes them (in batches of half a window), so the server stops sending
to a stream nobody reads, and the client holds at most ``stream_window`` bytes
per stream (h2wire raises on a peer that overruns it). Data for a stream we
reset or forgot comes as data for stream 0 and is credited to the
connection with the rest, so the uncredited total stays below the window.
The stream window is most of what the router holds for a client
that stops reading, per stream, until its stall timeout: with 1 MiB, 100
stalled streams grew the router by over 120 MiB (and still growing after 8 s);
with 256 KiB, by about 48 MiB, flat (tests/hardening/test_slow_readers.py).
256 KiB still carries over 2 MB/s per stream at a 100 ms round trip, far more
than a token stream needs.

**GOAWAY** is an event (h2 4.x moved to CLOSED on it and rejected every
later frame, so a filter used to cut GOAWAY frames out of its input). The
connection drains: streams up to ``last_stream_id`` run to completion, higher ones fail
with :class:`RefusedStream` (as do ``RST_STREAM(REFUSED_STREAM)`` resets),
new requests go to another connection, and the connection closes itself once
idle. We answer a GOAWAY with a PING: a conformant server acks it; hypercorn
0.18, which can send nothing more once it has sent GOAWAY (its h2 is CLOSED
too), drops the connection on it, so its orphaned streams fail at once with
:class:`ConnectionLost` instead of hanging.

**Cost.** Headers and body go out in one write; a read batch ends in one
write of every reply (WINDOW_UPDATE, SETTINGS/PING acks); a consumer takes
everything buffered for its stream as one bytes object (no copy when it is
one frame); header blocks are encoded without HPACK's dynamic table. On
loopback against hypercorn, 20-event SSE streams cost about 0.5 ms of client
CPU each with h2 underneath, against 1.3 ms through httpx; h2wire took
another ~10% off the router's CPU per request.

Errors: every OSError, ssl.SSLError, trio resource error and protocol error is
translated here; callers catch only::

    H2Error                    .safe_to_retry
    ├── ConnectError           True   no connection (DNS, refused, TLS, timeout)
    │   └── H2Unsupported      True   the server speaks HTTP/1.1 only: fall back
    ├── PoolTimeout            True   every connection full for pool_timeout
    ├── PoolClosed             False  the pool was closed
    ├── RefusedStream          True   the server did not process the request
    ├── StreamReset            False  the server reset the stream (.error_code)
    ├── ConnectionLost         False  the connection died (EOF, reset, wedged write)
    └── ProtocolError          False  the server broke HTTP/2
"""

from __future__ import annotations

import errno
import math
import os
import ssl
from collections.abc import Iterable, Mapping
from types import TracebackType

import msgspec
import trio

from backends import h2wire
from backends.h2wire import ClientConnection, ErrorCode

__all__ = [
    "ConnectError",
    "ConnectionLost",
    "H2Connection",
    "H2ConnectionStatistics",
    "H2Error",
    "H2Pool",
    "H2PoolStatistics",
    "H2Reply",
    "H2Response",
    "H2Unsupported",
    "PoolClosed",
    "PoolTimeout",
    "ProtocolError",
    "RefusedStream",
    "StreamReset",
]

Headers = Mapping[str, str] | Iterable[tuple[str | bytes, str | bytes]]

_READ_SIZE = 65536
_GOAWAY_TYPE = 0x7
_LAST_STREAM_ID = 2**31 - 1
_TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)
_CANCEL = ErrorCode.CANCEL
_REFUSED = ErrorCode.REFUSED_STREAM
_ERROR_NAMES = {v: k for k, v in vars(ErrorCode).items() if k.isupper()}


# ---------------------------------------------------------------- errors


class H2Error(Exception):
    """Base of every error this module raises."""

    safe_to_retry = False


class ConnectError(H2Error):
    """Could not open a connection (DNS, refused, TLS handshake, timeout)."""

    safe_to_retry = True


class H2Unsupported(ConnectError):
    """The server does not speak HTTP/2 (ALPN picked something else, or it
    answered the prior-knowledge preface as HTTP/1.x): use HTTP/1.1."""


class PoolTimeout(H2Error):
    """Every connection stayed full (and no new one was allowed) for ``pool_timeout``."""

    safe_to_retry = True


class PoolClosed(H2Error):
    """The pool was closed."""


class RefusedStream(H2Error):
    """The server did not process the request (a GOAWAY below its stream id,
    or RST_STREAM(REFUSED_STREAM)): safe to retry anywhere."""

    safe_to_retry = True


class StreamReset(H2Error):
    """The server reset the stream with ``error_code``."""

    def __init__(self, error_code: int, message: str = "") -> None:
        self.error_code = error_code
        name: object = _ERROR_NAMES.get(error_code, error_code)
        super().__init__(message or f"the server reset the stream ({name})")


class ConnectionLost(H2Error):
    """The connection died before the stream ended."""


class ProtocolError(H2Error):
    """The server broke the HTTP/2 protocol."""


# ---------------------------------------------------------------- records


class H2ConnectionStatistics(msgspec.Struct, frozen=True):
    streams: int
    max_streams: int
    draining: bool
    inbound_window: int  # connection window as advertised to the server
    buffered_bytes: int  # received, not yet taken by consumers


class H2PoolStatistics(msgspec.Struct, frozen=True):
    connections: tuple[H2ConnectionStatistics, ...]
    connections_opened: int
    streams_opened: int
    streams_cancelled: int  # left early: RST_STREAM(CANCEL) sent
    streams_refused: int


class H2Reply(msgspec.Struct, frozen=True):
    status: int
    headers: dict[str, str]
    body: bytes


# ---------------------------------------------------------------- one stream


class _Stream:
    """The state one request's task and the connection's reader share."""

    __slots__ = (
        "chunks", "credit", "deadline", "ended", "error", "expired", "flag", "flow_pending",
        "headers", "sent_end", "sid", "status", "task",
    )  # fmt: skip

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []  # received, not yet taken
        self.flow_pending = 0  # flow-controlled bytes in chunks (padding included)
        self.credit = 0  # taken by the consumer, not yet credited to the stream window
        self.ended = False  # END_STREAM received
        self.sent_end = False  # END_STREAM sent
        self.error: H2Error | None = None
        self.flag = False  # news since the task last looked
        self.task: trio.lowlevel.Task | None = None  # parked, waiting for news
        self.deadline = math.inf  # when its consumer gives up waiting (H2Response.next_within)
        self.expired = False  # that deadline passed while it waited

    @property
    def buffered(self) -> int:
        return sum(map(len, self.chunks))

    def abort(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED


# ---------------------------------------------------------------- one connection


class H2Connection:
    """One HTTP/2 connection of an :class:`H2Pool`. Not used directly."""

    def __init__(self, pool: H2Pool, transport: trio.abc.Stream) -> None:
        self._pool = pool
        self._transport = transport
        self._h2 = ClientConnection(stream_window=pool.stream_window, connection_window=pool.connection_window)
        self._streams: dict[int, _Stream] = {}
        # Parked consumers, oldest first (a dict as an ordered set): the
        # reader role goes to the one that has waited longest.
        self._parked: dict[_Stream, None] = {}
        self._senders: set[_Stream] = set()  # waiting for send window
        self._reading = False
        self._read_scope: trio.CancelScope | None = None  # the reader's, while it waits with a deadline
        self._writing = False
        self._settled = False  # the server's first SETTINGS arrived
        self._conn_credit = 0
        self._conn_threshold = pool.connection_window // 4
        self._stream_threshold = pool.stream_window // 2
        self.max_streams = 1
        self.goaway_id: int | None = None
        self.error: H2Error | None = None
        self.idle_since = trio.current_time()

    # ------------------------------------------------------------ state

    def available(self) -> bool:
        return (
            self.error is None
            and self.goaway_id is None
            and len(self._streams) < self.max_streams
            and self._h2.highest_outbound_stream_id < _LAST_STREAM_ID - 2
        )

    def statistics(self) -> H2ConnectionStatistics:
        return H2ConnectionStatistics(
            streams=len(self._streams),
            max_streams=self.max_streams,
            draining=self.goaway_id is not None,
            inbound_window=self._h2.recv_window,
            buffered_bytes=sum(s.buffered for s in self._streams.values()),
        )

    # ------------------------------------------------------------ opening

    async def start(self) -> None:
        """Send our preface and settings; read until the server's SETTINGS
        (so its stream limit is known). The caller bounds the time."""
        self._h2.initiate()
        await self._flush()
        first = True
        while not self._settled and self.error is None:
            await self._read_round(first=first)
            first = False
        if self.error is not None:
            raise self.error

    def open(self, headers: list[tuple[bytes, bytes]], body: bytes) -> _Stream:
        """Put HEADERS for a new stream into h2wire's buffer (the caller sends
        the body and flushes). Called right after :meth:`H2Pool._acquire`
        returned this connection, with no checkpoint between: nobody else can
        take the slot it found (:meth:`available` counted the server's
        limit), so no reservation is needed."""
        try:
            sid = self._h2.send_headers(headers, end_stream=not body)
        except h2wire.ProtocolError as exc:
            raise RefusedStream(f"no stream available on this connection: {exc}") from None
        s = _Stream(sid)
        self._streams[sid] = s
        s.sent_end = not body
        return s

    def send_some(self, s: _Stream, body: memoryview) -> memoryview:
        """Put as much of ``body`` as flow control allows into h2wire's buffer;
        return the rest. The last frame carries END_STREAM."""
        h2c = self._h2
        try:
            window = h2c.send_window_of(s.sid)
            frame = h2c.max_outbound_frame_size
            while body and window > 0:
                n = min(len(body), window, frame)
                last = n == len(body)
                h2c.send_data(s.sid, body[:n].tobytes(), end_stream=last)
                body, window = body[n:], window - n
                s.sent_end = last
        except h2wire.ProtocolError as exc:
            if s.error is None and not s.ended:
                s.error = ProtocolError(f"could not send the request body: {exc!r}")
            return body[:0]
        return body

    async def send_body(self, s: _Stream, body: memoryview) -> None:
        """Send the rest of a request body, waiting for window as needed."""
        while body and s.error is None and not s.ended and self.error is None:
            body = self.send_some(s, body)
            await self._flush()
            if body:
                self._senders.add(s)
                try:
                    await self.wait(s)
                finally:
                    self._senders.discard(s)

    # ------------------------------------------------------------ waiting and reading

    async def wait(self, s: _Stream) -> None:
        """Return once something happened to ``s`` (or the reader role came
        free: the caller re-checks and calls again). See the module docstring."""
        s.flag = False
        if self.error is not None:
            await trio.lowlevel.checkpoint()
            return
        if self._reading:
            s.task = trio.lowlevel.current_task()
            self._parked[s] = None
            scope = self._read_scope
            if scope is not None and s.deadline < scope.deadline:
                scope.deadline = s.deadline  # the reader wakes in time to expire us
            try:
                await trio.lowlevel.wait_task_rescheduled(s.abort)
            finally:
                self._parked.pop(s, None)
            return
        self._reading = True
        try:
            while not s.flag and self.error is None:
                await self._read_round(s)
        finally:
            self._reading = False
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the reader role to the longest-parked task still waiting. A
        parked stream whose task is None was cancelled (its ``abort`` ran)
        and has not run yet: it leaves without reading, so waking it would
        leave the others parked with nobody reading; it is skipped (its own
        ``finally`` would drop it from the set anyway)."""
        parked = self._parked
        while parked:
            s = next(iter(parked))
            del parked[s]
            if s.task is not None:
                self._wake(s)
                return

    def _wake(self, s: _Stream) -> None:
        s.flag = True
        task = s.task
        if task is not None:
            s.task = None
            self._parked.pop(s, None)
            trio.lowlevel.reschedule(task)

    async def _read_round(self, reader: _Stream | None = None, *, first: bool = False) -> None:
        """One read from the socket, dispatched; then our replies flushed.
        ``reader``: the stream whose consumer reads. Where it or a parked
        stream has a deadline, the read waits until the earliest (in a
        cancel scope a parked consumer may bring forward), and every stream
        whose deadline has passed is then expired: its consumer wakes with
        :attr:`_Stream.expired` (the reader's own stops reading)."""
        deadline = math.inf
        if reader is not None:
            deadline = reader.deadline
            for p in self._parked:
                if p.deadline < deadline:
                    deadline = p.deadline
        try:
            data = await (read_some(self._transport, _READ_SIZE) if deadline == math.inf else self._read_by(deadline))
        except _TRANSPORT_ERRORS as exc:
            self.fail(ConnectionLost, f"connection lost: {exc!r}")
            return
        if deadline != math.inf:
            self._expire(reader)
        if data is None:
            return  # a deadline came first
        if not data:
            self.fail(ConnectionLost, "the server closed the connection")
            return
        if first and data.startswith(b"HTTP/"):
            self.fail(H2Unsupported, "the server answered the HTTP/2 preface with HTTP/1.x")
            return
        try:
            events = self._h2.receive(bytes(data))
        except h2wire.ProtocolError as exc:
            self.fail(ProtocolError, f"HTTP/2 protocol error from the server: {exc}")
            return
        self._dispatch(events)
        if self._conn_credit >= self._conn_threshold:
            self._h2.window_update(self._conn_credit)
            self._conn_credit = 0
        await self._flush()

    async def _read_by(self, deadline: float) -> bytes | None:
        """:func:`read_some`, or None once ``deadline`` (or an earlier one a
        parked consumer sets on :attr:`_read_scope`) has passed. What the
        socket holds already is read without a cancel scope: the scope is
        for the wait, and a read that cannot wait needs none (~45 Python
        calls a scope, one a token where a backend paces its tokens)."""
        data = read_now(self._transport, _READ_SIZE)
        if data is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()  # as read_some's: a read is a checkpoint
            return data
        with trio.CancelScope(deadline=deadline) as scope:
            self._read_scope = scope
            try:
                return await read_some(self._transport, _READ_SIZE, wait_first=True)
            finally:
                self._read_scope = None
        return None  # cancelled by the deadline: a cancelled read loses nothing (see read_some)

    def _expire(self, reader: _Stream | None) -> None:
        """Expire every waiting stream whose deadline has passed: a parked
        consumer is woken, the reader's own stops its reading."""
        now = trio.current_time()
        if reader is not None and reader.deadline <= now:
            reader.expired = reader.flag = True
        for p in [p for p in self._parked if p.deadline <= now]:
            p.expired = True
            self._wake(p)

    def _dispatch(self, events: list[h2wire.Event]) -> None:
        streams = self._streams
        for ev in events:
            if isinstance(ev, h2wire.Data):
                n = ev.flow
                self._conn_credit += n
                s = streams.get(ev.stream_id)
                if s is None:
                    continue
                if ev.data:
                    s.chunks.append(ev.data)
                    s.flow_pending += n
                    self._wake(s)
                else:
                    s.credit += n  # padding only: credited with the next batch
            elif isinstance(ev, h2wire.Ended):
                s = streams.get(ev.stream_id)
                if s is not None:
                    s.ended = True
                    self._wake(s)
            elif isinstance(ev, h2wire.Response):
                self._on_response(ev)
            elif isinstance(ev, h2wire.Reset):
                self._on_reset(ev)
            elif isinstance(ev, h2wire.WindowOpened):
                for s in self._senders:  # _wake leaves _senders alone
                    if not ev.stream_id or s.sid == ev.stream_id:
                        self._wake(s)
            elif isinstance(ev, h2wire.SettingsChanged):
                self.max_streams = ev.max_streams
                self._settled = True
                self._pool._slots_changed()
            elif isinstance(ev, h2wire.GoAway):
                self._on_goaway(ev.last_stream_id, ev.error_code)

    def _on_response(self, ev: h2wire.Response) -> None:
        s = self._streams.get(ev.stream_id)
        if s is None:
            return
        headers = ev.headers
        try:
            s.status = (
                int(headers[0][1])
                if headers[0][0] == b":status"
                else int(dict(headers)[b":status"])
            )
        except (KeyError, IndexError, ValueError):
            s.error = ProtocolError(f"response without a valid :status: {headers[:4]!r}")
        s.headers = headers
        self._wake(s)

    def _on_reset(self, ev: h2wire.Reset) -> None:
        s = self._streams.get(ev.stream_id)
        if s is None:
            return
        code = ev.error_code
        if code == _REFUSED:
            s.error = RefusedStream(f"the server refused stream {s.sid} (REFUSED_STREAM)")
            self._pool._refused += 1
        elif not s.ended:  # after a complete response, a reset only stops our body
            s.error = StreamReset(code)
        s.sent_end = True  # nothing more to send, nothing to reset
        self._wake(s)

    def _on_goaway(self, last: int, code: int) -> None:
        first = self.goaway_id is None
        self.goaway_id = last if self.goaway_id is None else min(self.goaway_id, last)
        for sid, s in self._streams.items():
            if sid > last and not s.ended and s.error is None:
                s.error = RefusedStream(
                    f"stream {sid} not processed: GOAWAY (last stream {last}, error {code})"
                )
                self._pool._refused += 1
                self._wake(s)
        if first:
            # A conformant server answers; hypercorn 0.18, whose h2 state is
            # CLOSED once it has sent GOAWAY (so it can no longer finish the
            # streams it promised), fails on the PING and closes the
            # connection: its streams then end at once with ConnectionLost
            # instead of hanging until a stall timeout.
            self._h2.ping(b"\0goaway\0")
            self._pool._draining(self)
        self.close_if_idle()

    # ------------------------------------------------------------ writing

    async def _flush(self) -> None:
        """Write everything h2 has buffered (the active writer, if any,
        drains our bytes too). What the socket takes at once goes out by
        :func:`write_now` (a write that cannot block has nothing to cut or
        to time: no cancel scope, no ``send_all``; 3.2% of a streamed
        request's instructions); the rest under a shielded scope (a cut
        frame would break the connection) bounded by ``write_timeout``: a
        wedged peer fails it.

        Either way the write is followed by the turn ``send_all`` takes (a
        shielded checkpoint), and that turn is kept: the requests other
        tasks put into h2wire's buffer meanwhile leave with the writer's
        next write. Without it each request was its own write: no cheaper
        for the router, and +0.07 ms of CPU a request for a mock reading
        them (h2load -c 32, three alternated runs)."""
        if self._writing or self.error is not None:
            return
        data = self._h2.data_to_send()
        if not data:
            return
        self._writing = True
        try:
            sent = write_now(self._transport, data)
            if sent == len(data):
                # All taken at once (the usual case): the same turn, without
                # the shielded deadline, which only a blocked write needs.
                await trio.lowlevel.cancel_shielded_checkpoint()
                data = self._h2.data_to_send()
            else:
                data = data[sent:]
            if data:
                deadline = trio.current_time() + self._pool.write_timeout
                with trio.CancelScope(shield=True, deadline=deadline) as scope:
                    while data:
                        await self._transport.send_all(data)
                        data = self._h2.data_to_send()
                if scope.cancelled_caught:
                    self.fail(ConnectionLost, f"write blocked for {self._pool.write_timeout}s")
        except _TRANSPORT_ERRORS as exc:
            self.fail(ConnectionLost, f"connection lost while writing: {exc!r}")
        finally:
            self._writing = False

    def credit(self, s: _Stream) -> bool:
        """The consumer took everything buffered: owe the stream window for
        it; True when a WINDOW_UPDATE was queued (the caller flushes)."""
        s.credit += s.flow_pending
        s.flow_pending = 0
        if s.credit < self._stream_threshold or s.ended or s.error is not None:
            return False
        if not self._h2.window_update(s.credit, s.sid):
            return False  # the stream closed meanwhile
        s.credit = 0
        return True

    # ------------------------------------------------------------ closing

    def unfinished(self, s: _Stream) -> bool:
        """Would releasing ``s`` reset it (so write)?"""
        return self.error is None and not (s.ended and s.sent_end) and s.error is None

    async def release(self, s: _Stream) -> None:
        """The consumer is done with ``s``: reset it if unfinished, free the slot."""
        self._streams.pop(s.sid, None)
        if self.unfinished(s) and self._h2.reset_stream(s.sid, _CANCEL):
            self._pool._cancelled += 1
            await self._flush()
        self._released()

    def release_finished(self, s: _Stream) -> None:
        """:meth:`release` for a stream that is not :meth:`unfinished`: nothing to send."""
        self._streams.pop(s.sid, None)
        self._released()

    def _released(self) -> None:
        if not self._streams:
            self.idle_since = trio.current_time()
        self.close_if_idle()
        self._pool._slots_changed()

    def close_if_idle(self) -> None:
        if self.goaway_id is not None and not self._streams:
            self.fail(ConnectionLost, "connection closed after GOAWAY")

    def fail(self, kind: type[H2Error], message: str) -> None:
        """Mark the connection dead: every unfinished stream gets ``kind``,
        every parked task wakes, the socket closes, the pool forgets it."""
        if self.error is not None:
            return
        self.error = kind(message)
        for s in self._streams.values():
            if not s.ended and s.error is None:
                s.error = kind(message)
            self._wake(s)
        _close_now(self._transport)
        self._pool._forget(self)

    async def aclose(self) -> None:
        """Say GOAWAY (best effort) and close."""
        if self.error is None:
            self._h2.close()
            await self._flush()
        self.fail(PoolClosed, "the pool was closed")


def _close_now(transport: trio.abc.Stream) -> None:
    """Close the socket under ``transport`` without awaiting (so cancellation
    cannot skip it); a task blocked on it gets ClosedResourceError."""
    if isinstance(transport, trio.SSLStream):
        transport = transport.transport_stream
    if isinstance(transport, trio.SocketStream):
        transport.socket.close()


# ---------------------------------------------------------------- one response


class H2Response:
    """One request's stream: ``async with pool.stream(...) as resp``. Leaving
    the block before the end (break, error, cancellation) resets the stream
    (RST_STREAM(CANCEL)) and frees its slot at once; so does :meth:`aclose`
    (which ``aclosing(resp.aiter_bytes())`` calls). ``status`` and the headers
    are known on entry; a non-2xx status is not an error here."""

    http_version = "HTTP/2"

    def __init__(self, pool: H2Pool, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self._pool = pool
        self._request = headers
        self._body = body
        self._conn: H2Connection | None = None
        self._s: _Stream | None = None
        self._headers: dict[str, str] | None = None
        self.status = 0

    # ------------------------------------------------------------ head

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers as received (lower-case names), pseudo-headers included."""
        return self._s.headers if self._s is not None else []

    @property
    def headers(self) -> dict[str, str]:
        """Response headers, lower-case names, repeated values joined by ", "."""
        if self._headers is None:
            self._headers = _header_dict(self.raw_headers)
        return self._headers

    @property
    def buffered_bytes(self) -> int:
        """Bytes received for this stream and not yet taken."""
        return self._s.buffered if self._s is not None else 0

    async def __aenter__(self) -> H2Response:
        conn = await self._pool._acquire()
        try:
            s = conn.open(self._request, self._body)
        except BaseException:
            self._pool._slots_changed()
            raise
        self._conn, self._s = conn, s
        self._pool._opened += 1
        try:
            rest = conn.send_some(s, memoryview(self._body)) if self._body else None
            await conn._flush()
            if rest:
                await conn.send_body(s, rest)
            while s.status is None:
                if s.error is not None:
                    raise s.error
                if s.ended:
                    raise ProtocolError("the stream ended without a response")
                await conn.wait(s)
            if s.error is not None:
                raise s.error
        except BaseException:
            await self.aclose()
            raise
        self._body = b""
        self.status = s.status
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def close_if_finished(self) -> bool:
        """Free a finished stream's slot at once, without awaiting (it has
        nothing to send); False, doing nothing, when :meth:`aclose` (which
        may reset the stream, so write) is needed."""
        conn, s = self._conn, self._s
        if conn is None or s is None:
            return True
        if conn.unfinished(s):
            return False
        self._conn = None
        conn.release_finished(s)
        return True

    async def aclose(self) -> None:
        """End the stream (reset if unfinished) and free its slot; idempotent."""
        conn, s = self._conn, self._s
        if conn is None or s is None:
            return
        self._conn = None
        await conn.release(s)

    # ------------------------------------------------------------ body

    def aiter_bytes(self) -> H2Response:
        """``async for chunk in resp.aiter_bytes()``: everything buffered at
        each step, as one bytes object."""
        return self

    def __aiter__(self) -> H2Response:
        return self

    def ready(self) -> bool:
        """Would :meth:`__anext__` return (or raise) without waiting for the
        peer? (It may still flush a WINDOW_UPDATE, bounded by the pool's
        ``write_timeout``.) A caller timing the peer's silences enters no
        cancel scope for a read that cannot be silent."""
        s = self._s
        return s is None or self._conn is None or bool(s.chunks) or s.ended or s.error is not None

    async def __anext__(self) -> bytes:
        data = await self.next_within(math.inf)  # no deadline: never None
        assert data is not None
        return data

    async def next_within(self, deadline: float) -> bytes | None:
        """The next chunk (everything buffered, as one bytes object: no copy
        when it is one frame), or None if nothing has come by ``deadline``
        (``trio.current_time()``'s clock). For a caller that times the
        peer's silences: where ``move_on_at(deadline)`` around
        :meth:`__anext__` enters a cancel scope for every wait, this enters
        one only where the connection's reader has to wait on the socket
        (a parked consumer's deadline is kept by the reader: see
        :meth:`H2Connection._read_round`)."""
        s, conn = self._s, self._conn
        if s is None:
            raise RuntimeError("use the response inside 'async with pool.stream(...)'")
        chunks = s.chunks
        s.expired = False
        while not chunks:
            if s.ended or conn is None:
                raise StopAsyncIteration
            if s.error is not None:
                raise s.error
            if s.expired:
                s.expired = False
                return None
            s.deadline = deadline
            try:
                await conn.wait(s)
            finally:
                s.deadline = math.inf
        s.expired = False
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if conn is not None and conn.credit(s):
            await conn._flush()
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The body (its first ``limit`` bytes when given; the rest is dropped)."""
        parts: list[bytes] = []
        total = 0
        async for chunk in self:
            parts.append(chunk)
            total += len(chunk)
            if limit is not None and total >= limit:
                break
        body = b"".join(parts)
        return body if limit is None else body[:limit]


def _header_dict(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in raw:
        if name[:1] == b":":
            continue
        key, text = name.decode("latin-1"), value.decode("latin-1")
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out


def _encode(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


def _header_list(headers: Headers) -> list[tuple[bytes, bytes]]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [(_encode(k).lower(), _encode(v)) for k, v in items]


# ---------------------------------------------------------------- the pool


class _Connecting:
    """A connection being opened; requests that need it wait on ``done``."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: ConnectError | None = None


class H2Pool:
    """HTTP/2 connections to one server. ``ssl_context=None``: cleartext with
    prior knowledge; otherwise TLS, and ALPN must pick h2 (the context's ALPN
    list is set to h2, http/1.1), else :class:`H2Unsupported`. A new connection
    opens when every open one is at the server's SETTINGS_MAX_CONCURRENT_STREAMS,
    up to ``max_connections`` (draining ones not counted); beyond that a request
    waits up to ``pool_timeout`` (default ``connect_timeout``). Connections idle
    for ``idle_timeout`` are closed instead of reused. Use as ``async with`` or
    call :meth:`aclose`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        authority: str | None = None,
        headers: Headers = (),
        connect_timeout: float = 5.0,
        pool_timeout: float | None = None,
        write_timeout: float = 10.0,
        idle_timeout: float = 30.0,
        max_connections: int = 10,
        stream_window: int = 256 << 10,
        connection_window: int = 1 << 24,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not 65535 <= stream_window <= _LAST_STREAM_ID:
            raise ValueError("stream_window must be in [65535, 2**31-1]")
        if not stream_window <= connection_window <= _LAST_STREAM_ID:
            raise ValueError("connection_window must be in [stream_window, 2**31-1]")
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        if ssl_context is not None:
            ssl_context.set_alpn_protocols(["h2", "http/1.1"])
        self.server_hostname = server_hostname or host
        self.connect_timeout = connect_timeout
        self.pool_timeout = connect_timeout if pool_timeout is None else pool_timeout
        self.write_timeout = write_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.stream_window, self.connection_window = stream_window, connection_window
        netloc = f"[{host}]" if ":" in host else host
        self._prefix = [
            (b":scheme", b"https" if ssl_context is not None else b"http"),
            (b":authority", _encode(authority or f"{netloc}:{port}")),
        ]
        self._default_headers = _header_list(headers)
        self._conns: list[H2Connection] = []  # taking new streams
        self._draining_conns: list[H2Connection] = []  # GOAWAY received
        self._connecting: _Connecting | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False
        self._connections_opened = self._opened = self._cancelled = self._refused = 0

    # ------------------------------------------------------------ public

    def stream(
        self, method: str, path: str, *, headers: Headers = (), body: bytes = b""
    ) -> H2Response:
        """``async with pool.stream("POST", "/v1/completions", body=b"...") as resp``."""
        request = [(b":method", method.encode()), *self._prefix, (b":path", path.encode())]
        request += self._default_headers
        if headers:
            request += _header_list(headers)
        if body:
            request.append((b"content-length", str(len(body)).encode()))
        return H2Response(self, request, body)

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Headers = (),
        body: bytes = b"",
        limit: int = 1 << 20,
    ) -> H2Reply:
        """One whole request (health probes, /v1/models); the body is cut at ``limit``."""
        async with self.stream(method, path, headers=headers, body=body) as resp:
            data = await resp.read(limit)
            return H2Reply(resp.status, resp.headers, data)

    def statistics(self) -> H2PoolStatistics:
        return H2PoolStatistics(
            connections=tuple(c.statistics() for c in (*self._conns, *self._draining_conns)),
            connections_opened=self._connections_opened,
            streams_opened=self._opened,
            streams_cancelled=self._cancelled,
            streams_refused=self._refused,
        )

    async def aclose(self) -> None:
        """Close every connection; requests in flight fail with PoolClosed."""
        self._closed = True
        for conn in (*self._conns, *self._draining_conns):
            await conn.aclose()
        self._lot.unpark_all()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> H2Pool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ connections

    async def _acquire(self) -> H2Connection:
        """A connection with a free stream slot; the caller opens its stream
        before its next checkpoint (see :meth:`H2Connection.open`)."""
        return self._pick() or await self._acquire_slow()

    def _pick(self) -> H2Connection | None:
        for conn in self._conns:
            if conn.available():
                if not conn._streams and trio.current_time() - conn.idle_since > self.idle_timeout:
                    conn.fail(ConnectionLost, "closed after idling")
                    return self._pick()
                return conn
        return None

    async def _acquire_slow(self) -> H2Connection:
        deadline = trio.current_time() + self.pool_timeout
        while True:
            if self._closed:
                raise PoolClosed("the pool is closed")
            conn = self._pick()
            if conn is not None:
                return conn
            attempt = self._connecting
            if attempt is None and len(self._conns) < self.max_connections:
                return await self._connect()
            if attempt is not None:
                await attempt.done.wait()
                if attempt.error is not None:
                    raise type(attempt.error)(*attempt.error.args) from attempt.error
                continue
            with trio.move_on_at(deadline):
                await self._lot.park()
                continue
            raise PoolTimeout(
                f"all {len(self._conns)} connections to {self.host}:{self.port} stayed full "
                f"for {self.pool_timeout}s"
            )

    async def _connect(self) -> H2Connection:
        attempt = self._connecting = _Connecting()
        try:
            conn = await self._open_connection()
        except ConnectError as exc:
            attempt.error = exc
            raise
        finally:
            self._connecting = None
            attempt.done.set()
        if self._closed:
            await conn.aclose()
            raise PoolClosed("the pool is closed")
        self._connections_opened += 1
        self._conns.append(conn)
        self._lot.unpark_all()
        return conn

    async def _open_connection(self) -> H2Connection:
        where = f"{self.host}:{self.port}"
        transport: trio.abc.Stream | None = None
        try:
            with trio.fail_after(self.connect_timeout):
                transport = await trio.open_tcp_stream(self.host, self.port)
                if self.ssl_context is not None:
                    transport = await self._tls(transport)
                conn = H2Connection(self, transport)
                await conn.start()
                return conn
        except trio.TooSlowError:
            error: ConnectError = ConnectError(
                f"no HTTP/2 connection to {where} within {self.connect_timeout}s"
            )
        except ConnectError as exc:
            error = exc
        except H2Error as exc:
            error = ConnectError(f"HTTP/2 handshake with {where} failed: {exc}")
        except (*_TRANSPORT_ERRORS, ssl.SSLError) as exc:
            error = ConnectError(f"cannot connect to {where}: {exc!r}")
        except BaseException:  # cancelled: still close the socket
            if transport is not None:
                _close_now(transport)
            raise
        if transport is not None:
            _close_now(transport)
        raise error

    async def _tls(self, tcp: trio.SocketStream) -> trio.SSLStream[trio.SocketStream]:
        """TLS over ``tcp`` with h2 by ALPN; on failure the caller closes ``tcp``."""
        assert self.ssl_context is not None
        stream = trio.SSLStream(
            tcp, self.ssl_context, server_hostname=self.server_hostname, https_compatible=True
        )
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            raise ConnectError(
                f"TLS handshake with {self.host}:{self.port} failed: {exc.__cause__!r}"
            ) from None
        if stream.selected_alpn_protocol() != "h2":
            raise H2Unsupported(
                f"{self.host}:{self.port} chose {stream.selected_alpn_protocol()!r} by ALPN, not h2"
            )
        return stream

    def _slots_changed(self) -> None:
        if self._lot:
            self._lot.unpark()

    def _draining(self, conn: H2Connection) -> None:
        if conn in self._conns:
            self._conns.remove(conn)
            self._draining_conns.append(conn)
        self._lot.unpark_all()

    def _forget(self, conn: H2Connection) -> None:
        for group in (self._conns, self._draining_conns):
            if conn in group:
                group.remove(conn)
        self._lot.unpark_all()


def write_now(stream: object, data: bytes) -> int:
    """How much of ``data`` a plain TCP stream's socket takes without
    blocking (0: none, or not a plain socket: TLS frames its own writes).
    ``os.write`` on the socket's descriptor: trio's ``send_all`` would take
    the same bytes, then checkpoint. Errors are left to the ``send_all`` the
    caller hands the rest to. The caller must be the connection's only
    writer at that moment (its send lock free, no checkpoint since), or
    bytes would interleave. (The ingress's immediate writes too,
    frontend/hardening.py.)"""
    if type(stream) is not trio.SocketStream:
        return 0
    try:
        return os.write(stream.socket.fileno(), data)
    except OSError:
        return 0


_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.ENOTSOCK})  # trio's: the socket was closed here


def read_now(stream: object, max_bytes: int) -> bytes | None:
    """What a plain TCP stream's socket holds, read without waiting (EOF:
    ``b""``); None when it holds nothing yet, or for any other stream (TLS
    frames its own reads). Errors are left to the read that follows. The
    caller must be the stream's only reader."""
    if type(stream) is not trio.SocketStream:
        return None
    try:
        return os.read(stream.socket.fileno(), max_bytes)
    except OSError:  # BlockingIOError: nothing yet; anything else: read_some says it
        return None


async def read_some(stream: trio.abc.ReceiveStream, max_bytes: int, *, wait_first: bool = False) -> bytes:
    """``stream.receive_some(max_bytes)``: for a plain TCP stream, the same
    read, checkpoints and errors without trio's layers around it (a context
    manager for the errors, a conflict detector, the socket wrapper's
    helpers: ~2% of a streamed request's instructions for the router's two
    reads a request). The caller must be the stream's only reader.
    ``wait_first``: the caller has just found the socket empty
    (:func:`read_now`): wait for it before reading."""
    if type(stream) is not trio.SocketStream:
        data = await stream.receive_some(max_bytes)
        return data if type(data) is bytes else bytes(data)
    sock = stream.socket
    try:
        if not wait_first:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                data = os.read(sock.fileno(), max_bytes)
            except BlockingIOError:
                pass
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()  # as trio's: a read is a checkpoint
                return data
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                return os.read(sock.fileno(), max_bytes)
            except BlockingIOError:
                pass
    except OSError as exc:
        if exc.errno in _CLOSED_ERRNOS:
            raise trio.ClosedResourceError("this socket was already closed") from None
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

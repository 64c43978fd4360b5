"""One actor per backend: a supervised service that owns the backend's state.

A :class:`BackendActor` owns everything the router knows about one backend:
its client (a :class:`~backends.base.Backend`), its health (one
:class:`~router.health.BackendHealth`), whether an operator drained it, its
in-flight count and its counters. Its task tree is the health prober; request
streams run in the request's own task and pass through
:meth:`BackendActor.stream`, which counts them. Everything runs on one Trio
thread, so there are no locks.

Health has one state, moved only by the table in :mod:`router.health`, and
three sources feed it::

    prober (run)  ── probe() ──── PROBE_OK / PROBE_FAILED ─────────────┐
    request task  ── stream() ─── REQUEST_OK / REQUEST_FAILED_EARLY ───┤
                                  / REQUEST_FAILED_LATE                ├─> BackendHealth.handle
    dispatcher    ── breaker_moved() ── EJECT / COOLED / RECOVERED ────┤     (TRANSITIONS)
    supervisor    ── crashed() ── CRASHED        aclose() ── CLOSE ────┘

The circuit breaker's counting and timing stay in its policy
(policies/breaker.py, owned by the dispatcher); every transition of it
reaches this state, so routing, admission, /admin/backends and /metrics
read one answer.

Entering SUSPECT (a failed request or a failed probe below the threshold), or
any failed request, wakes the prober to probe at once.

With a ``kv_sink`` (a policy that indexes engine caches,
:class:`policies.base.KVEventSink`), an actor whose backend publishes KV
events also runs a subscriber beside its prober, in the same nursery::

    subscriber ── backend.kv_events(kv_since(name)) ── pump ─> channel ─> batches of what is ready
               ── on_kv_events(name, batch, now) ── False (a gap) ──> resubscribe from kv_since (-1)
               stream error ── backoff (doubling, capped) ──> resubscribe from kv_since (resume)
               garbage      ── on_kv_reset once per burst, one log line ──> backoff, resubscribe
    health DOWN / CLOSED ── cancel the subscription, on_kv_reset(name)
    a new kv_epoch in /v1/models (a restart between probes) ── the same

The subscriber never raises into the actor: a failing stream or sink is
logged, reset and retried, and the prober goes on probing.

An actor is a :class:`~router.services.Service`: the
:class:`~router.services.Supervisor` (re-exported here) starts it, counts it
started after its first probe, and restarts it with backoff if its task
crashes (``crashed`` marks it down meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, Protocol, TypeVar, cast

import msgspec
import trio

from backends.base import Backend, BackendInfo, Event, GenerateRequest, KVEvent, close_stream
from backends.errors import (
    BackendProtocolError,
    BackendUnavailable,
    HeadraceError,
    StreamBroken,
    UpstreamError,
    UpstreamRateLimited,
    drop_tracebacks,
)
from policies.base import BackendView, KVEventSink
from policies.concurrency import AIMDLimit, ConcurrencyStatistics
from router.health import BackendHealth, HealthEvent, HealthState, HealthStatistics
from router.services import Supervisor

__all__ = ["ActorStatistics", "BackendActor", "StreamTicket", "Supervisor", "closing_stream"]

log = logging.getLogger(__name__)

T = TypeVar("T")
KV_BATCH = 256  # events handed to the sink at once, at most
KV_BUFFER = 4096  # events read ahead of the sink (the pump waits beyond this)


class _KVSource(Protocol):
    def kv_events(self, since: int) -> AsyncIterator[KVEvent]: ...


class ActorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    state: str
    draining: bool
    in_flight: int
    weight: float
    models: tuple[str, ...]
    requests: int  # streams started
    failures: int  # streams ended by an upstream error
    cancelled: int  # streams abandoned by the client
    tokens: int  # tokens relayed
    probes: int
    probe_failures: int
    restarts: int  # times the supervisor restarted this actor after a crash
    detail: str  # the last probe's detail
    up: bool  # up or suspect: takes requests unless draining
    health: HealthStatistics
    pending_prefill_tokens: int  # prompt tokens of streams not yet at their first event
    kv_events: int  # KV events handed to the sink
    kv_subscriptions: int  # KV event streams opened
    kv_errors: int  # KV event streams that failed (cut, refused or garbled)
    concurrency: ConcurrencyStatistics | None = None  # the limit learned from its 429s (None: not learned)
    limit: int = 0  # streams at once it is given (learned, or its max_concurrency)


class BackendActor:
    """Owns one backend: client, health, drain flag, load, counters."""

    def __init__(
        self,
        name: str,
        backend: Backend,
        *,
        weight: float = 1.0,
        probe_interval: float = 2.0,
        probe_timeout: float = 2.0,
        unhealthy_threshold: int = 2,
        kv_sink: KVEventSink | None = None,
        kv_backoff: float = 0.1,
        kv_backoff_max: float = 5.0,
        max_concurrency: int = 64,
        learn_concurrency: bool = True,
        concurrency_backoff: float = 0.5,
    ) -> None:
        """``kv_sink``: the policy to feed this backend's KV events to, if
        it publishes them; a stream that fails is reopened after ``kv_backoff``
        seconds, doubling up to ``kv_backoff_max``. ``max_concurrency``: the
        most streams it is given at once; with ``learn_concurrency`` its 429s
        lower that (AIMD, policies/concurrency.py) and answers raise it back."""
        self.name = name
        self.max_concurrency = max_concurrency
        self.concurrency = AIMDLimit(max_concurrency, backoff=concurrency_backoff) if learn_concurrency else None
        # The threshold of consecutive failed probes that take an up backend
        # down lives in the health machine (router.health).
        self.health = BackendHealth(unhealthy_threshold)
        self.backend = backend
        self.weight = weight
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.draining = False
        self.in_flight = 0
        self._idle: trio.Event | None = None  # set when in_flight drops to 0, while wait_idle waits
        self.info: BackendInfo | None = None
        self._wake = trio.Event()
        # Probe and failure counts are not kept here: statistics() derives
        # them from the events the health machine counted.
        self._counts = dict.fromkeys(("requests", "cancelled", "tokens", "restarts"), 0)
        # When the backend last answered (a probe or a request that went well),
        # on trio's clock: a stream that failed here may come back once it has.
        self.ok_at = -math.inf
        self._detail = ""
        self.pending_prefill_tokens = 0
        self.kv_sink = kv_sink
        self.kv_backoff, self.kv_backoff_max = kv_backoff, kv_backoff_max
        self._kv_counts = dict.fromkeys(("kv_events", "kv_subscriptions", "kv_errors"), 0)
        self._kv_scope: trio.CancelScope | None = None  # the open subscription
        self._kv_fed = False  # the sink holds events of ours since its last reset
        self._kv_burst = False  # garbage seen, and no good batch since
        self._kv_delivered = False  # the current subscription got a batch to the sink
        self._changed = trio.Event()  # set (and replaced) on each probe and state change
        self._view: BackendView | None = None  # the last view() and what it was built from
        self._view_key: tuple[object, ...] = ()

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe once, report started, then probe every ``probe_interval``
        (at once when a request fails, the backend turns suspect, or
        :meth:`suspect` is called); with a ``kv_sink``, subscribe to the
        backend's KV events beside."""
        await self.probe()
        task_status.started()
        async with trio.open_nursery() as nursery:
            if self.kv_sink is not None:
                nursery.start_soon(self._kv_subscriber, self.kv_sink)
            while not self.closed:
                with trio.move_on_after(self.probe_interval):
                    await self._wake.wait()
                self._wake = trio.Event()
                if not self.closed:
                    await self.probe()
            nursery.cancel_scope.cancel()

    @property
    def state(self) -> HealthState:
        return self.health.state

    @property
    def unhealthy_threshold(self) -> int:
        return self.health.unhealthy_threshold

    @property
    def closed(self) -> bool:
        return self.state is HealthState.CLOSED

    async def probe(self) -> None:
        ok, detail = False, "probe timed out"
        with trio.move_on_after(self.probe_timeout):
            try:
                health = await self.backend.health()
                ok, detail = health.ok, health.detail
                if ok:
                    await self._refresh_info()
            except HeadraceError as exc:
                ok, detail = False, exc.message
            except Exception:
                if not self.closed:
                    raise  # an adapter bug: the supervisor restarts the actor
                return  # the backend was closed under the probe (httpx: "the client has been closed")
        if self.closed:
            return  # closed while the probe ran: its result no longer matters
        self._detail = detail
        self._apply(HealthEvent.PROBE_OK if ok else HealthEvent.PROBE_FAILED)
        self._notify()  # the info may say something new about KV events
        if self.state is HealthState.SUSPECT:  # a failed probe below the threshold
            log.warning("backend %s: probe failed (%s), %d of %d before down", self.name, detail,
                        self.health.failed_probes, self.unhealthy_threshold)
            self._wake.set()  # probe again now rather than after a full interval

    async def _refresh_info(self) -> None:
        """Re-read the backend's models (adapters over HTTP fetch them in
        ``refresh()``; in-process ones answer ``info()`` directly)."""
        refresh: Callable[[], Awaitable[BackendInfo]] | None = getattr(self.backend, "refresh", None)
        before = self.info
        self.info = await refresh() if refresh is not None else self.backend.info()
        if before is not None and before.kv_epoch != self.info.kv_epoch and before.kv_epoch is not None:
            # A new run of the backend (it restarted between two probes): its
            # event numbers began again, so what the sink indexed is stale.
            log.info("backend %s: KV event epoch changed (%s -> %s): resubscribing from the start",
                     self.name, before.kv_epoch, self.info.kv_epoch)
            self._kv_lost()

    def _apply(self, event: HealthEvent) -> None:
        """Feed ``event`` to the health machine, the one place that moves the state."""
        if event is HealthEvent.PROBE_OK or event is HealthEvent.REQUEST_OK:
            self.ok_at = trio.current_time()
        before = self.state
        after = self.health.handle(event)
        if after is not before:
            log.info("backend %s: %s -> %s (%s)", self.name, before.value, after.value, self._detail)
            if after in (HealthState.DOWN, HealthState.CLOSED):
                self._kv_lost()
            self._notify()

    def report(self, event: HealthEvent) -> None:
        """A request outcome (``REQUEST_*``): into the health machine; a
        failure makes the prober probe at once, whatever the state."""
        self._apply(event)
        if event is not HealthEvent.REQUEST_OK and not self.closed:
            self._wake.set()

    def breaker_moved(self, event: HealthEvent) -> None:
        """The dispatcher relays one of the breaker's transitions (EJECT,
        COOLED, RECOVERED) into the health machine."""
        self._apply(event)

    def suspect(self) -> None:
        """Probe now. :meth:`stream` already reports every outcome to the
        health machine, so callers need not call this after a failure."""
        self._wake.set()

    def crashed(self, exc: BaseException) -> None:
        """Called by the supervisor: the actor's task died with ``exc``."""
        self._counts["restarts"] += 1
        self._detail = f"actor crashed: {exc!r}"
        if not self.closed:
            self._apply(HealthEvent.CRASHED)

    async def aclose(self) -> None:
        if self.closed:
            return
        self._apply(HealthEvent.CLOSE)
        self._wake.set()
        await self.backend.aclose()

    def drain(self) -> None:
        """Take no new requests; streams in flight finish."""
        self.draining = True

    def undrain(self) -> None:
        self.draining = False

    async def wait_idle(self) -> None:
        """Until no stream of this backend is in flight (a drained backend's removal waits here)."""
        while self.in_flight:
            self._idle = trio.Event()
            await self._idle.wait()
        self._idle = None

    # ------------------------------------------------------------ requests

    @property
    def models(self) -> tuple[str, ...]:
        return self.info.models if self.info is not None else ()

    def eligible(self, model: str | None) -> bool:
        """Up (or suspect), not draining, and serving ``model`` (``None``: any)."""
        if not self.state.serving or self.draining:
            return False
        return model is None or not self.models or model in self.models

    def view(self) -> BackendView:
        """The policies' snapshot of this backend. A pick takes one of every
        candidate and a dispatch changes one backend, so the last snapshot is
        kept and reused while nothing it shows has changed (building one, its
        frozenset of models included, costs ~1 us: 64 backends, 64 us a pick)."""
        info = self.info
        key = (self.in_flight, self.pending_prefill_tokens, self.health.state, self.draining, self.weight, info)
        if key == self._view_key:
            return self._view  # type: ignore[return-value]
        self._view_key = key
        view = self._view = BackendView(
            name=self.name,
            in_flight=self.in_flight,
            healthy=self.state.serving,
            draining=self.draining,
            weight=self.weight,
            models=frozenset(self.models),
            pending_prefill_tokens=self.pending_prefill_tokens,
            kv_events=info is not None and info.kv_events,
            block_size=info.block_size if info is not None else None,
            cache_blocks=info.kv_capacity_blocks if info is not None else None,
            prefix_sharing=info is not None and info.prefix_sharing,
        )
        return view

    @property
    def limit(self) -> int:
        """Streams at once this backend is given: learned from its 429s, at
        most its ``max_concurrency``."""
        return self.concurrency.limit if self.concurrency is not None else self.max_concurrency

    @property
    def watches_stalls(self) -> bool:
        """Does the backend time its own stream's silences when given a
        ``stall_timeout`` (the HTTP adapter does), so the dispatcher need not?"""
        return bool(getattr(self.backend, "watches_stalls", False))

    async def stream(self, request: GenerateRequest, prompt_tokens: int = 0, stall_timeout: float | None = None) -> AsyncIterator[Event]:
        """The backend's stream, counted: in-flight drops the moment the
        consumer stops (finish, error, cancel or close), and ``prompt_tokens``
        count as pending prefill until the first event (or that moment).
        Every outcome goes to the health machine: done (or a client error,
        which the backend answered) is REQUEST_OK; an upstream error is
        REQUEST_FAILED_EARLY or _LATE by whether an event was relayed. A
        cancel is the client's doing and says nothing about the backend.
        ``stall_timeout`` goes to a backend that :attr:`watches_stalls`.

        The dispatcher does the same without this wrapper (one generator
        less for every event): :meth:`open`, and a :class:`StreamTicket`."""
        ticket = self.open(request, prompt_tokens, stall_timeout)
        async with ticket as events:
            while True:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    ticket.done()
                    return
                except BaseException as exc:
                    raise ticket.failed(exc)  # noqa: B904 (failed() chains a translated error to exc)
                ticket.event(event)
                yield event

    def open(self, request: GenerateRequest, prompt_tokens: int = 0, stall_timeout: float | None = None) -> StreamTicket:
        """The backend's stream, to be iterated by the caller inside ``async
        with ticket as events`` and each of its events and its end told to
        the ticket (:class:`StreamTicket`); counted in flight from now."""
        ticket = StreamTicket(self, prompt_tokens)
        try:  # an adapter may refuse the request before its stream starts (a BadRequest)
            if stall_timeout is None:
                ticket.events = self.backend.stream(request)
            else:
                ticket.events = self.backend.stream(request, stall_timeout=stall_timeout)  # type: ignore[call-arg]
        except BaseException as exc:
            error = ticket.failed(exc)
            ticket._close()
            raise error  # noqa: B904 (failed() chains a translated error to exc)
        return ticket

    def stalled(self) -> None:
        """The dispatcher's watchdog gave up on a stream of this backend (it
        saw the cancel, not a failure): a late failure for its health."""
        self._failed(True)

    def _failed(self, relayed: bool) -> None:
        self.report(HealthEvent.REQUEST_FAILED_LATE if relayed else HealthEvent.REQUEST_FAILED_EARLY)

    def statistics(self) -> ActorStatistics:
        health = self.health.statistics()
        events = health.events
        failed_probes = events["probe_failed"] + events["probe_threshold"]
        return ActorStatistics(
            name=self.name,
            state=self.state.value,
            draining=self.draining,
            in_flight=self.in_flight,
            weight=self.weight,
            models=self.models,
            detail=self._detail,
            up=self.state.serving,
            health=health,
            probes=events["probe_ok"] + failed_probes,
            probe_failures=failed_probes,
            failures=events["request_failed_early"] + events["request_failed_late"],
            pending_prefill_tokens=self.pending_prefill_tokens,
            concurrency=self.concurrency.statistics() if self.concurrency is not None else None,
            limit=self.limit,
            **self._counts,
            **self._kv_counts,
        )

    # ------------------------------------------------------------ KV events

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _kv_source(self) -> _KVSource | None:
        """The backend, when it serves KV events now (up, and its info says so)."""
        info = self.info
        if not self.state.serving or info is None or not info.kv_events:
            return None
        return cast(_KVSource, self.backend) if callable(getattr(self.backend, "kv_events", None)) else None

    def _kv_lost(self) -> None:
        """Down or closed: drop the subscription and what the sink holds of ours."""
        if self._kv_scope is not None:
            self._kv_scope.cancel()
        if self._kv_fed and self.kv_sink is not None:
            self._kv_fed = False
            self._kv_reset(self.kv_sink)

    def _kv_reset(self, sink: KVEventSink) -> None:
        try:
            sink.on_kv_reset(self.name)
        except Exception:
            log.exception("backend %s: the KV event sink failed to reset", self.name)

    async def _kv_subscriber(self, sink: KVEventSink) -> None:
        """Subscribe while the backend serves KV events. After a gap, resubscribe
        at once (a second gap in a row backs off); after a failure, back off,
        doubling from ``kv_backoff`` to ``kv_backoff_max`` while nothing good
        arrives. Never raises (but Cancelled): the prober beside it goes on."""
        failures = 0
        while not self.closed:
            source = self._kv_source()
            if source is None:
                await self._changed.wait()
                continue
            self._kv_delivered = False
            gap = False
            with trio.CancelScope() as scope:
                self._kv_scope = scope
                try:
                    error = await self._kv_session(sink, source)
                finally:
                    self._kv_scope = None
                if error is None:
                    gap = True
                elif isinstance(error, HeadraceError) and not isinstance(error, BackendProtocolError):
                    self._kv_counts["kv_errors"] += 1
                    first = failures == 0 or self._kv_delivered  # the first in a row is worth a line
                    log.log(logging.INFO if first else logging.DEBUG,
                            "backend %s: KV event stream failed (%s); resubscribing", self.name, error.message)
                else:  # garbage, or a bug in the adapter or the sink: not a crash
                    self._kv_garbage(sink, error)
            if scope.cancelled_caught:  # the backend went down: wait until it serves again
                failures = 0
                continue
            failures = 1 if self._kv_delivered else failures + 1
            if not (gap and failures == 1):
                await trio.sleep(min(self.kv_backoff * 2 ** (failures - 1), self.kv_backoff_max))

    async def _kv_session(self, sink: KVEventSink, source: _KVSource) -> BaseException | None:
        """One subscription, from ``kv_since``: returns None when the sink
        reports a gap, or the error that ended the stream. A pump reads ahead
        into a channel, so each batch is everything that has arrived."""
        self._kv_counts["kv_subscriptions"] += 1
        since = sink.kv_since(self.name)
        send, receive = trio.open_memory_channel[KVEvent | BaseException](KV_BUFFER)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._kv_pump, source, since, send)
            error = await self._kv_deliver(sink, receive)
            nursery.cancel_scope.cancel()
            receive.close()
        return error

    async def _kv_deliver(
        self, sink: KVEventSink, receive: trio.MemoryReceiveChannel[KVEvent | BaseException]
    ) -> BaseException | None:
        while True:
            batch = [await receive.receive()]
            while len(batch) < KV_BATCH and not isinstance(batch[-1], BaseException):
                try:
                    batch.append(receive.receive_nowait())
                except trio.WouldBlock:
                    break
            last = batch[-1]
            end = last if isinstance(last, BaseException) else None
            events = [e for e in batch if isinstance(e, KVEvent)]
            if events:
                self._kv_fed = True
                self._kv_counts["kv_events"] += len(events)
                try:
                    if not sink.on_kv_events(self.name, events, trio.current_time()):
                        return None
                except Exception as exc:
                    return exc
                self._kv_delivered = True
                self._kv_burst = False
            if end is not None:
                return end

    async def _kv_pump(
        self, source: _KVSource, since: int, send: trio.MemorySendChannel[KVEvent | BaseException]
    ) -> None:
        """Read the stream into ``send``; how it ended goes down the channel
        too, as an exception, so the reader sees it after the events before it."""
        async with send:
            try:
                async with closing_stream(source.kv_events(since)) as events:
                    async for event in events:
                        try:
                            send.send_nowait(event)
                        except trio.WouldBlock:
                            await send.send(event)
                end: Exception = StreamBroken("the KV event stream ended")
            except Exception as exc:
                end = exc
                drop_tracebacks(exc)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await send.send(end)

    def _kv_garbage(self, sink: KVEventSink, exc: BaseException) -> None:
        """Garbage from the stream (or a bug): the sink's index of this backend
        is suspect. Reset it and log once per burst, not once per attempt."""
        self._kv_counts["kv_errors"] += 1
        if self._kv_burst:
            log.debug("backend %s: KV event stream garbled again: %r", self.name, exc)
            return
        self._kv_burst = True
        log.warning("backend %s: KV event stream garbled (%s); index dropped, resubscribing",
                    self.name, exc.message if isinstance(exc, HeadraceError) else repr(exc))
        self._kv_fed = False
        self._kv_reset(sink)


class closing_stream(Generic[T]):
    """``async with closing_stream(events) as events``: close an async
    generator when the block exits, however it exits, shielded from
    cancellation (so the backend hears of it). A class, not an
    ``asynccontextmanager``: it is entered once per stream per layer."""

    __slots__ = ("it",)

    def __init__(self, it: AsyncIterator[T]) -> None:
        self.it = it

    async def __aenter__(self) -> AsyncIterator[T]:
        return self.it

    async def __aexit__(self, *exc: object) -> None:
        await close_stream(self.it)


class StreamTicket:
    """One stream of an actor's, counted without wrapping it (from
    :meth:`BackendActor.open`): in flight, its prompt as pending prefill,
    from when it is made; told each :meth:`event`, then how the stream
    ended (:meth:`done`: the backend's stream ran out; :meth:`failed`: its
    next event raised). ``async with ticket as events`` closes the stream
    and then the ticket, however the block ends: a stream closed with
    neither was left by its consumer (cancelled).
    :meth:`BackendActor.stream` is this around the backend's stream; the
    dispatcher iterates the stream itself."""

    __slots__ = ("actor", "ended", "events", "pending", "relayed", "sent_at")

    def __init__(self, actor: BackendActor, prompt_tokens: int = 0) -> None:
        self.actor = actor
        self.events: AsyncIterator[Event]  # the backend's stream: set by BackendActor.open
        actor.in_flight += 1
        actor._counts["requests"] += 1
        actor.pending_prefill_tokens += prompt_tokens
        self.pending = prompt_tokens
        self.relayed = False
        self.ended = False
        self.sent_at = trio.current_time()

    async def __aenter__(self) -> AsyncIterator[Event]:
        return self.events

    async def __aexit__(self, *exc: object) -> None:
        try:
            await close_stream(self.events)
        finally:
            self._close()

    def event(self, event: Event) -> None:
        actor = self.actor
        actor._counts["tokens"] += len(event.token_ids)
        if not self.relayed:
            self.relayed = True
            actor.pending_prefill_tokens -= self.pending
            self.pending = 0

    def done(self) -> None:
        """The stream ran to its end: the backend answered."""
        self.ended = True
        actor = self.actor
        actor.report(HealthEvent.REQUEST_OK)
        if actor.concurrency is not None:
            actor.concurrency.on_success(actor.in_flight, trio.current_time())

    def failed(self, exc: BaseException) -> BaseException:
        """The stream's next event raised ``exc``: told to the health
        machine by what it says of the backend. Returns what to raise:
        ``exc``, or for an error an adapter let through untranslated, an
        upstream error (StreamBroken after an event, else
        BackendUnavailable) caused by it."""
        self.ended = True
        actor = self.actor
        if isinstance(exc, UpstreamRateLimited):
            # A 429 is an answer, not a failure: the backend is alive and
            # says when to come back (the dispatcher cools it down that long),
            # and that it has less room than we gave it.
            actor.report(HealthEvent.REQUEST_OK)
            if actor.concurrency is not None and actor.concurrency.on_rate_limited(self.sent_at, trio.current_time()):
                log.info("backend %s answered 429: its concurrency limit is now %d", actor.name, actor.limit)
        elif isinstance(exc, UpstreamError):
            actor._failed(self.relayed)
        elif isinstance(exc, HeadraceError):
            actor.report(HealthEvent.REQUEST_OK)
        elif isinstance(exc, Exception):
            # An adapter let an error through untranslated: to the router it
            # is an upstream failure like any other (retried before the first
            # token, an in-band error after it), never a silent end.
            actor._failed(self.relayed)
            log.error("backend %s: untranslated error from the adapter", actor.name, exc_info=exc)
            error = StreamBroken if self.relayed else BackendUnavailable
            translated = error(f"backend {actor.name} failed: {type(exc).__name__}: {exc}")
            translated.__cause__ = exc
            return translated
        elif isinstance(exc, (trio.Cancelled, GeneratorExit)):
            actor._counts["cancelled"] += 1
        return exc

    def _close(self) -> None:
        if not self.ended:  # its consumer left (GeneratorExit, a cancel outside the read)
            self.ended = True
            self.actor._counts["cancelled"] += 1
        actor = self.actor
        actor.in_flight -= 1
        actor.pending_prefill_tokens -= self.pending
        self.pending = 0
        if actor.in_flight == 0 and actor._idle is not None:
            actor._idle.set()

"""One actor per backend: a supervised service that owns the backend's state.

A :class:`BackendActor` owns everything the router knows about one backend:
its client (a :class:`~backends.base.Backend`), its health (one
:class:`~router.health.BackendHealth`), whether an operator drained it, its
in-flight count and its counters. Its task tree is the health prober; request
streams run in the request's own task and pass through
:meth:`BackendActor.stream`, which counts them. Everything runs on one Trio
thread, so there are no locks.

Health has one state, moved only by the table in :mod:`router.health`, and two
sources feed it::

    prober (run)  ── probe() ──── PROBE_OK / PROBE_FAILED ─────────────┐
    request task  ── stream() ─── REQUEST_OK / REQUEST_FAILED_EARLY ───┼─> BackendHealth.handle
                                  / REQUEST_FAILED_LATE                │     (TRANSITIONS)
    supervisor    ── crashed() ── CRASHED        aclose() ── CLOSE ────┘

Entering SUSPECT (a failed request or a failed probe below the threshold), or
any failed request, wakes the prober to probe at once.

An actor is a :class:`~router.services.Service`: the
:class:`~router.services.Supervisor` (re-exported here) starts it, counts it
started after its first probe, and restarts it with backoff if its task
crashes (``crashed`` marks it down meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import trio

from backends.base import Backend, BackendInfo, Event, GenerateRequest
from backends.errors import BackendUnavailable, HeadraceError, StreamBroken, UpstreamError
from policies.base import BackendView
from router.health import BackendHealth, HealthEvent, HealthState, HealthStatistics
from router.services import Supervisor

__all__ = ["ActorStatistics", "BackendActor", "Supervisor", "closing_stream"]

log = logging.getLogger(__name__)


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
    ) -> None:
        self.name = name
        # The threshold of consecutive failed probes that take an up backend
        # down lives in the health machine (router.health).
        self.health = BackendHealth(unhealthy_threshold)
        self.backend = backend
        self.weight = weight
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.draining = False
        self.in_flight = 0
        self.info: BackendInfo | None = None
        self._wake = trio.Event()
        # Probe and failure counts are not kept here: statistics() derives
        # them from the events the health machine counted.
        self._counts = dict.fromkeys(("requests", "cancelled", "tokens", "restarts"), 0)
        self._detail = ""

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe once, report started, then probe every ``probe_interval``
        (at once when a request fails, the backend turns suspect, or
        :meth:`suspect` is called)."""
        await self.probe()
        task_status.started()
        while not self.closed:
            with trio.move_on_after(self.probe_interval):
                await self._wake.wait()
            self._wake = trio.Event()
            if not self.closed:
                await self.probe()

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
        if self.closed:
            return  # closed while the probe ran: its result no longer matters
        self._detail = detail
        self._apply(HealthEvent.PROBE_OK if ok else HealthEvent.PROBE_FAILED)
        if self.state is HealthState.SUSPECT:  # a failed probe below the threshold
            log.warning("backend %s: probe failed (%s), %d of %d before down", self.name, detail,
                        self.health.failed_probes, self.unhealthy_threshold)
            self._wake.set()  # probe again now rather than after a full interval

    async def _refresh_info(self) -> None:
        """Re-read the backend's models (adapters over HTTP fetch them in
        ``refresh()``; in-process ones answer ``info()`` directly)."""
        refresh: Callable[[], Awaitable[BackendInfo]] | None = getattr(self.backend, "refresh", None)
        self.info = await refresh() if refresh is not None else self.backend.info()

    def _apply(self, event: HealthEvent) -> None:
        """Feed ``event`` to the health machine, the one place that moves the state."""
        before = self.state
        after = self.health.handle(event)
        if after is not before:
            log.info("backend %s: %s -> %s (%s)", self.name, before.value, after.value, self._detail)

    def report(self, event: HealthEvent) -> None:
        """A request outcome (``REQUEST_*``): into the health machine; a
        failure makes the prober probe at once, whatever the state."""
        self._apply(event)
        if event is not HealthEvent.REQUEST_OK and not self.closed:
            self._wake.set()

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
        return BackendView(
            name=self.name,
            in_flight=self.in_flight,
            healthy=self.state.serving,
            draining=self.draining,
            weight=self.weight,
            models=frozenset(self.models),
        )

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The backend's stream, counted: in-flight drops the moment the
        consumer stops (finish, error, cancel or close). Every outcome goes to
        the health machine: done (or a client error, which the backend
        answered) is REQUEST_OK; an upstream error is REQUEST_FAILED_EARLY or
        _LATE by whether an event was relayed. A cancel is the client's doing
        and says nothing about the backend."""
        self.in_flight += 1
        self._counts["requests"] += 1
        relayed = False
        try:
            async with closing_stream(self.backend.stream(request)) as events:
                async for event in events:
                    self._counts["tokens"] += len(event.token_ids)
                    relayed = True
                    yield event
        except UpstreamError:
            self._failed(relayed)
            raise
        except HeadraceError:
            self.report(HealthEvent.REQUEST_OK)
            raise
        except Exception as exc:
            # An adapter let an error through untranslated: to the router it
            # is an upstream failure like any other (retried before the first
            # token, an in-band error after it), never a silent end.
            self._failed(relayed)
            log.exception("backend %s: untranslated error from the adapter", self.name)
            error = StreamBroken if relayed else BackendUnavailable
            raise error(f"backend {self.name} failed: {type(exc).__name__}: {exc}") from exc
        except (trio.Cancelled, GeneratorExit):
            self._counts["cancelled"] += 1
            raise
        else:
            self.report(HealthEvent.REQUEST_OK)
        finally:
            self.in_flight -= 1

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
            **self._counts,
        )


class closing_stream:
    """``async with closing_stream(events) as events``: close an async
    generator when the block exits, however it exits, shielded from
    cancellation (so the backend hears of it). A class, not an
    ``asynccontextmanager``: it is entered once per stream per layer."""

    __slots__ = ("it",)

    def __init__(self, it: AsyncIterator[Event]) -> None:
        self.it = it

    async def __aenter__(self) -> AsyncIterator[Event]:
        return self.it

    async def __aexit__(self, *exc: object) -> None:
        aclose: Callable[[], Any] | None = getattr(self.it, "aclose", None)
        if aclose is not None:
            with trio.CancelScope(shield=True):
                await aclose()

"""One actor per backend, and the supervisor that keeps them running.

A :class:`BackendActor` owns everything the router knows about one backend:
its client (a :class:`~backends.base.Backend`), its health state (through the
table in :mod:`router.health`), whether an operator drained it, its in-flight
count and its counters. Its task tree is the health prober; request streams
run in the request's own task and pass through :meth:`BackendActor.stream`,
which counts them. Everything runs on one Trio thread, so there are no locks.

The :class:`Supervisor` runs every actor in the router's root nursery. An actor
whose task crashes (a bug in an adapter, an exception that escaped
translation) is logged, marked down and restarted with exponential backoff;
it is never silently dropped::

    Supervisor.run ── nursery ─┬─ _supervise(a) ── nursery.start(a.run) ── probe loop
                               └─ _supervise(b) ── ...   (crash -> log, backoff, restart)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec
import trio

from backends.base import Backend, BackendInfo, Event, GenerateRequest
from backends.errors import BackendUnavailable, HeadraceError, StreamBroken, UpstreamError
from policies.base import BackendView
from router.health import HealthEvent, HealthState, next_state

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
        # Consecutive failed probes that take an UP backend DOWN: one slow
        # probe on a loaded box must not eject a healthy backend (Envoy's
        # unhealthy_threshold). A backend not yet known up goes down at once.
        self.unhealthy_threshold = unhealthy_threshold
        self._failed_probes = 0
        self.backend = backend
        self.weight = weight
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.state = HealthState.UNKNOWN
        self.draining = False
        self.in_flight = 0
        self.info: BackendInfo | None = None
        self._wake = trio.Event()
        self._counts = dict.fromkeys(
            ("requests", "failures", "cancelled", "tokens", "probes", "probe_failures", "restarts"), 0
        )
        self._detail = ""

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe once, report started, then probe every ``probe_interval``
        (sooner when :meth:`suspect` is called)."""
        await self.probe()
        task_status.started()
        while not self.closed:
            with trio.move_on_after(self.probe_interval):
                await self._wake.wait()
            self._wake = trio.Event()
            if not self.closed:
                await self.probe()

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
        self._counts["probes"] += 1
        self._counts["probe_failures"] += 0 if ok else 1
        self._detail = detail
        self._failed_probes = 0 if ok else self._failed_probes + 1
        if not ok and self.state is HealthState.UP and self._failed_probes < self.unhealthy_threshold:
            log.warning("backend %s: probe failed (%s), %d of %d before down", self.name, detail,
                        self._failed_probes, self.unhealthy_threshold)
            self._wake.set()  # probe again now rather than after a full interval
            return
        self._apply(HealthEvent.PROBE_OK if ok else HealthEvent.PROBE_FAILED)

    async def _refresh_info(self) -> None:
        """Re-read the backend's models (adapters over HTTP fetch them in
        ``refresh()``; in-process ones answer ``info()`` directly)."""
        refresh: Callable[[], Awaitable[BackendInfo]] | None = getattr(self.backend, "refresh", None)
        self.info = await refresh() if refresh is not None else self.backend.info()

    def _apply(self, event: HealthEvent) -> None:
        before = self.state
        self.state = next_state(self.state, event)
        if self.state is not before:
            log.info("backend %s: %s -> %s (%s)", self.name, before.value, self.state.value, self._detail)

    def suspect(self) -> None:
        """A request just failed to reach the backend: probe it now."""
        self._wake.set()

    def crashed(self, exc: BaseException) -> None:
        """Called by the supervisor: the actor's task died with ``exc``."""
        self._counts["restarts"] += 1
        self._detail = f"actor crashed: {exc!r}"
        if self.state is not HealthState.CLOSED:
            self._apply(HealthEvent.PROBE_FAILED)

    async def aclose(self) -> None:
        if self.state is HealthState.CLOSED:
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
        """Up, not draining, and serving ``model`` (``None``: any)."""
        if self.state is not HealthState.UP or self.draining:
            return False
        return model is None or not self.models or model in self.models

    def view(self) -> BackendView:
        return BackendView(
            name=self.name,
            in_flight=self.in_flight,
            healthy=self.state is HealthState.UP,
            draining=self.draining,
            weight=self.weight,
            models=frozenset(self.models),
        )

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The backend's stream, counted: in-flight drops the moment the
        consumer stops (finish, error, cancel or close)."""
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
            self._counts["failures"] += 1
            raise
        except HeadraceError:
            raise
        except Exception as exc:
            # An adapter let an error through untranslated: to the router it
            # is an upstream failure like any other (retried before the first
            # token, an in-band error after it), never a silent end.
            self._counts["failures"] += 1
            log.exception("backend %s: untranslated error from the adapter", self.name)
            error = StreamBroken if relayed else BackendUnavailable
            raise error(f"backend {self.name} failed: {type(exc).__name__}: {exc}") from exc
        except (trio.Cancelled, GeneratorExit):
            self._counts["cancelled"] += 1
            raise
        finally:
            self.in_flight -= 1

    def statistics(self) -> ActorStatistics:
        return ActorStatistics(
            name=self.name,
            state=self.state.value,
            draining=self.draining,
            in_flight=self.in_flight,
            weight=self.weight,
            models=self.models,
            detail=self._detail,
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


class Supervisor:
    """Runs the actors; restarts a crashed one with exponential backoff."""

    def __init__(self, actors: Sequence[BackendActor], *, backoff: float = 0.1, backoff_max: float = 10.0) -> None:
        self.actors = list(actors)
        self.backoff = backoff
        self.backoff_max = backoff_max

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every actor concurrently; report started once each has made
        its first probe (or crashed trying); run until cancelled."""
        pending = len(self.actors)
        all_started = trio.Event()

        def one_started() -> None:
            nonlocal pending
            pending -= 1
            if pending == 0:
                all_started.set()

        async with trio.open_nursery() as nursery:
            for actor in self.actors:
                nursery.start_soon(self._supervise, actor, one_started)
            if self.actors:
                await all_started.wait()
            task_status.started()

    async def _supervise(self, actor: BackendActor, started: Callable[[], None]) -> None:
        delay, first = self.backoff, True
        while True:
            began = trio.current_time()
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(actor.run)
                    if first:
                        first = False
                        started()
                return  # run() returned: the actor was closed on purpose
            except Exception as exc:  # logged and restarted, never dropped
                if trio.current_time() - began > self.backoff_max:
                    delay = self.backoff  # it ran a good while: start the backoff over
                log.exception("backend actor %s crashed; restarting in %.2fs", actor.name, delay)
                actor.crashed(exc)
            if first:
                first = False
                started()
            await trio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)

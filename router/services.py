"""Supervised services: long-lived tasks that the router keeps running.

A :class:`Service` is anything with a ``name``, an ``async run(task_status=...)``
that reports started once it is ready, and a ``crashed(exc)`` hook. Backend
actors are one kind (started after their first probe); a KV-event subscriber,
a job runner or a metrics sampler plug in the same way. A service may also
offer ``statistics()`` (CONVENTIONS.md #8): :meth:`Supervisor.reports`
collects those.

The :class:`Supervisor` runs every service in its own nursery under the
router's root nursery. A service whose task crashes (a bug, an exception that
escaped translation) is logged, told through ``crashed(exc)``, and restarted
with exponential backoff; it is never silently dropped. A service whose
``run`` returns has finished on purpose (an actor that was closed) and is not
restarted::

    Supervisor.run ── nursery ─┬─ _supervise(a) ── nursery.start(a.run) ── a's tasks
                               ├─ _supervise(b) ── ...   (crash -> log, crashed(exc), backoff, restart)
                               └─ _supervise(sampler) ── ...

``Supervisor.run`` reports started once every service has started for the
first time, or crashed trying (a backend that cannot be probed must not keep
the router from listening). The backoff doubles from ``backoff`` up to
``backoff_max`` and starts over after a run that lasted longer than
``backoff_max``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import trio

__all__ = ["Service", "ServiceStatistics", "Supervisor", "SupervisorStatistics"]

log = logging.getLogger(__name__)


@runtime_checkable
class Service(Protocol):
    """What the supervisor runs (``statistics()`` is optional)."""

    name: str

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Call ``task_status.started()`` once ready; return to stop for good."""
        ...

    def crashed(self, exc: BaseException) -> None:
        """``run`` raised ``exc``; called before the backoff and restart."""
        ...


class ServiceStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    running: bool  # its task is running now (not in backoff, not finished)
    starts: int  # times run() was called
    restarts: int  # times it was restarted after a crash
    finished: bool  # run() returned: stopped on purpose, not restarted
    last_error: str  # repr of the last crash, "" if none


class SupervisorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    services: tuple[ServiceStatistics, ...]


class _Record:
    __slots__ = ("finished", "last_error", "restarts", "running", "starts")

    def __init__(self) -> None:
        self.running = self.finished = False
        self.starts = self.restarts = 0
        self.last_error = ""


class Supervisor:
    """Runs the services; restarts a crashed one with exponential backoff."""

    def __init__(self, services: Sequence[Service], *, backoff: float = 0.1, backoff_max: float = 10.0) -> None:
        self.services = list(services)
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise ValueError(f"service names must be unique: {names}")
        self.backoff = backoff
        self.backoff_max = backoff_max
        self._records = {s.name: _Record() for s in self.services}
        self._nursery: trio.Nursery | None = None  # while running: where add() starts more

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every service concurrently; report started once each has
        started (or crashed trying); run until cancelled or all finish."""
        pending = len(self.services)
        all_started = trio.Event()

        def one_started() -> None:
            nonlocal pending
            pending -= 1
            if pending == 0:
                all_started.set()

        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for service in self.services:
                nursery.start_soon(self._supervise, service, one_started)
            if self.services:
                await all_started.wait()
            task_status.started()

    async def add(self, service: Service) -> None:
        """Supervise one more service while running (a backend an operator
        added); returns once it has started (or crashed trying). It stops
        like any other, when its ``run`` returns."""
        if self._nursery is None:
            raise RuntimeError("the supervisor is not running")
        if service.name in self._records and any(s.name == service.name for s in self.services):
            raise ValueError(f"a service named {service.name!r} is already supervised")
        self.services.append(service)
        self._records[service.name] = _Record()
        started = trio.Event()
        self._nursery.start_soon(self._supervise, service, started.set)
        await started.wait()

    def forget(self, service: Service) -> None:
        """Drop a service that stopped for good (a removed backend) from the list and the statistics."""
        self.services = [s for s in self.services if s is not service]
        self._records.pop(service.name, None)

    async def _supervise(self, service: Service, started: Callable[[], None]) -> None:
        record = self._records[service.name]
        delay, first = self.backoff, True
        while True:
            began = trio.current_time()
            record.starts += 1
            record.running = True
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(service.run)
                    if first:
                        first = False
                        started()
                record.running, record.finished = False, True
                return  # run() returned: stopped on purpose
            except Exception as exc:  # logged and restarted, never dropped
                record.running = False
                exc = _unwrap(exc)
                if trio.current_time() - began > self.backoff_max:
                    delay = self.backoff  # it ran a good while: start the backoff over
                log.error("service %s crashed; restarting in %.2fs", service.name, delay, exc_info=exc)
                record.restarts += 1
                record.last_error = repr(exc)
                service.crashed(exc)
            if first:
                first = False
                started()
            await trio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            services=tuple(
                ServiceStatistics(
                    name=name,
                    running=r.running,
                    starts=r.starts,
                    restarts=r.restarts,
                    finished=r.finished,
                    last_error=r.last_error,
                )
                for name, r in self._records.items()
            )
        )

    def reports(self) -> dict[str, Any]:
        """Each service's own ``statistics()``, for those that have one."""
        found: dict[str, Any] = {}
        for service in self.services:
            statistics: Callable[[], Any] | None = getattr(service, "statistics", None)
            if statistics is not None:
                found[service.name] = statistics()
        return found


def _unwrap(exc: Exception) -> Exception:
    """The one exception inside the service's nursery group (strict groups
    wrap a crash after ``started()``), so logs and ``crashed`` see the cause."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc

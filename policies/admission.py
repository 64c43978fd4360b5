"""Admission: admit now, queue, or refuse at arrival. Sans-I/O.

The router counts slots: the sum of the concurrency limits of the eligible
backends is the fleet's capacity ``c``; a request holds ``slots`` of them (its
``n``) until its last byte. A request that finds free slots and nobody
waiting at or above its class goes at once; otherwise the policy decides::

    decide(view, now)
      no capacity at all                        -> reject no_healthy_backend
      free slots (past those reserved for other
        tenants, fairness.SlotShares), nobody ahead -> admit
      its class's queue full                    -> reject queue_full
      estimated wait > time left to its deadline -> reject shed       (ErlangShedding only)
      else                                      -> queue

The wait estimate is M/M/c's: with all ``c`` servers busy and ``k`` requests
ahead, a new arrival waits for ``k + 1`` departures of a process of rate
``c * mu`` (each server serving at ``mu``), an Erlang(k + 1, c * mu) time with
mean ``(k + 1) / (c * mu)``. Erlang C is this conditional wait averaged over
the queue's stationary distribution; the router knows the actual queue, so it
uses the conditional form. ``mu`` is measured (:class:`ServiceRate`: an EWMA
of how long a slot is held); until anything has finished there is no
estimate and nothing is shed. ``Retry-After`` on a refusal is the same
estimate (the time until the queue has drained that far), at least a second.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import msgspec

# the one M/M/c implementation, shared with the planner and the router's desired replicas
from policies.erlang import expected_wait

__all__ = [
    "AdmissionPolicy",
    "AdmissionView",
    "BoundedQueue",
    "ErlangShedding",
    "ServiceRate",
    "Verdict",
    "expected_wait",
]

Action = Literal["admit", "queue", "reject"]


class AdmissionView(msgspec.Struct, frozen=True, kw_only=True):
    """The router's state as one arriving request meets it."""

    capacity: int  # slots of the eligible backends (0: none eligible)
    busy: int  # slots held
    slots: int = 1  # slots this request needs
    ahead: int = 0  # requests waiting at or above its class
    queued_in_class: int = 0  # requests waiting in its class
    queue_limit: int = 0  # its class's queue size
    service_rate: float | None = None  # completions per second per slot (measured), None: unknown
    time_left: float | None = None  # seconds to its deadline, None: none
    reserved: int = 0  # free slots it may not take (kept for tenants under their share)


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    action: Action
    code: str | None = None  # on reject: no_healthy_backend | queue_full | shed
    retry_after: float = 0.0
    wait: float | None = None  # the estimated queueing time, when known


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decide what to do with one arriving request."""

    def decide(self, view: AdmissionView, now: float) -> Verdict: ...


class BoundedQueue:
    """Admit when there is room, queue up to the class's queue size, never shed."""

    shed = False

    def decide(self, view: AdmissionView, now: float) -> Verdict:
        if view.capacity <= 0:
            return Verdict(action="reject", code="no_healthy_backend", retry_after=1.0)
        wait = self._wait(view)
        if view.ahead == 0 and view.busy + min(view.slots, view.capacity) <= view.capacity - view.reserved:
            return Verdict(action="admit", wait=0.0)
        if view.queued_in_class >= view.queue_limit:
            return Verdict(action="reject", code="queue_full", retry_after=_retry(wait), wait=wait)
        if self.shed and wait is not None and view.time_left is not None and wait > view.time_left:
            return Verdict(action="reject", code="shed", retry_after=_retry(wait), wait=wait)
        return Verdict(action="queue", wait=wait)

    def _wait(self, view: AdmissionView) -> float | None:
        if view.service_rate is None or view.capacity <= 0:
            return None
        return expected_wait(view.ahead, view.capacity, view.service_rate)


class ErlangShedding(BoundedQueue):
    """BoundedQueue, and shed at arrival a request whose estimated wait
    (M/M/c, measured service rate) is past its deadline."""

    shed = True


def _retry(wait: float | None) -> float:
    return 1.0 if wait is None else max(1.0, wait)


class ServiceRate:
    """How fast a slot turns over: an exponentially weighted mean of hold
    times (``alpha`` per observation), as a rate per second."""

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], not {alpha}")
        self.alpha = alpha
        self.mean: float | None = None
        self.samples = 0

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        self.mean = seconds if self.mean is None else self.mean + self.alpha * (seconds - self.mean)
        self.samples += 1

    @property
    def rate(self) -> float | None:
        return None if self.mean is None else 1.0 / self.mean

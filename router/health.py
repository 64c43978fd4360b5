"""A backend's health lifecycle as a transition table (CONVENTIONS.md #2).

One state per backend, fed by three sources through one table: the actor's
probes, the outcome of every request streamed through it (before and after
its first token), and its circuit breaker's transitions (relayed by the
dispatcher, which owns the breakers: policies/breaker.py counts failures
and times ejections, this table is the state everyone reads). Nothing else
moves the state (self-loops not drawn)::

                 probe_ok               request_failed_*, probe_failed
    UNKNOWN ─────────────────> UP ─────────────────────────────────> SUSPECT
       │                      ^  │ <──────────── probe_ok ─────────────  │
       │ probe_failed         │  │ probe_threshold                       │ probe_threshold
       │              probe_ok│  v                                       │
       └────────────────────> DOWN <─────────────────────────────────────┘
                               ^
              probe_failed     │      (the breaker's, relayed)
         ┌─────────────────────┴───────────────┐
         │                                     │
    UP, SUSPECT ──eject──> EJECTED ──cooled──> HALF_OPEN ──recovered──> UP
                               ^                 │
                               └──── eject ──────┘

    any open state --crashed--> DOWN          any open state --close--> CLOSED

- **UP** and **SUSPECT** take requests. SUSPECT is "up, but a request or a
  probe just failed": the actor probes at once, and the next probe decides.
- **EJECTED**: the breaker opened (failures in the request path); no
  requests until the ejection ends, whatever the probes say (a backend can
  answer /health and still fail every request). **HALF_OPEN**: the ejection
  is over; the breaker lets its few trial requests through, and their
  successes close it (RECOVERED -> UP) or a failure ejects it again.
- A failed probe while ejected or half-open is DOWN at once (the backend is
  not known good): a backend whose probes fail is never tried by requests.
  The dispatcher then resets its breaker, and the probes alone bring it
  back (DOWN -> UP), its ejection streak kept for next time.
- The probe threshold is part of the machine: :class:`BackendHealth` counts
  consecutive failed probes and turns the ``unhealthy_threshold``-th one into
  ``PROBE_THRESHOLD``, so one slow probe on a loaded box does not eject a
  healthy backend (Envoy's ``unhealthy_threshold``), while a backend not yet
  known up (UNKNOWN, DOWN, EJECTED, HALF_OPEN) goes down on any failed probe.
- Requests only raise suspicion: a request that succeeds shows the backend
  served one request, not that it is healthy, so probes alone bring a backend
  up or take it down. Request failures do not count toward the threshold;
  they reach the breaker, which may eject.
- CLOSED: the actor was shut down. A stream still in flight may finish after
  that, so request outcomes are legal there (and change nothing); probes are not.

Every legal pair is in :data:`TRANSITIONS`; anything else raises
:class:`LifecycleError` (a bug, e.g. a probe result arriving after close, or
a breaker transition relayed for a backend that is down), never a silent no-op.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "TRANSITIONS",
    "BackendHealth",
    "HealthEvent",
    "HealthState",
    "HealthStatistics",
    "LifecycleError",
    "next_state",
]


class HealthState(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet
    UP = "up"
    SUSPECT = "suspect"  # up, but the last request or probe failed: probing now
    DOWN = "down"
    EJECTED = "ejected"  # the circuit breaker opened: no requests until the ejection ends
    HALF_OPEN = "half_open"  # the ejection ended: the breaker's trial requests only
    CLOSED = "closed"  # the actor was shut down; its backend client is closed

    @property
    def serving(self) -> bool:
        """Takes requests (unless an operator drained it; half-open: the
        breaker's few trial requests)."""
        return self in (HealthState.UP, HealthState.SUSPECT, HealthState.HALF_OPEN)

    @property
    def probed_up(self) -> bool:
        """The probes keep it up (it may still be ejected): the states whose
        breaker transitions the dispatcher relays."""
        return self in (HealthState.UP, HealthState.SUSPECT, HealthState.EJECTED, HealthState.HALF_OPEN)


class HealthEvent(enum.Enum):
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"  # fewer than the threshold in a row
    PROBE_THRESHOLD = "probe_threshold"  # the failed probe that makes the threshold
    REQUEST_OK = "request_ok"  # the backend answered (finished, or refused a bad request)
    REQUEST_FAILED_EARLY = "request_failed_early"  # upstream error before the first token
    REQUEST_FAILED_LATE = "request_failed_late"  # upstream error after it (stream broke)
    EJECT = "eject"  # the breaker opened (a trip, or a failed half-open trial)
    COOLED = "cooled"  # the breaker's ejection time is over: half-open
    RECOVERED = "recovered"  # the breaker's trials succeeded: closed
    CRASHED = "crashed"  # the actor's task died (a bug): down until a probe passes
    CLOSE = "close"


class LifecycleError(RuntimeError):
    """An event that is not legal in the current state: a bug, not input."""


S, E = HealthState, HealthEvent
_OPEN = (S.UNKNOWN, S.UP, S.SUSPECT, S.DOWN, S.EJECTED, S.HALF_OPEN)
_REQUESTS = (E.REQUEST_OK, E.REQUEST_FAILED_EARLY, E.REQUEST_FAILED_LATE)

TRANSITIONS: dict[tuple[HealthState, HealthEvent], HealthState] = {
    (S.UNKNOWN, E.PROBE_OK): S.UP,
    (S.UNKNOWN, E.PROBE_FAILED): S.DOWN,  # not known up: down at once
    (S.UNKNOWN, E.PROBE_THRESHOLD): S.DOWN,
    (S.UP, E.PROBE_OK): S.UP,
    (S.UP, E.PROBE_FAILED): S.SUSPECT,
    (S.UP, E.PROBE_THRESHOLD): S.DOWN,  # threshold 1
    (S.UP, E.REQUEST_OK): S.UP,
    (S.UP, E.REQUEST_FAILED_EARLY): S.SUSPECT,
    (S.UP, E.REQUEST_FAILED_LATE): S.SUSPECT,
    (S.SUSPECT, E.PROBE_OK): S.UP,
    (S.SUSPECT, E.PROBE_FAILED): S.SUSPECT,
    (S.SUSPECT, E.PROBE_THRESHOLD): S.DOWN,
    (S.DOWN, E.PROBE_OK): S.UP,
    (S.DOWN, E.PROBE_FAILED): S.DOWN,
    (S.DOWN, E.PROBE_THRESHOLD): S.DOWN,
    # The breaker's transitions, for a backend the probes keep up.
    (S.UP, E.EJECT): S.EJECTED,
    (S.SUSPECT, E.EJECT): S.EJECTED,
    (S.EJECTED, E.COOLED): S.HALF_OPEN,
    (S.HALF_OPEN, E.EJECT): S.EJECTED,
    (S.HALF_OPEN, E.RECOVERED): S.UP,
    # Ejected or half-open: a passing probe does not end the ejection, a
    # failing one is DOWN at once (not known good: no trial requests).
    **{(s, E.PROBE_OK): s for s in (S.EJECTED, S.HALF_OPEN)},
    **{(s, e): S.DOWN for s in (S.EJECTED, S.HALF_OPEN) for e in (E.PROBE_FAILED, E.PROBE_THRESHOLD)},
    # Only in UP does a request outcome move the state. Elsewhere probes
    # (or the breaker) decide; a stream that started while up may end after
    # the backend went down, was ejected, or the actor closed.
    **{(s, e): s for s in (S.UNKNOWN, S.SUSPECT, S.DOWN, S.EJECTED, S.HALF_OPEN, S.CLOSED) for e in _REQUESTS},
    **{(s, E.CRASHED): S.DOWN for s in _OPEN},
    **{(s, E.CLOSE): S.CLOSED for s in _OPEN},
}


def next_state(state: HealthState, event: HealthEvent) -> HealthState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LifecycleError(f"no transition from {state.name} on {event.name}") from None


class HealthStatistics(msgspec.Struct, frozen=True, kw_only=True):
    state: str
    failed_probes: int  # consecutive, toward the threshold
    unhealthy_threshold: int
    transitions: int  # state changes
    events: dict[str, int]  # every event handled, by name (after threshold counting)


class BackendHealth:
    """One backend's health: the state, the count of consecutive failed
    probes, and the threshold that turns that count into ``PROBE_THRESHOLD``.

    :meth:`handle` is the only way in; the new state always comes from
    :data:`TRANSITIONS`."""

    def __init__(self, unhealthy_threshold: int = 2) -> None:
        if unhealthy_threshold < 1:
            raise ValueError(f"unhealthy_threshold must be at least 1, not {unhealthy_threshold}")
        self.unhealthy_threshold = unhealthy_threshold
        self.state = HealthState.UNKNOWN
        self.failed_probes = 0
        self._transitions = 0
        self._events = dict.fromkeys((e.value for e in HealthEvent), 0)

    def handle(self, event: HealthEvent) -> HealthState:
        """Apply ``event`` (a failed probe counts toward the threshold) and
        return the new state; raise :class:`LifecycleError` if illegal."""
        failed = self.failed_probes
        if event is HealthEvent.PROBE_OK:
            failed = 0
        elif event in (HealthEvent.PROBE_FAILED, HealthEvent.PROBE_THRESHOLD):
            failed += 1
            event = HealthEvent.PROBE_THRESHOLD if failed >= self.unhealthy_threshold else HealthEvent.PROBE_FAILED
        state = next_state(self.state, event)  # raises before anything changes
        self.failed_probes = failed
        self._events[event.value] += 1
        if state is not self.state:
            self._transitions += 1
            self.state = state
        return state

    def statistics(self) -> HealthStatistics:
        return HealthStatistics(
            state=self.state.value,
            failed_probes=self.failed_probes,
            unhealthy_threshold=self.unhealthy_threshold,
            transitions=self._transitions,
            events=dict(self._events),
        )

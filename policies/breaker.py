"""Circuit breaking per backend, and the retry budget. Sans-I/O.

One breaker per backend, its lifecycle a transition table (CONVENTIONS.md #2)::

               trip                          cooled (ejection time over)
    CLOSED ─────────────> OPEN ─────────────────────────────> HALF_OPEN
       ^                   ^ └── success / failure: no change     │ │
       │                   └──────────── failure ─────────────────┘ │
       └─────────────────────────── recovered ──────────────────────┘
       (success / failure below the thresholds: no change)
    OPEN, HALF_OPEN ──reset──> CLOSED   (health probes took the backend down:
                                          from then on the probes decide)

- :class:`CircuitBreaker` counts and turns counts into events, as the health
  machine does: a failure that makes ``consecutive_failures`` in a row, or a
  failure rate of at least ``failure_rate`` over the last ``window`` seconds
  (with ``min_requests`` seen), is TRIP; ``half_open_successes`` successes in
  half-open are RECOVERED. Failures are upstream errors (connect errors,
  resets, 5xx, timeouts, in-band stream errors); a 4xx is the client's and is
  reported as a success of the backend, never a failure.
- Open lasts ``base_ejection * n`` seconds for the ``n``-th ejection in a row
  (Envoy's rule), at most ``max_ejection``; a backend that stayed closed for
  ``max_ejection`` starts again at ``n = 1``. Half-open lets
  ``half_open_successes`` requests through at once: the probes; a probe
  that ends with no verdict (cancelled, a 4xx, a 429) gives its slot back
  (``release``).
- :class:`Breakers` holds one per backend and refuses a trip that would eject
  more than ``max_ejection_fraction`` of a group's backends (at least one
  may always go) or the group's last one not ejected: an outage of one
  backend must not become an outage of a model. Groups are the model
  routes' backend sets (:meth:`Breakers.set_groups`); a backend in no
  configured group belongs to the group of all such backends (with no
  groups configured: the whole fleet), and a backend in several groups
  may go only if every one of them allows it. Backends the router's health probes hold down
  (:meth:`Breakers.set_serving`) count as out for that rule, and their
  breaker is reset: one state per backend, the router's
  (``router/health.py``), which hears every breaker transition.

The retry budget (Envoy's ``RetryBudget``): retries in flight stay within
``ratio`` of the requests in flight, with ``min_retries`` allowed regardless;
:func:`full_jitter` is the backoff before one (AWS's "full jitter").
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import msgspec

__all__ = [
    "TRANSITIONS",
    "BreakerError",
    "BreakerEvent",
    "BreakerOptions",
    "BreakerPolicy",
    "BreakerState",
    "BreakerStatistics",
    "Breakers",
    "CircuitBreaker",
    "RetryBudget",
    "RetryBudgetStatistics",
    "full_jitter",
    "next_state",
]


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # below the thresholds
    TRIP = "trip"  # the failure that makes a threshold
    COOLED = "cooled"  # the ejection time is over
    RECOVERED = "recovered"  # the success that makes half_open_successes
    RESET = "reset"  # the backend went down by its health probes: they decide now


class BreakerError(RuntimeError):
    """An event that is not legal in the breaker's state: a bug, not input."""


S, E = BreakerState, BreakerEvent

TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], BreakerState] = {
    (S.CLOSED, E.SUCCESS): S.CLOSED,
    (S.CLOSED, E.FAILURE): S.CLOSED,
    (S.CLOSED, E.TRIP): S.OPEN,
    # Streams that started before the breaker opened end while it is open.
    (S.OPEN, E.SUCCESS): S.OPEN,
    (S.OPEN, E.FAILURE): S.OPEN,
    (S.OPEN, E.COOLED): S.HALF_OPEN,
    (S.HALF_OPEN, E.SUCCESS): S.HALF_OPEN,
    (S.HALF_OPEN, E.RECOVERED): S.CLOSED,
    (S.HALF_OPEN, E.FAILURE): S.OPEN,  # one failed probe reopens
    (S.CLOSED, E.RESET): S.CLOSED,
    (S.OPEN, E.RESET): S.CLOSED,
    (S.HALF_OPEN, E.RESET): S.CLOSED,
}


def next_state(state: BreakerState, event: BreakerEvent) -> BreakerState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise BreakerError(f"no breaker transition from {state.name} on {event.name}") from None


class BreakerOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Defaults: SGLang's and Envoy's (5 in a row, 30 s base, 300 s cap, 2 to close)."""

    consecutive_failures: int = 5
    failure_rate: float = 0.5  # of the requests in the window; > 1 turns it off
    window: float = 10.0  # seconds
    min_requests: int = 20  # requests in the window before the rate counts
    base_ejection: float = 30.0
    max_ejection: float = 300.0
    half_open_successes: int = 2
    max_ejection_fraction: float = 0.5  # of a group's backends ejected at once (at least one)

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1 or self.half_open_successes < 1 or self.min_requests < 1:
            raise ValueError("consecutive_failures, half_open_successes and min_requests must be at least 1")
        if self.window <= 0 or self.base_ejection <= 0 or self.max_ejection < self.base_ejection:
            raise ValueError("window and base_ejection must be positive, max_ejection at least base_ejection")
        if not 0 <= self.max_ejection_fraction <= 1:
            raise ValueError("max_ejection_fraction must be in [0, 1]")


class BreakerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    state: str
    ejections: int  # times opened
    consecutive_failures: int
    open_until: float | None
    refused_trips: int  # trips refused by the fleet rule (too many ejected)


_BUCKETS = 10  # the failure-rate window in this many slices


class CircuitBreaker:
    """One backend's breaker; :meth:`handle` is the only way the state moves."""

    def __init__(self, options: BreakerOptions | None = None) -> None:
        self.options = options or BreakerOptions()
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive
        self.successes = 0  # in half-open
        self.probes = 0  # half-open requests in flight
        self.ejections = 0
        self.streak = 0  # ejections in a row (the multiplier)
        self.open_until: float | None = None
        self.closed_at = 0.0
        self._slices: list[list[float]] = [[-1.0, 0, 0] for _ in range(_BUCKETS)]  # [slice start, ok, failed]

    def handle(self, event: BreakerEvent, now: float) -> BreakerState:
        state = next_state(self.state, event)
        if state is not self.state:
            self._enter(state, now)
        return state

    def _enter(self, state: BreakerState, now: float) -> None:
        o = self.options
        if state is BreakerState.OPEN:
            if self.state is BreakerState.CLOSED and now - self.closed_at >= o.max_ejection:
                self.streak = 0  # a long healthy spell forgets earlier ejections
            self.streak += 1
            self.ejections += 1
            self.open_until = now + min(o.max_ejection, o.base_ejection * self.streak)
        elif state is BreakerState.CLOSED:
            self.closed_at, self.open_until = now, None
            self._slices = [[-1.0, 0, 0] for _ in range(_BUCKETS)]
        self.state = state
        self.failures = self.successes = self.probes = 0

    def poll(self, now: float) -> BreakerState:
        """The state at ``now`` (an open breaker whose time is over is half-open)."""
        if self.state is BreakerState.OPEN and self.open_until is not None and now >= self.open_until:
            self.handle(BreakerEvent.COOLED, now)
        return self.state

    def allows(self, now: float) -> bool:
        """May a new request go to this backend?"""
        state = self.poll(now)
        if state is BreakerState.HALF_OPEN:
            return self.probes < self.options.half_open_successes
        return state is BreakerState.CLOSED

    def dispatched(self, now: float) -> None:
        if self.poll(now) is BreakerState.HALF_OPEN:
            self.probes += 1

    def release(self, now: float) -> None:
        """A dispatched request ended with no verdict on the backend
        (cancelled, a 4xx, a 429): its half-open probe slot is free again,
        and the state does not move. Without it a cancelled probe would hold
        its slot for good and the breaker would never close."""
        if self.poll(now) is BreakerState.HALF_OPEN:
            self.probes = max(0, self.probes - 1)

    def reset(self, now: float) -> BreakerState:
        """Back to closed whatever the state (the streak of ejections is
        kept, so the next one is longer): the backend's health probes took
        it down, and they, not this ejection, bring it back."""
        return self.handle(BreakerEvent.RESET, now)

    def trips(self, now: float) -> bool:
        """Would one more failure now trip it (counting that failure)?"""
        if self.state is not BreakerState.CLOSED:
            return False
        if self.failures + 1 >= self.options.consecutive_failures:
            return True
        ok, failed = self._window(now)
        total = ok + failed + 1
        return total >= self.options.min_requests and (failed + 1) / total >= self.options.failure_rate

    def record(self, ok: bool, now: float, *, allow_trip: bool = True) -> BreakerState:
        """A request's outcome; ``allow_trip`` False keeps a closed breaker
        closed (the fleet rule refused the ejection)."""
        state = self.poll(now)
        if state is BreakerState.HALF_OPEN:
            self.probes = max(0, self.probes - 1)
        if ok:
            return self._success(state, now)
        event = BreakerEvent.TRIP if allow_trip and self.trips(now) else BreakerEvent.FAILURE
        self._count(now, ok=False)
        self.failures += 1
        return self.handle(event, now)

    def _success(self, state: BreakerState, now: float) -> BreakerState:
        self._count(now, ok=True)
        self.failures = 0
        if state is BreakerState.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.options.half_open_successes:
                return self.handle(BreakerEvent.RECOVERED, now)
        return self.handle(BreakerEvent.SUCCESS, now)

    def _slice(self, now: float) -> list[float]:
        width = self.options.window / _BUCKETS
        start = math.floor(now / width) * width
        s = self._slices[int(now // width) % _BUCKETS]
        if s[0] != start:
            s[0], s[1], s[2] = start, 0, 0
        return s

    def _count(self, now: float, *, ok: bool) -> None:
        s = self._slice(now)
        s[1 if ok else 2] += 1

    def _window(self, now: float) -> tuple[int, int]:
        oldest = now - self.options.window
        live = [s for s in self._slices if oldest < s[0] <= now]
        return int(sum(s[1] for s in live)), int(sum(s[2] for s in live))


@runtime_checkable
class BreakerPolicy(Protocol):
    """Which backends may take requests, fed every request's outcome.
    ``state`` is what the router's one health state per backend follows
    (router/health.py); optional: ``release``, ``set_serving`` (called
    when what the health probes say of a backend changes, and at its
    removal), ``ejected_until``, ``add``, ``statistics`` (see
    :class:`Breakers`)."""

    def allows(self, backend: str, now: float) -> bool: ...

    def dispatched(self, backend: str, now: float) -> None: ...

    def record(self, backend: str, ok: bool, now: float) -> None: ...

    def state(self, backend: str, now: float) -> BreakerState: ...


class Breakers:
    """Consecutive failures or a failure rate eject a backend, for a time that
    grows with repeated ejections; half-open probes bring it back. Never more
    than a fraction of the backends (at least one) or the last one."""

    Options = BreakerOptions

    def __init__(self, options: BreakerOptions | None = None) -> None:
        self.options = options or BreakerOptions()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._refused: dict[str, int] = {}
        self._out: set[str] = set()  # held down by the router's health probes
        self._groups: list[frozenset[str]] = []  # configured groups (model routes' backends)

    def add(self, names: Iterable[str]) -> None:
        """Know these backends (the fleet rule counts them)."""
        for name in names:
            self._breaker(name)

    def set_groups(self, groups: Iterable[Iterable[str]]) -> None:
        """The backend groups the fleet rule holds for, each apart (a
        model's backends); backends in none form one more group."""
        self._groups = list(dict.fromkeys(frozenset(g) for g in groups if g))
        for group in self._groups:
            self.add(group)

    def groups_of(self, backend: str) -> list[frozenset[str]]:
        """The groups whose rule an ejection of ``backend`` must pass."""
        found = [g for g in self._groups if backend in g]
        if found:
            return found
        grouped = frozenset().union(*self._groups)
        return [frozenset(name for name in self._breakers if name not in grouped)]

    def _breaker(self, name: str) -> CircuitBreaker:
        found = self._breakers.get(name)
        if found is None:
            self._breakers[name] = found = CircuitBreaker(self.options)
        return found

    def allows(self, backend: str, now: float) -> bool:
        return self._breaker(backend).allows(now)

    def dispatched(self, backend: str, now: float) -> None:
        self._breaker(backend).dispatched(now)

    def release(self, backend: str, now: float) -> None:
        """A dispatched request that ended with no verdict: see :meth:`CircuitBreaker.release`."""
        self._breaker(backend).release(now)

    def record(self, backend: str, ok: bool, now: float) -> None:
        breaker = self._breaker(backend)
        allow = True
        if not ok and breaker.trips(now):
            allow = all(self._may_eject(group, now) for group in self.groups_of(backend))
            if not allow:
                self._refused[backend] = self._refused.get(backend, 0) + 1
        breaker.record(ok, now, allow_trip=allow)

    def _may_eject(self, group: frozenset[str], now: float) -> bool:
        total = len(group)
        out = sum(name in self._out or self._breaker(name).poll(now) is not BreakerState.CLOSED for name in group)
        most = max(1, math.floor(self.options.max_ejection_fraction * total))
        return out + 1 <= most and out + 1 < total

    def set_serving(self, backend: str, serving: bool, now: float) -> None:
        """What the backend's health probes say: a backend they hold down
        counts as out for the fleet rule, and its breaker is reset (probes
        bring it back, not the end of an ejection)."""
        breaker = self._breaker(backend)
        if serving:
            self._out.discard(backend)
            return
        self._out.add(backend)
        if breaker.state is not BreakerState.CLOSED:
            breaker.reset(now)

    def state(self, backend: str, now: float) -> BreakerState:
        return self._breaker(backend).poll(now)

    def ejected_until(self, backend: str, now: float) -> float | None:
        """When the backend's ejection ends (None: not ejected now)."""
        b = self._breaker(backend)
        return b.open_until if b.poll(now) is BreakerState.OPEN else None

    def statistics(self, now: float) -> list[BreakerStatistics]:
        return [
            BreakerStatistics(
                name=name,
                state=b.poll(now).value,
                ejections=b.ejections,
                consecutive_failures=b.failures,
                open_until=b.open_until,
                refused_trips=self._refused.get(name, 0),
            )
            for name, b in sorted(self._breakers.items())
        ]


class RetryBudgetStatistics(msgspec.Struct, frozen=True, kw_only=True):
    active: int  # retries in flight
    granted: int  # retries let through
    refused: int  # retries refused: the budget was spent


class RetryBudget:
    """Retries in flight at most ``max(min_retries, ratio * requests in flight)``."""

    def __init__(self, ratio: float = 0.2, min_retries: int = 3) -> None:
        if ratio < 0 or min_retries < 0:
            raise ValueError("ratio and min_retries must be >= 0")
        self.ratio, self.min_retries = ratio, min_retries
        self.active = 0
        self.granted = 0
        self.refused = 0

    def allowance(self, in_flight: int) -> int:
        return max(self.min_retries, math.floor(self.ratio * in_flight))

    def try_acquire(self, in_flight: int) -> bool:
        """One more retry, if the budget has room; pair with :meth:`release`."""
        if self.active >= self.allowance(in_flight):
            self.refused += 1
            return False
        self.active += 1
        self.granted += 1
        return True

    def release(self) -> None:
        self.active = max(0, self.active - 1)

    def statistics(self) -> RetryBudgetStatistics:
        return RetryBudgetStatistics(active=self.active, granted=self.granted, refused=self.refused)


def full_jitter(attempt: int, draw: float, *, base: float = 0.025, cap: float = 0.25) -> float:
    """Seconds to wait before retry ``attempt`` (1 = the first retry):
    uniform in ``[0, min(cap, base * 2**(attempt - 1))]``, ``draw`` in [0, 1)."""
    ceiling: float = min(cap, base * 2.0 ** max(0, attempt - 1))
    return draw * ceiling

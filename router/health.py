"""A backend's health lifecycle as a transition table (CONVENTIONS.md #2).

::

    UNKNOWN --probe_ok--> UP <--probe_ok--> DOWN
       |                   |   probe_failed   ^
       +---probe_failed----+------------------+
    any --close--> CLOSED        (nothing leaves CLOSED)

Every legal pair is in :data:`TRANSITIONS`; anything else raises
:class:`LifecycleError` (a bug, e.g. a probe result arriving after close),
never a silent no-op.
"""

from __future__ import annotations

import enum

__all__ = ["TRANSITIONS", "HealthEvent", "HealthState", "LifecycleError", "next_state"]


class HealthState(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet
    UP = "up"
    DOWN = "down"
    CLOSED = "closed"  # the actor was shut down; its backend client is closed


class HealthEvent(enum.Enum):
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"
    CLOSE = "close"


class LifecycleError(RuntimeError):
    """An event that is not legal in the current state: a bug, not input."""


S, E = HealthState, HealthEvent
TRANSITIONS: dict[tuple[HealthState, HealthEvent], HealthState] = {
    (S.UNKNOWN, E.PROBE_OK): S.UP,
    (S.UNKNOWN, E.PROBE_FAILED): S.DOWN,
    (S.UNKNOWN, E.CLOSE): S.CLOSED,
    (S.UP, E.PROBE_OK): S.UP,
    (S.UP, E.PROBE_FAILED): S.DOWN,
    (S.UP, E.CLOSE): S.CLOSED,
    (S.DOWN, E.PROBE_OK): S.UP,
    (S.DOWN, E.PROBE_FAILED): S.DOWN,
    (S.DOWN, E.CLOSE): S.CLOSED,
}


def next_state(state: HealthState, event: HealthEvent) -> HealthState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LifecycleError(f"no transition from {state.name} on {event.name}") from None

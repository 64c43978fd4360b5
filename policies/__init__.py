"""Pure decision logic (sans-I/O), one kind per extension point: routing today;
admission, priority, breakers and rate limits as they land (their kinds are
declared in :data:`policies.registry.KINDS`). Nothing here imports trio,
httpx or hypercorn."""

from __future__ import annotations

from policies.base import BackendView, RouteRequest, RoutingPolicy
from policies.registry import (
    GROUP,
    KINDS,
    Kind,
    PolicyError,
    PolicyInfo,
    available,
    create,
    create_policy,
    group,
    installed,
    load_factory,
)
from policies.routing import LeastLoaded, RoundRobin

__all__ = [
    "GROUP",
    "KINDS",
    "BackendView",
    "Kind",
    "LeastLoaded",
    "PolicyError",
    "PolicyInfo",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "available",
    "create",
    "create_policy",
    "group",
    "installed",
    "load_factory",
]

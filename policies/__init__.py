"""Pure decision logic (sans-I/O): routing today; admission, priority, breakers
and rate limits as they land. Nothing here imports trio, httpx or hypercorn."""

from __future__ import annotations

from policies.base import BackendView, RouteRequest, RoutingPolicy
from policies.registry import GROUP, PolicyError, available, create_policy, load_factory
from policies.routing import LeastLoaded, RoundRobin

__all__ = [
    "GROUP",
    "BackendView",
    "LeastLoaded",
    "PolicyError",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "available",
    "create_policy",
    "load_factory",
]

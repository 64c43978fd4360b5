"""Pure decision logic (sans-I/O), one kind per extension point: routing (round_robin, least_loaded, power_of_two, prefix_hash, kv_aware);
admission, priority, breakers and rate limits as they land (their kinds are
declared in :data:`policies.registry.KINDS`). Nothing here imports trio,
httpx or hypercorn."""

from __future__ import annotations

from policies.base import BackendView, KVEventSink, RouteRequest, RoutingFeedback, RoutingPolicy
from policies.kv_aware import KVAware
from policies.kv_index import KVIndex, RecentlySent
from policies.prefix_hash import HashRing, PrefixHash, request_key, stable_hash
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
from policies.routing import LeastLoaded, PowerOfTwo, RoundRobin

__all__ = [
    "GROUP",
    "KINDS",
    "BackendView",
    "HashRing",
    "KVAware",
    "KVEventSink",
    "KVIndex",
    "Kind",
    "LeastLoaded",
    "PolicyError",
    "PolicyInfo",
    "PowerOfTwo",
    "PrefixHash",
    "RecentlySent",
    "RoundRobin",
    "RouteRequest",
    "RoutingFeedback",
    "RoutingPolicy",
    "available",
    "create",
    "create_policy",
    "group",
    "installed",
    "load_factory",
    "request_key",
    "stable_hash",
]

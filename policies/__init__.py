"""Pure decision logic (sans-I/O), one kind per extension point: routing (round_robin, least_loaded, power_of_two, prefix_hash, kv_aware);
admission (bounded, erlang), priority (fair_queue), rate limits (memory,
redis: decided in a shared store by scripts this package holds) and
breakers (standard), each kind declared in :data:`policies.registry.KINDS`;
and the AIMD concurrency limit a backend's 429s teach.
Nothing here imports trio, httpx or hypercorn."""

from __future__ import annotations

from policies.admission import (
    AdmissionPolicy,
    AdmissionView,
    BoundedQueue,
    ErlangShedding,
    ServiceRate,
    Verdict,
)
from policies.base import BackendView, KVEventSink, RouteRequest, RoutingFeedback, RoutingPolicy
from policies.breaker import (
    BreakerPolicy,
    Breakers,
    BreakerState,
    CircuitBreaker,
    RetryBudget,
    full_jitter,
)
from policies.concurrency import AIMDLimit
from policies.fairness import CLASSES, FairQueue, QueuePolicy, SlotShares, Waiting
from policies.kv_aware import KVAware
from policies.kv_index import KVIndex, RecentlySent
from policies.prefix_hash import HashRing, PrefixHash, request_key, stable_hash
from policies.ratelimit import Limits, RateDecision, RateLimitPolicy, TokenBucket, TokenBuckets
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
from policies.shared_limits import ScriptCall, SharedBuckets, SharedRateLimitPolicy

__all__ = [
    "CLASSES",
    "GROUP",
    "KINDS",
    "AIMDLimit",
    "AdmissionPolicy",
    "AdmissionView",
    "BackendView",
    "BoundedQueue",
    "BreakerPolicy",
    "BreakerState",
    "Breakers",
    "CircuitBreaker",
    "ErlangShedding",
    "FairQueue",
    "HashRing",
    "KVAware",
    "KVEventSink",
    "KVIndex",
    "Kind",
    "LeastLoaded",
    "Limits",
    "PolicyError",
    "PolicyInfo",
    "PowerOfTwo",
    "PrefixHash",
    "QueuePolicy",
    "RateDecision",
    "RateLimitPolicy",
    "RecentlySent",
    "RetryBudget",
    "RoundRobin",
    "RouteRequest",
    "RoutingFeedback",
    "RoutingPolicy",
    "ScriptCall",
    "ServiceRate",
    "SharedBuckets",
    "SharedRateLimitPolicy",
    "SlotShares",
    "TokenBucket",
    "TokenBuckets",
    "Verdict",
    "Waiting",
    "available",
    "create",
    "create_policy",
    "full_jitter",
    "group",
    "installed",
    "load_factory",
    "request_key",
    "stable_hash",
]

"""The routing-policy interface: what a picker sees and what it returns.

A policy is sans-I/O (see CONVENTIONS.md #1): the router hands it frozen
snapshots of the eligible backends and of the request, plus ``now``, and gets a
backend name back. It never awaits, never reads a clock, never touches a
socket, so the same object runs in the router, in a simulator and in a unit
test. Later policies (prefix/KV-aware consistent hashing, admission) read the
extra fields already carried here (prompt token ids, text prefix, tenant,
priority) and add their own state; the call shape stays the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

__all__ = ["BackendView", "RouteRequest", "RoutingPolicy"]


class BackendView(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one backend as the router sees it at decision time."""

    name: str
    in_flight: int = 0
    healthy: bool = True
    draining: bool = False
    weight: float = 1.0
    models: frozenset[str] = frozenset()


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy may know about a request (never its full body)."""

    request_id: str = ""
    model: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prefix: str = ""  # the first characters of the prompt text, for text-hash routing
    tenant: str = "default"
    priority: int = 0


@runtime_checkable
class RoutingPolicy(Protocol):
    """Pick one of ``candidates`` (already filtered to healthy, non-draining
    backends serving the model) by name, or ``None`` to refuse."""

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None: ...

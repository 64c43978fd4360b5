"""Ingress limits as plain objects: the limits themselves, the token-bucket
budgets and the connection ledger. State in, decision out; the caller passes
``now``. frontend/hardening.py applies them to hypercorn's connections."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_LIMITS", "Admission", "Budget", "ConnectionLedger", "ConnectionLedgerStatistics", "Limits"]


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-server ingress limits (``ServeOptions(limits=...)``).

    ``max_connections``: None is three quarters of the soft RLIMIT_NOFILE, so
    that accepting never fails with EMFILE (upstream connections need fds
    too). ``reserved_connections`` of those serve only ``reserved_paths``
    (health, readiness, metrics): when everything else is taken, a probe still
    gets an answer and other requests a quick 503; such a connection serves
    one request and waits at most ``frontend.hardening.RESERVE_IDLE_TIMEOUT``, so
    idle clients cannot sit in the reserve. Budgets are token buckets:
    ``burst`` at once, refilled at ``rate`` per second. The reset budget
    counts a client's RST_STREAM only for a stream opened less than
    ``premature_reset`` seconds before (Envoy's "premature reset"): Rapid
    Reset cancels at once, while a router cancelling its upstream streams
    as its own clients go away must not lose the whole connection."""

    max_concurrent_streams: int = 100
    stream_buffer_bytes: int = 64 * 1024
    connection_buffer_bytes: int = 1024 * 1024
    write_stall_timeout: float = 30.0
    reset_burst: int = 100
    reset_rate: float = 33.0
    premature_reset: float = 1.0  # a client reset counts when its stream is younger than this
    control_burst: int = 1000
    control_rate: float = 100.0
    max_connections: int | None = None
    max_connections_per_client: int | None = None
    reserved_connections: int = 0
    reserved_paths: frozenset[str] = frozenset()

    def connection_cap(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, soft * 3 // 4) if soft != resource.RLIM_INFINITY else 1 << 20


DEFAULT_LIMITS = Limits()


class Budget:
    """A token bucket: ``spend(now, n)`` is False once more than ``burst``
    were spent faster than ``rate`` per second."""

    def __init__(self, burst: float, rate: float) -> None:
        self.burst, self.rate = burst, rate
        self.tokens = float(burst)
        self.at: float | None = None

    def spend(self, now: float, n: float = 1.0) -> bool:
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return self.tokens >= 0


Admission = Literal["normal", "reserve", "refused"]


@dataclass(frozen=True)
class ConnectionLedgerStatistics:
    open: int
    reserve: int  # open connections that serve only the reserved paths
    refused_total: int  # refused at accept: every slot taken
    refused_per_client: int  # refused at accept: that address holds its share
    clients: int  # distinct addresses with an open connection


class ConnectionLedger:
    """Who holds the server's connections. ``admit(client)`` when one is
    accepted (``client`` is ``(host, port)``), ``release(client)`` when it
    closes: ``refused`` over the total or that host's cap, ``reserve`` in the
    last ``reserved`` slots, ``normal`` otherwise."""

    def __init__(self, total: int, per_client: int | None = None, reserved: int = 0) -> None:
        self.total, self.per_client, self.reserved = total, per_client, min(reserved, total)
        self.open = 0
        self.by_host: dict[str, int] = {}
        self.reserve: set[tuple[str, int]] = set()
        self.refused_total = self.refused_per_client = 0

    def admit(self, client: tuple[str, int]) -> Admission:
        host = client[0]
        if self.per_client is not None and self.by_host.get(host, 0) >= self.per_client:
            self.refused_per_client += 1
            return "refused"
        if self.open >= self.total:
            self.refused_total += 1
            return "refused"
        self.open += 1
        self.by_host[host] = self.by_host.get(host, 0) + 1
        if self.open > self.total - self.reserved:
            self.reserve.add(client)
            return "reserve"
        return "normal"

    def release(self, client: tuple[str, int]) -> None:
        self.open -= 1
        left = self.by_host[client[0]] - 1
        if left:
            self.by_host[client[0]] = left
        else:
            del self.by_host[client[0]]
        self.reserve.discard(client)

    def is_reserve(self, client: tuple[str, int] | None) -> bool:
        return client is not None and tuple(client) in self.reserve

    def statistics(self) -> ConnectionLedgerStatistics:
        return ConnectionLedgerStatistics(
            self.open, len(self.reserve), self.refused_total, self.refused_per_client, len(self.by_host)
        )

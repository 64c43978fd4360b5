"""M/M/c (Erlang C) queueing formulas, pure: the one implementation that
admission (:mod:`policies.admission`), the planner (``headrace plan``,
sim/plan.py) and the router's desired-replicas signal (router/capacity.py)
share.

The model: requests arrive as a Poisson process of rate ``λ``; each of ``c``
servers (a replica's concurrent streams: its slots) serves one request at a
time, taking an exponentially distributed time of mean ``1/μ``; one FIFO
queue, never full, nobody gives up. With offered load ``a = λ/μ`` and
utilisation ``rho = a/c < 1``::

    C(c, a) = P(wait > 0)                 Erlang C, from Erlang B's recursion
    P(W > t) = C(c, a) · e^{-(cμ - λ) t}  the waiting time
    T = W + S,  S ~ Exp(μ)                the response time, whose tail is
    P(T > t) = (1 - C) e^{-μt} + C · P(Exp(θ) + Exp(μ) > t),   θ = cμ - λ
    fixed service (an approximation: the M/M/c wait plus exactly 1/μ):
    T_q = 1/μ + W_q,  W_q = ln(C / (1 - q)) / θ  (0 when C <= 1 - q)

Erlang B by ``B(0) = 1, B(k) = a B(k-1) / (k + a B(k-1))`` and
``C = B / (1 - rho (1 - B))`` avoids the factorials (stable for any ``c``).
"""

from __future__ import annotations

import math

__all__ = [
    "erlang_b",
    "erlang_c",
    "expected_wait",
    "mean_wait",
    "response_quantile",
    "response_tail",
    "servers_needed",
    "wait_quantile",
    "wait_tail",
]


def erlang_b(servers: int, load: float) -> float:
    """Blocking probability of ``servers`` servers offered ``load`` erlangs."""
    if servers < 0 or load < 0:
        raise ValueError("servers and load must be non-negative")
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def erlang_c(servers: int, load: float) -> float:
    """P(an arrival waits) with ``servers`` servers and ``load = λ/μ``
    erlangs; 1.0 when ``load >= servers`` (the queue grows without bound)."""
    if servers <= 0 or load >= servers:
        return 1.0
    if load <= 0:
        return 0.0
    b = erlang_b(servers, load)
    rho = load / servers
    return b / (1 - rho * (1 - b))


def mean_wait(servers: int, arrival: float, service: float) -> float:
    """Mean queueing time ``C / (cμ - λ)`` (inf when unstable)."""
    spare = servers * service - arrival
    if spare <= 0:
        return math.inf
    return erlang_c(servers, arrival / service) / spare


def wait_tail(t: float, servers: int, arrival: float, service: float) -> float:
    """``P(W > t) = C(c, a) e^{-(cμ-λ)t}`` (1.0 when unstable)."""
    spare = servers * service - arrival
    if spare <= 0:
        return 1.0
    return erlang_c(servers, arrival / service) * math.exp(-spare * max(t, 0.0))


def response_tail(t: float, servers: int, arrival: float, service: float) -> float:
    """``P(W + S > t)``: the waiting time plus an exponential service time."""
    spare = servers * service - arrival
    if spare <= 0:
        return 1.0
    t = max(t, 0.0)
    c = erlang_c(servers, arrival / service)
    mu, theta = service, spare
    if abs(theta - mu) < 1e-9 * mu:
        both = (1 + mu * t) * math.exp(-mu * t)  # Exp(μ) + Exp(μ): Erlang-2
    else:
        both = (theta * math.exp(-mu * t) - mu * math.exp(-theta * t)) / (theta - mu)
    return (1 - c) * math.exp(-mu * t) + c * both


def wait_quantile(q: float, servers: int, arrival: float, service: float) -> float:
    """The ``q`` quantile of the waiting time: 0 when fewer than ``1 - q``
    arrivals wait, else ``ln(C / (1 - q)) / (cμ - λ)``; inf when unstable."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), not {q}")
    spare = servers * service - arrival
    if spare <= 0:
        return math.inf
    c = erlang_c(servers, arrival / service)
    return math.log(c / (1 - q)) / spare if c > 1 - q else 0.0


def response_quantile(q: float, servers: int, arrival: float, service: float, *, fixed: bool = False) -> float:
    """The ``q`` quantile of the response time (e.g. 0.99: the p99), by
    bisection on :func:`response_tail`; inf when the queue is unstable.
    ``fixed``: the service time is taken as exactly ``1/μ`` (the M/M/c wait
    plus a constant: T's quantile is ``1/μ`` + the wait's)."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), not {q}")
    if servers * service <= arrival:
        return math.inf
    if fixed:
        return 1.0 / service + wait_quantile(q, servers, arrival, service)
    target = 1 - q
    hi = 1.0 / service
    while response_tail(hi, servers, arrival, service) > target:
        hi *= 2
    lo = 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if response_tail(mid, servers, arrival, service) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


def servers_needed(
    target: float, arrival: float, service: float, *, q: float = 0.99, per_replica: int = 1, limit: int = 100_000,
    fixed: bool = False,
) -> int | None:
    """The fewest replicas of ``per_replica`` servers each whose response-time
    ``q`` quantile is at most ``target`` seconds at ``arrival`` requests per
    second, each server serving at ``service`` per second; None when no
    number does (the service time alone is past the target) or it is past
    ``limit``. 0 when nothing arrives."""
    if arrival <= 0:
        return 0
    if per_replica <= 0 or service <= 0:
        return None
    if (1.0 if fixed else -math.log(1 - q)) / service > target:  # even with no waiting at all
        return None

    def ok(n: int) -> bool:
        return response_quantile(q, n * per_replica, arrival, service, fixed=fixed) <= target

    lo = max(1, math.floor(arrival / (service * per_replica)) + 1)  # the first stable count
    if ok(lo):
        return lo
    hi = lo  # the p99 falls as replicas are added: double, then bisect
    while not ok(hi):
        if hi > limit:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # ok(hi), not ok(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi if hi <= limit else None


def expected_wait(ahead: int, servers: int, rate: float) -> float:
    """Mean wait, in M/M/c with every server busy, of an arrival with
    ``ahead`` requests before it: ``(ahead + 1) / (servers * rate)`` (the
    mean of an Erlang(ahead + 1, servers * rate) time)."""
    if servers <= 0 or rate <= 0:
        return float("inf")
    return (ahead + 1) / (servers * rate)

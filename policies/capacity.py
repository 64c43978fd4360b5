"""How many replicas a model needs, from its live arrival rate and measured
service time, by the M/M/c model of :mod:`policies.erlang`. Sans-I/O: the
router passes ``now`` and what it saw; the router exports the answer as
``headrace_desired_replicas{model}`` (an HPA / KEDA external metric).

::

    request arrives ──> arrive(model, now)          ArrivalRate: decaying count, time constant ``window``
    request finishes ──> served(model, seconds)     ServiceRate: EWMA of slot hold times (admission to last byte)
    scrape ──> estimate(model, now, replicas, slots)
                 λ = smoothed arrivals/s, μ = 1 / mean hold, c = n · slots
                 desired = fewest n with p99(W + S) <= target (erlang.servers_needed)
                 unreachable (the service time alone is past the target): enough for
                   utilisation <= max_utilisation
                 nothing measured yet: the replicas it has (no opinion)
                 then clamped to [min_replicas, max_replicas]

Several router processes (pods, ``--workers``) each see a share of a
model's traffic: with ``share`` set to that fraction (1 / processes under
even spreading) each sizes the whole fleet from its own sample, λ / share,
so their answers agree and can be averaged.

A replica with ``slots`` concurrent streams is modelled as ``slots``
servers, each serving at the measured per-stream rate; that holds while a
replica's per-stream speed does not depend much on how many streams it runs
(batching makes it roughly so up to its concurrency limit).
"""

from __future__ import annotations

import math

import msgspec

from policies.admission import ServiceRate
from policies.erlang import response_quantile, servers_needed

__all__ = ["ArrivalRate", "Estimate", "ReplicaEstimator"]


class ArrivalRate:
    """Events per second, exponentially smoothed with time constant ``window``
    seconds: each event adds ``1/window`` to a value that decays as
    ``e^{-dt/window}``, so a steady Poisson stream of rate λ reads λ on
    average, and a stream that stops fades to zero."""

    def __init__(self, window: float = 60.0) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, not {window}")
        self.window = window
        self._value = 0.0
        self._at: float | None = None
        self.count = 0

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._at) / self.window)

    def add(self, now: float, n: int = 1) -> None:
        self._value = self._decayed(now) + n / self.window
        self._at = now if self._at is None else max(self._at, now)
        self.count += n

    def rate(self, now: float) -> float:
        return self._decayed(now)


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    desired: int
    arrival_rate: float  # requests per second this process saw (smoothed); the fleet's is this / share
    service_rate: float | None  # completions per second one replica gives (slots x per-stream rate), None: unmeasured
    p99: float | None  # the modelled p99 response time at ``desired`` replicas, seconds (None: unmeasured or unreachable)
    reachable: bool  # False: no replica count meets the target (the service time alone is past it)


class ReplicaEstimator:
    """One :class:`ArrivalRate` and one :class:`ServiceRate` per model."""

    def __init__(
        self,
        target: float,
        *,
        targets: dict[str, float] | None = None,
        window: float = 60.0,
        quantile: float = 0.99,
        min_replicas: int = 1,
        max_replicas: int = 1000,
        max_utilisation: float = 0.9,
        alpha: float = 0.05,
        share: float = 1.0,
        fixed: bool = False,
    ) -> None:
        self.fixed = fixed  # the service time as a constant in the response time (sim/plan.py --service fixed)
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], not {share}")
        self.share = share  # the fraction of each model's traffic this process sees
        self.target, self.targets = target, dict(targets or {})
        self.window, self.quantile, self.alpha = window, quantile, alpha
        self.min_replicas, self.max_replicas, self.max_utilisation = min_replicas, max_replicas, max_utilisation
        self._arrivals: dict[str, ArrivalRate] = {}
        self._service: dict[str, ServiceRate] = {}

    def models(self) -> list[str]:
        return sorted(self._arrivals.keys() | self._service.keys())

    def arrived(self, model: str) -> int:
        """Arrivals of ``model`` counted so far."""
        rate = self._arrivals.get(model)
        return rate.count if rate is not None else 0

    def arrive(self, model: str, now: float) -> None:
        rate = self._arrivals.get(model)
        if rate is None:
            rate = self._arrivals[model] = ArrivalRate(self.window)
        rate.add(now)

    def served(self, model: str, seconds: float) -> None:
        """One request of ``model`` held its slot for ``seconds``."""
        rate = self._service.get(model)
        if rate is None:
            rate = self._service[model] = ServiceRate(self.alpha)
        rate.observe(seconds)

    def estimate(self, model: str, now: float, *, replicas: int, slots: int) -> Estimate:
        """The replicas ``model`` needs now; it has ``replicas`` of ``slots`` streams each."""
        arrivals = self._arrivals.get(model)
        lam = arrivals.rate(now) if arrivals is not None else 0.0
        service = self._service.get(model)
        mu = service.rate if service is not None else None
        slots = max(1, slots)
        if mu is None:
            return Estimate(desired=self._clamp(replicas), arrival_rate=lam, service_rate=None, p99=None, reachable=True)
        target = self.targets.get(model, self.target)
        fleet = lam / self.share  # every router process sizes the whole fleet from its sample
        n = servers_needed(target, fleet, mu, q=self.quantile, per_replica=slots, limit=self.max_replicas, fixed=self.fixed)
        reachable = n is not None or (1.0 if self.fixed else -math.log(1 - self.quantile)) / mu <= target
        if n is None:  # unreachable, or past max_replicas: keep utilisation bounded
            n = math.ceil(fleet / (mu * slots * self.max_utilisation)) if fleet > 0 else 0
        desired = self._clamp(n)
        p99 = response_quantile(self.quantile, desired * slots, fleet, mu, fixed=self.fixed) if fleet > 0 and reachable else None
        return Estimate(desired=desired, arrival_rate=lam, service_rate=mu * slots, p99=p99, reachable=reachable)

    def _clamp(self, n: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, n))

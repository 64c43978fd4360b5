"""Built-in routing policies: smooth weighted round robin and least loaded.

Both are deterministic given their inputs, so tests assert exact sequences.
Round robin uses nginx's smooth weighted algorithm: every pick adds each
candidate's weight to its running score, takes the highest, and subtracts the
total from the winner; weights 5:1:1 give ``a a b a c a a`` rather than bursts.
Least loaded picks the smallest ``in_flight / weight`` and breaks ties in
rotation so equal backends share the load.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import BackendView, RouteRequest

__all__ = ["LeastLoaded", "RoundRobin"]


class RoundRobin:
    """Smooth weighted round robin over the candidates of each call."""

    name = "round_robin"

    def __init__(self) -> None:
        self._score: dict[str, float] = {}

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if not candidates:
            return None
        names = {c.name for c in candidates}
        # Forget backends that left, so a returning one starts fresh.
        self._score = {n: s for n, s in self._score.items() if n in names}
        total = 0.0
        for c in candidates:
            self._score[c.name] = self._score.get(c.name, 0.0) + c.weight
            total += c.weight
        # Highest score wins; on a tie the earlier candidate does.
        best = max(range(len(candidates)), key=lambda i: (self._score[candidates[i].name], -i))
        name = candidates[best].name
        self._score[name] -= total
        return name


class LeastLoaded:
    """Fewest in-flight requests per unit of weight; ties rotate."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if not candidates:
            return None
        load = min(c.in_flight / c.weight for c in candidates)
        tied = sorted(c.name for c in candidates if c.in_flight / c.weight == load)
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice


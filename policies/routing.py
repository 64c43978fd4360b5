"""Built-in routing policies without cache state: round robin, least loaded, power of two.

Both are deterministic given their inputs, so tests assert exact sequences.
Round robin uses nginx's smooth weighted algorithm: every pick adds each
candidate's weight to its running score, takes the highest, and subtracts the
total from the winner; weights 5:1:1 give ``a a b a c a a`` rather than bursts.
Least loaded picks the smallest ``in_flight / weight`` and breaks ties in
rotation so equal backends share the load. Power of two draws two distinct
candidates at random (from its own seeded generator, so a seed replays the
same picks) and takes the less loaded: nearly least-loaded balance without
every router herding onto the same minimum (Mitzenmacher).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import BackendView, RouteRequest

__all__ = ["LeastLoaded", "PowerOfTwo", "RoundRobin"]


class RoundRobin:
    """Smooth weighted round robin over the candidates of each call."""

    name = "round_robin"

    def __init__(self) -> None:
        self._score: dict[str, float] = {}
        self._names: list[str] = []  # the last call's candidates: the scores' keys are exactly these

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if not candidates:
            return None
        names = [c.name for c in candidates]
        score = self._score
        if names != self._names:  # forget backends that left, so a returning one starts fresh
            keep = set(names)
            score = self._score = {n: s for n, s in score.items() if n in keep}
            self._names = names
        weights = [c.weight for c in candidates]
        get = score.get
        for n, w in zip(names, weights, strict=True):
            score[n] = get(n, 0.0) + w
        scores = [score[n] for n in names]
        # Highest score wins; on a tie the earlier candidate does.
        name = names[scores.index(max(scores))]
        score[name] -= sum(weights, 0.0)
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



class PowerOfTwo:
    """Two random candidates, the less loaded (per unit of weight) of them."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if len(candidates) < 2:
            return candidates[0].name if candidates else None
        a, b = self._random.sample(range(len(candidates)), 2)
        ca, cb = candidates[a], candidates[b]
        return (cb if cb.in_flight / cb.weight < ca.in_flight / ca.weight else ca).name

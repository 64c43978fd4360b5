"""Cost-aware placement: which of a group's candidate backends a request
may go to, by its class and the backends' tags (sans-I/O).

Backends tagged ``preemptible = true`` or ``pool = "batch"`` in config are
the cheap, interruptible capacity (spot instances, a batch pool):

    batch work (engine priority < 0)  ──> the tagged candidates, when any is a
                                          candidate; else every candidate
    other work, interactive_avoids on ──> the untagged candidates, when any;
                                          else every candidate (never refused)
    other work, interactive_avoids off ─> every candidate

The routing policy then picks among what is left, so prefix affinity still
holds inside the pool. A tagged backend that is preempted (killed) fails its
streams: the dispatcher retries them before the first token, or migrates
them after it; a batch item that still fails is requeued by the job runner,
and completes once (its job's transition table).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

__all__ = ["Named", "Placement"]


class Named(Protocol):
    @property
    def name(self) -> str: ...


A = TypeVar("A", bound=Named)


class Placement:
    def __init__(self, tagged: Iterable[str], *, interactive_avoids: bool = False) -> None:
        self.tagged = frozenset(tagged)
        self.interactive_avoids = interactive_avoids

    def filter(self, candidates: Sequence[A], priority: int) -> Sequence[A]:
        """The candidates a request of engine ``priority`` should go to."""
        if not self.tagged:
            return candidates
        if priority < 0:
            cheap = [c for c in candidates if c.name in self.tagged]
            return cheap or candidates
        if self.interactive_avoids:
            kept = [c for c in candidates if c.name not in self.tagged]
            return kept or candidates
        return candidates

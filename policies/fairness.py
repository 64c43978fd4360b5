"""The order of waiting requests: strict priority with aging between classes,
weighted fair sharing in tokens between tenants within a class. Sans-I/O.

::

    push(item)                       one FIFO per (class, tenant)
    pop(now) ──> the head with the least (effective class, served[tenant], arrival)
                 effective class = class - floor(waited / aging)   (batch -> default -> interactive)
                 served[tenant] += cost / weight                   (prompt tokens, on leaving)
    charge(tenant, weight, tokens)   served[tenant] += tokens / weight (generated, as they stream)

``served`` is each tenant's weighted service in tokens: a virtual clock in the
manner of virtual-time fair queueing (Zhang's VirtualClock, start-time fair
queueing). Picking the backlogged tenant with the least of it gives tenants
shares of the tokens in proportion to their weights, whatever the sizes of
their requests. A tenant that was idle starts again at the virtual time of
the last request served (the largest ``served`` seen at a pop), so idleness
banks no credit. Charging generated tokens as they stream means a tenant of
long answers falls back behind one of short ones while its answers run,
not only after.

Aging promotes a request one class for each ``aging`` seconds it waited, so a
batch request waits at most ``2 * aging`` before it competes as interactive,
and then at most one round of the tenants (it wins on ``served`` against
every tenant that was served meanwhile). Strict priority otherwise: a lower class never goes while a higher
(effective) one waits.

A pop looks at every (class, tenant) head: O(classes x backlogged tenants),
tens in practice; the router pops once per freed slot. ``admissible`` skips
heads that may not take the slot on offer (below).

Slots, not only order: a queue orders who goes *next*, but a tenant that
holds every backend slot with long streams still makes a quiet tenant wait
for the next stream to end, and batch streams that hold every slot make an
interactive request wait for one of them. :class:`SlotShares` keeps the last
``reserve`` free slots of a group for the flows (a tenant's requests of one
class) that need them::

    share(f)  = capacity x weight(f) / sum of the weights of the active flows of f's class
    a flow may not take one of the last ``reserve`` free slots when
      a higher class was active lately (those slots are the higher class's), or
      it holds at least its share (a flow holding nothing is never held back)

"Active lately" is holding or waiting for a slot, or having asked within
``window`` seconds, so a tenant that sends one request at a time still
counts between its requests. A lone flow's share is the whole capacity:
with nobody else about, nothing is held back. The price is at most
``reserve`` idle slots while a light flow, or a higher class, is about and
not using them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import msgspec

__all__ = ["CLASSES", "FairQueue", "QueuePolicy", "SlotShares", "Waiting", "rank_of"]

CLASSES = ("interactive", "default", "batch")  # rank 0 first


def rank_of(priority_class: str) -> int:
    """0 for interactive, 1 default, 2 batch."""
    return CLASSES.index(priority_class)


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """One waiting request as the queue policy sees it."""

    id: int
    tenant: str
    rank: int  # index into CLASSES
    arrival: float
    weight: float = 1.0
    cost: int = 0  # tokens charged when it leaves the queue (its prompt)


@runtime_checkable
class QueuePolicy(Protocol):
    """Holds waiting requests and says which goes next."""

    def push(self, item: Waiting, now: float) -> None: ...

    def pop(self, now: float, admissible: Callable[[Waiting], bool] | None = None) -> Waiting | None: ...

    def remove(self, item_id: int) -> bool: ...

    def charge(self, tenant: str, weight: float, tokens: int, now: float) -> None: ...

    def depth(self, rank: int | None = None) -> int: ...


class FairQueue:
    """Strict priority with aging; within a class, the tenant with the least
    weighted service in tokens first (FIFO within one tenant and class)."""

    def __init__(self, aging: float = 10.0) -> None:
        if aging < 0:
            raise ValueError(f"aging must be >= 0 (0: no aging), not {aging}")
        self.aging = aging
        self._queues: dict[tuple[int, str], deque[Waiting]] = {}
        self._where: dict[int, tuple[int, str]] = {}
        self._backlog: dict[str, int] = {}  # waiting requests per tenant
        self._served: dict[str, float] = {}
        self._vtime = 0.0

    def push(self, item: Waiting, now: float) -> None:
        if item.id in self._where:
            raise ValueError(f"request {item.id} is already waiting")
        if not 0 <= item.rank < len(CLASSES):
            raise ValueError(f"rank {item.rank} is not a class (0..{len(CLASSES) - 1})")
        if not self._backlog.get(item.tenant):
            self._served[item.tenant] = max(self._served.get(item.tenant, 0.0), self._vtime)
        key = (item.rank, item.tenant)
        self._queues.setdefault(key, deque()).append(item)
        self._where[item.id] = key
        self._backlog[item.tenant] = self._backlog.get(item.tenant, 0) + 1

    def effective_rank(self, item: Waiting, now: float) -> int:
        if self.aging == 0:
            return item.rank
        return max(0, item.rank - math.floor(max(0.0, now - item.arrival) / self.aging))

    def peek(self, now: float, admissible: Callable[[Waiting], bool] | None = None) -> Waiting | None:
        """The next to go: of the heads ``admissible`` lets through (all by default)."""
        best: Waiting | None = None
        best_key: tuple[int, float, float, int] | None = None
        for queue in self._queues.values():
            head = queue[0]
            if admissible is not None and not admissible(head):
                continue
            key = (self.effective_rank(head, now), self._served[head.tenant], head.arrival, head.id)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def pop(self, now: float, admissible: Callable[[Waiting], bool] | None = None) -> Waiting | None:
        item = self.peek(now, admissible)
        if item is None:
            return None
        self._take(item)
        self._vtime = max(self._vtime, self._served[item.tenant])
        self._served[item.tenant] += item.cost / item.weight
        return item

    def remove(self, item_id: int) -> bool:
        """Take a request out (it timed out or its client left); False if it is not waiting."""
        key = self._where.get(item_id)
        if key is None:
            return False
        item = next(i for i in self._queues[key] if i.id == item_id)
        self._take(item)
        return True

    def _take(self, item: Waiting) -> None:
        key = self._where.pop(item.id)
        queue = self._queues[key]
        queue.remove(item)
        if not queue:
            del self._queues[key]
        self._backlog[item.tenant] -= 1
        if not self._backlog[item.tenant]:
            del self._backlog[item.tenant]

    def charge(self, tenant: str, weight: float, tokens: int, now: float) -> None:
        self._served[tenant] = self._served.get(tenant, self._vtime) + tokens / weight

    def ahead_of(self, tenant: str, rank: int, weight: float = 1.0) -> int:
        """About how many waiting requests would leave before one more of
        ``tenant`` at ``rank``: every one of a higher class, the tenant's own
        of its class, and of each other tenant of its class its weighted
        share of that (strict priority, then weighted fair sharing; aging
        and token sizes ignored). What a wait estimate should count: a quiet
        tenant behind a flood's hundred waiting requests is next, not 101st."""
        own = len(self._queues.get((rank, tenant), ()))
        ahead = own
        for (r, t), queue in self._queues.items():
            if r < rank:
                ahead += len(queue)
            elif r == rank and t != tenant:
                ahead += min(len(queue), math.ceil((own + 1) * queue[0].weight / weight))
        return ahead

    def served(self, tenant: str) -> float:
        return self._served.get(tenant, 0.0)

    def depth(self, rank: int | None = None) -> int:
        if rank is None:
            return len(self._where)
        return sum(len(q) for (r, _), q in self._queues.items() if r == rank)

    def __len__(self) -> int:
        return len(self._where)


class SlotShares:
    """Who holds a group's slots, who asked lately, and what a flow (a
    tenant's requests of one class) may take (see the module docstring).
    Sans-I/O: the caller passes ``now``."""

    def __init__(self, window: float = 10.0, reserve: int = 1) -> None:
        if window < 0 or reserve < 0:
            raise ValueError(f"window and reserve must be >= 0, not {window}, {reserve}")
        self.window, self.reserve = window, reserve
        self.held: dict[tuple[str, int], int] = {}
        self._seen: dict[tuple[str, int], tuple[float, float]] = {}  # flow -> (last asked, weight)
        self._waiting: dict[tuple[str, int], int] = {}

    def asked(self, tenant: str, rank: int, weight: float, now: float) -> None:
        self._seen[(tenant, rank)] = (now, weight)

    def wait(self, tenant: str, rank: int, delta: int) -> None:
        """``delta`` requests of the flow started (+) or stopped (-) waiting."""
        _add(self._waiting, (tenant, rank), delta)

    def take(self, tenant: str, rank: int, slots: int) -> None:
        _add(self.held, (tenant, rank), slots)

    def give(self, tenant: str, rank: int, slots: int) -> None:
        _add(self.held, (tenant, rank), -slots)

    def _active(self, now: float) -> dict[tuple[str, int], float]:
        """Flows holding or waiting for a slot, or that asked within the window: their weights."""
        active: dict[tuple[str, int], float] = {}
        for flow, (at, weight) in list(self._seen.items()):
            if flow in self.held or flow in self._waiting or now - at <= self.window:
                active[flow] = weight
            else:
                del self._seen[flow]  # gone quiet: forgotten (idleness banks nothing)
        return active

    def share(self, tenant: str, rank: int, capacity: int, now: float) -> float:
        """The flow's weighted share of ``capacity`` among the active flows of
        its class (itself counted as active). O(flows seen lately)."""
        active = self._active(now)
        own = self._seen.get((tenant, rank), (0.0, 1.0))[1]
        total = own + sum(w for (t, r), w in active.items() if r == rank and t != tenant)
        return capacity * own / total

    def reserved(self, tenant: str, rank: int, capacity: int, now: float) -> int:
        """Free slots the flow may not take now: ``reserve`` (at most half
        the capacity) when a higher class was active lately, or when it
        holds at least its share of its own class; else none."""
        reserve = min(self.reserve, capacity // 2)  # never most of a small group
        if reserve == 0:
            return 0
        if any(r < rank for _, r in self._active(now)):
            return reserve
        held = self.held.get((tenant, rank), 0)
        return reserve if held > 0 and held >= self.share(tenant, rank, capacity, now) else 0


def _add(counts: dict[tuple[str, int], int], key: tuple[str, int], delta: int) -> None:
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)

"""What a backend of known capacity will still hold when a request reaches it:
a model of its LRU prefix cache, run ahead of its KV events.

The KV index (:mod:`policies.kv_index`) says what a backend held when it
sent its last event. By the time the next request's prefill looks its
prompt up there, the requests sent before it (still queued, or prefilled
since but not yet reported) have stored their own blocks and evicted the
least recently used ones; an index that learns of those evictions after the
fact predicts hits that are gone (on the cache benchmark with 400-block
caches, 137 of 600 predictions were over the backend's count, none under).
For a backend that says how many blocks it caches (``kv_capacity_blocks``
in ``/v1/models``, :attr:`BackendView.cache_blocks`), this model replays, in
the order sent (the order a backend prefills in), what each prompt sent
there does to an LRU of that capacity::

    send(prompt)  its blocks become the most recently used (its head last,
                  so a chain is evicted from its tail), new ones are added,
                  and the least recently used go past the capacity
    stored event  a block the model does not hold (other routers' traffic,
                  output blocks) joins it, unless the model evicted it itself
                  and the backend's removal is still on its way
    removed event a block the model still holds leaves it; one it evicted
                  already is confirmed
    cleared       everything goes

The policy then counts a backend as holding the leading blocks of a request
that both the index (or its record of recent prefills) and this model say it
holds: the model only takes away predicted hits, never adds one, so what a
backend shares between concurrent prefills stays the index's call.

Sans-I/O, no clock. Memory: one ordered dict entry per modelled block; the
capacities modelled sum to at most ``max_blocks`` (a backend that would pass
it is not modelled, and predictions for it stay the index's).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from policies.base import KVEventView

__all__ = ["CacheModel"]


class CacheModel:
    """Per backend of known capacity, an LRU of block hashes driven by what is sent there."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}  # least recently used first
        self._gone: dict[str, OrderedDict[int, None]] = {}  # evicted here; the backend's removal not seen yet
        self._capacity: dict[str, int] = {}
        self._modelled = 0  # sum of _capacity
        self.evictions = 0  # predicted

    def capacity(self, backend: str, blocks: int | None, held: Iterable[int] = ()) -> bool:
        """Model ``backend`` as caching at most ``blocks`` blocks (``None``:
        unknown, so not modelled), starting from the blocks ``held`` it is
        known to hold (the index's; their order unknown, they count as the
        least recently used). False when it is not modelled (unknown, or its
        capacity would take the modelled total past ``max_blocks``)."""
        old = self._capacity.get(backend)
        if blocks == old:
            return old is not None
        if blocks is None or blocks < 1 or self._modelled - (old or 0) + blocks > self.max_blocks:
            self.forget(backend)
            return False
        self._capacity[backend] = blocks
        self._modelled += blocks - (old or 0)
        if backend not in self._lru:
            self._lru[backend] = OrderedDict.fromkeys(held)
            self._gone[backend] = OrderedDict()
        self._trim(backend)
        return True

    @property
    def active(self) -> bool:
        """Whether any backend is modelled."""
        return bool(self._capacity)

    def modelled(self, backend: str) -> bool:
        return backend in self._capacity

    def capacity_of(self, backend: str) -> int | None:
        return self._capacity.get(backend)

    def forget(self, backend: str) -> None:
        """Stop modelling ``backend`` (capacity unknown, or it is gone)."""
        self._modelled -= self._capacity.pop(backend, 0)
        self._lru.pop(backend, None)
        self._gone.pop(backend, None)

    def reset(self, backend: str) -> None:
        """Its cache is unknown again (a restart, an event gap): empty, capacity kept."""
        if backend in self._lru:
            self._lru[backend].clear()
            self._gone[backend].clear()

    def send(self, backend: str, hashes: Sequence[int]) -> None:
        """A prompt whose full blocks hash to ``hashes`` was sent to ``backend``."""
        lru = self._lru.get(backend)
        if lru is None or not hashes:
            return
        rev = hashes[::-1]
        fresh = [h for h in rev if h not in lru]
        if fresh:
            lru.update(dict.fromkeys(fresh))
        deque(map(lru.move_to_end, rev), maxlen=0)  # in C; the head last: the most recently used
        if fresh:
            self._trim(backend)

    def _trim(self, backend: str) -> None:
        lru, cap = self._lru[backend], self._capacity[backend]
        over = len(lru) - cap
        if over <= 0:
            return
        gone, pop = self._gone[backend], lru.popitem
        gone.update(dict.fromkeys([pop(last=False)[0] for _ in range(over)]))
        self.evictions += over
        while len(gone) > cap:  # removals that never came: the backend kept those, or lost track
            gone.popitem(last=False)

    def apply(self, backend: str, events: Iterable[KVEventView]) -> None:
        """The backend's own events, in order (see the module docstring)."""
        lru = self._lru.get(backend)
        if lru is None:
            return
        gone = self._gone[backend]
        added = False
        for event in events:
            if event.kind == "stored":
                for h in reversed(event.block_hashes):
                    if h not in lru and h not in gone:
                        lru[h] = None
                        added = True
            elif event.kind == "removed":
                for h in event.block_hashes:
                    if h in gone:  # an eviction the model predicted, confirmed
                        del gone[h]
                    else:
                        lru.pop(h, None)
            else:  # cleared
                lru.clear()
                gone.clear()
        if added:
            self._trim(backend)

    def held(self, backend: str, hashes: Sequence[int], blocks: int) -> int:
        """Of the first ``blocks`` of ``hashes`` (what the index says
        ``backend`` holds), how many it will still hold: all of them for a
        backend not modelled. The model evicts a chain from its tail, so
        what it holds of one is a prefix, found by binary search."""
        lru = self._lru.get(backend)
        if lru is None or blocks <= 0:
            return blocks
        if hashes[blocks - 1] in lru:
            return blocks
        if hashes[0] not in lru:
            return 0
        ok, bad = 0, blocks - 1  # hashes[ok] held, hashes[bad] not
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if hashes[mid] in lru:
                ok = mid
            else:
                bad = mid
        return ok + 1

    def blocks(self, backend: str) -> int:
        """Blocks the model says ``backend`` holds (0: none, or not modelled)."""
        lru = self._lru.get(backend)
        return len(lru) if lru is not None else 0

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
                  output blocks, or one the model evicted before the backend
                  did: its removal follows) joins it as the most recent
    removed event the block leaves it
    cleared       everything goes

The policy then counts a backend as holding the leading blocks of a request
that both the index (or its record of recent prefills) and this model say it
holds: the model only takes away predicted hits, never adds one, so what a
backend shares between concurrent prefills stays the index's call.

Sans-I/O, no clock. Block by block, an LRU costs a dict operation or two
per block of every prompt sent (a re-insert per touch: 100-250 us for a
2k-token prompt on a 2-core VM, and an OrderedDict, whose move_to_end is
cheaper, is tracked by the cyclic collector: millions of entries made its
full collections the decision's p99). So the order is kept by *runs*: each
prompt sent is one run (its hashes, in the order it was sent), and each
block maps to the last run that touched it (one C-level dict update per
prompt). The least recently used blocks are the live blocks (those whose
last run it is) of the oldest run, tail first: exactly the order of an LRU
whose prompts touch their head last. A prompt is queued by :meth:`send` and
applied by :meth:`flush`, from the policy's later feedback or before
anything reads that backend, so the routing decision does not wait for it.
Memory: one dict entry per modelled block, plus the runs not yet evicted,
which keep the requests' own hash tuples alive (compacted when they refer
to more than 4x the live blocks: at most ~5 references and hash ints per
modelled block, ~200 bytes, so ~400 MB at the default 2M); the capacities
modelled sum to at most ``max_blocks`` (a backend that would pass it is not
modelled, and predictions for it stay the index's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

from policies.base import KVEventView

__all__ = ["CacheModel"]


class _Cache:
    """One backend's model: live blocks -> their last run, and the runs, oldest first."""

    __slots__ = ("blocks", "capacity", "next_run", "run_blocks", "runs", "sent")

    def __init__(self, capacity: int, held: Iterable[int]) -> None:
        self.capacity = capacity
        seed = tuple(held)
        self.blocks: dict[int, int] = dict.fromkeys(seed, 0)  # a dict of ints: not tracked by the collector
        # [run, its hashes (head first), how many of them from the head are not scanned yet]
        self.runs: deque[list[Any]] = deque([[0, seed, len(seed)]] if seed else ())
        self.run_blocks = len(seed)  # hashes referenced by runs, live or not
        self.next_run = 1
        self.sent: list[Sequence[int]] = []  # queued by send, applied by flush

    def touch(self, hashes: Sequence[int]) -> None:
        """A run of ``hashes`` (a chain, head first): all of them the most recent, the head last."""
        run = self.next_run
        self.next_run = run + 1
        self.blocks.update(zip(hashes, repeat(run)))
        self.runs.append([run, hashes, len(hashes)])
        self.run_blocks += len(hashes)

    def trim(self) -> int:
        """Evict past the capacity, least recently used first; returns how
        many. Each run is scanned from its tail once over its life (a block
        passed over was touched again since, or is gone, and stays so: run
        numbers only grow), so eviction costs O(1) per block sent."""
        blocks, runs = self.blocks, self.runs
        over = len(blocks) - self.capacity
        evicted = 0
        while over > 0 and runs:
            entry = runs[0]
            run, hashes, i = entry
            get = blocks.get
            while i and over:
                i -= 1
                h = hashes[i]
                if get(h) == run:
                    del blocks[h]
                    over -= 1
                    evicted += 1
            if i:
                entry[2] = i  # the rest of it is still the oldest
            else:
                runs.popleft()
                self.run_blocks -= len(hashes)
        if self.run_blocks > 4 * len(blocks) + 4096:  # runs every block of which was touched again since
            get = blocks.get
            self.runs = deque(r for r in runs if any(get(h) == r[0] for h in r[1][: r[2]]))
            self.run_blocks = sum(len(r[1]) for r in self.runs)
        return evicted


class CacheModel:
    """Per backend of known capacity, an LRU of block hashes driven by what is sent there."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._caches: dict[str, _Cache] = {}
        self._dirty: set[str] = set()  # backends with sends queued
        self._modelled = 0  # sum of the capacities
        self.evictions = 0  # predicted

    @property
    def active(self) -> bool:
        """Whether any backend is modelled."""
        return bool(self._caches)

    def modelled(self, backend: str) -> bool:
        return backend in self._caches

    def capacity_of(self, backend: str) -> int | None:
        cache = self._caches.get(backend)
        return cache.capacity if cache is not None else None

    def capacity(self, backend: str, blocks: int | None, held: Iterable[int] = ()) -> bool:
        """Model ``backend`` as caching at most ``blocks`` blocks (``None``:
        unknown, so not modelled), starting from the blocks ``held`` it is
        known to hold (the index's; their order unknown, they count as the
        least recently used). False when it is not modelled (unknown, or its
        capacity would take the modelled total past ``max_blocks``)."""
        cache = self._caches.get(backend)
        old = cache.capacity if cache is not None else None
        if blocks == old:
            return old is not None
        if blocks is None or blocks < 1 or self._modelled - (old or 0) + blocks > self.max_blocks:
            self.forget(backend)
            return False
        self._modelled += blocks - (old or 0)
        if cache is None:
            cache = self._caches[backend] = _Cache(blocks, held)
        cache.capacity = blocks
        self.evictions += cache.trim()
        return True

    def forget(self, backend: str) -> None:
        """Stop modelling ``backend`` (capacity unknown, or it is gone)."""
        cache = self._caches.pop(backend, None)
        if cache is not None:
            self._modelled -= cache.capacity
        self._dirty.discard(backend)

    def reset(self, backend: str) -> None:
        """Its cache is unknown again (a restart, an event gap): empty, capacity kept."""
        if backend in self._caches:
            self._caches[backend] = _Cache(self._caches[backend].capacity, ())
            self._dirty.discard(backend)

    def send(self, backend: str, hashes: Sequence[int]) -> None:
        """A prompt whose full blocks hash to ``hashes`` was sent to
        ``backend`` (queued: see the module docstring)."""
        cache = self._caches.get(backend)
        if hashes and cache is not None:
            cache.sent.append(hashes)
            self._dirty.add(backend)

    def flush(self, backend: str | None = None) -> None:
        """Apply the prompts sent to ``backend`` (``None``: to every backend), in order."""
        if not self._dirty:
            return
        names = list(self._dirty) if backend is None else [backend] if backend in self._dirty else []
        for name in names:
            self._dirty.discard(name)
            cache = self._caches[name]
            sent, cache.sent = cache.sent, []
            for hashes in sent:
                cache.touch(hashes)
            self.evictions += cache.trim()

    def apply(self, backend: str, events: Iterable[KVEventView]) -> None:
        """The backend's own events, in order (see the module docstring)."""
        cache = self._caches.get(backend)
        if cache is None:
            return
        self.flush(backend)  # what was sent before these arrived
        for event in events:
            blocks = cache.blocks
            if event.kind == "stored":
                new = [h for h in event.block_hashes if h not in blocks]
                if new:
                    cache.touch(new)
            elif event.kind == "removed":
                deque(map(blocks.pop, event.block_hashes, repeat(None)), maxlen=0)
            else:  # cleared
                self._caches[backend] = cache = _Cache(cache.capacity, ())
        self.evictions += cache.trim()

    def held(self, backend: str, hashes: Sequence[int], blocks: int) -> int:
        """Of the first ``blocks`` of ``hashes`` (what the index says
        ``backend`` holds), how many it will still hold: all of them for a
        backend not modelled. The model evicts a chain from its tail, so
        what it holds of one is a prefix, found by binary search."""
        cache = self._caches.get(backend)
        if blocks <= 0 or cache is None:
            return blocks
        if cache.sent:
            self.flush(backend)
        live = cache.blocks
        if hashes[blocks - 1] in live:
            return blocks
        if hashes[0] not in live:
            return 0
        ok, bad = 0, blocks - 1  # hashes[ok] held, hashes[bad] not
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if hashes[mid] in live:
                ok = mid
            else:
                bad = mid
        return ok + 1

    def blocks(self, backend: str) -> int:
        """Blocks the model says ``backend`` holds (0: none, or not modelled)."""
        self.flush(backend)
        cache = self._caches.get(backend)
        return len(cache.blocks) if cache is not None else 0

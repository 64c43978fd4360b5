"""The mock's prefix-cache cost model: a bounded LRU of KV block hashes that
publishes KV events in the engine's format.

``headrace mock --block-size 16 --cache-blocks N --prefill-ms-per-token X``
turns it on. A mock replica then models one accelerator::

    request ──ttft_s──> prefill lane (one at a time; higher priority, then FIFO) ──> first token ──tpot_s──> ...
                         │ lookup: leading cached blocks     (cached_tokens in usage)
                         │ sleep uncached_tokens x prefill_s_per_token
                         └ store the prompt's full blocks ──> KV events (stored / removed)

- **Keys.** The prompt's token ids (the mock's ids are its bytes) are cut into
  full blocks and hashed with :func:`backends.base.chain_hashes`, the
  engine's chained hash, so a router computing hashes from the same ids gets
  the same keys.
- **Lookup.** The longest run of leading blocks present, capped, as the
  engine caps it, at ``(len(prompt) - 1) // block_size`` blocks so the last
  token is always computed.
- **LRU.** One LRU over every stored block (running sequences do not pin
  theirs: a simplification). A prompt's blocks are touched tail first, so its
  head is the most recently used and a chain is evicted from its tail, never
  cut at its root (the engine frees tail first for the same reason).
- **Events.** ``stored`` (one event per store, the new hashes in order, with
  the parent of the first) and ``removed`` (the hashes evicted by that store),
  ``seq`` consecutive from 1; the last 10,000 are kept for ``since=`` resumes,
  as the engine keeps them.

The class is sans-I/O (no trio, no clock): :class:`backends.mock.MockBackend`
paces it in time, and the simulator (``sim.model``) reuses it as its
backends' cache, so the two model the same thing.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence

import msgspec

from backends.base import KVEvent

__all__ = ["KV_EVENT_HISTORY", "PrefixCache", "PrefixCacheStatistics"]

KV_EVENT_HISTORY = 10_000  # as backends.engine.backend keeps


class PrefixCacheStatistics(msgspec.Struct, frozen=True, kw_only=True):
    capacity_blocks: int
    block_size: int
    cached_blocks: int
    lookups: int
    query_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of which served from the cache
    evictions: int
    last_seq: int  # the last KV event's seq (0: none yet)


class PrefixCache:
    """A bounded LRU of block hashes; :meth:`store` returns the KV events it caused."""

    def __init__(self, capacity_blocks: int, block_size: int, *,
                 history: int = KV_EVENT_HISTORY) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be >= 1")
        self.capacity, self.block_size = capacity_blocks, block_size
        self._lru: OrderedDict[int, None] = OrderedDict()  # head: evicted first
        self.seq = 0
        # Kept for since= resumes; history=0 keeps none (the simulator).
        self.events: deque[KVEvent] = deque(maxlen=history)
        self._lookups = self._query = self._hits = self._evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Cached tokens of a prompt of ``prompt_tokens`` tokens whose full
        blocks hash to ``hashes``: the leading blocks present, capped so the
        last token is computed. Counts the lookup; does not touch the LRU."""
        cap = min(len(hashes), (prompt_tokens - 1) // self.block_size) if prompt_tokens else 0
        lru, n = self._lru, 0
        while n < cap and hashes[n] in lru:
            n += 1
        cached = n * self.block_size
        self._lookups += 1
        self._query += prompt_tokens
        self._hits += cached
        return cached

    def store(self, hashes: Sequence[int]) -> list[KVEvent]:
        """Cache the chain ``hashes`` (a prompt's full blocks, in order): the
        new ones are added, all are touched (head last, so most recent), and
        the LRU's head is evicted past capacity. Returns the events, if any.
        The loops run in C (the simulator stores ~100 blocks per request)."""
        lru, rev = self._lru, tuple(reversed(hashes))
        fresh = [h for h in rev if h not in lru]
        if not fresh:
            deque(map(lru.move_to_end, rev), maxlen=0)
            return []
        lru.update(dict.fromkeys(fresh))
        deque(map(lru.move_to_end, rev), maxlen=0)
        fresh.reverse()
        first = hashes.index(fresh[0])
        events = [self._event("stored", tuple(fresh), hashes[first - 1] if first else None)]
        over = len(lru) - self.capacity
        if over > 0:
            pop = lru.popitem
            evicted = tuple([pop(last=False)[0] for _ in range(over)])
            self._evictions += over
            events.append(self._event("removed", evicted, None))
        return events

    def clear(self) -> list[KVEvent]:
        """Forget everything (a restart of the cache): one ``cleared`` event."""
        self._lru.clear()
        return [self._event("cleared", (), None)]

    def contents(self) -> list[int]:
        """Every cached hash, least recently used first."""
        return list(self._lru)

    def _event(self, kind: str, hashes: tuple[int, ...], parent: int | None) -> KVEvent:
        self.seq += 1
        event = KVEvent(seq=self.seq, kind=kind, block_hashes=hashes, parent_hash=parent)  # type: ignore[arg-type]
        self.events.append(event)
        return event

    def since(self, seq: int) -> list[KVEvent]:
        """Kept events with ``seq`` above ``seq`` (consecutive, so an index)."""
        kept = self.events
        if not kept or kept[-1].seq <= seq:
            return []
        start = max(0, seq + 1 - kept[0].seq)
        return list(itertools.islice(kept, start, None))

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            capacity_blocks=self.capacity, block_size=self.block_size,
            cached_blocks=len(self._lru), lookups=self._lookups, query_tokens=self._query,
            hit_tokens=self._hits, evictions=self._evictions, last_seq=self.seq,
        )

"""Which backend holds which KV blocks: an exact index from engine events and a
TTL record of what the router sent where, both bounded.

Both map a block hash to a bit mask of backend slots, so matching a request
against every candidate at once is one walk over the request's block hashes
(each step one dict lookup and an AND), however many backends there are::

    alive = mask of candidates
    for i, h in enumerate(block_hashes):
        holders = owners.get(h, 0) & alive
        backends in alive but not in holders matched exactly i blocks
        alive = holders

:class:`KVIndex` follows each backend's event stream by ``seq``: events must
come in order without holes; a gap (or ``seq`` going backwards: the engine
restarted) drops that backend's entries and asks for a resubscription from
the start (:meth:`KVIndex.since` is -1 again). It holds at most
``max_blocks`` hashes, least recently stored or matched evicted first.

:class:`RecentlySent` is the fallback for backends that publish no events
(and covers the moments between dispatch and an engine's "stored" event):
the blocks of each request sent to a backend, for ``ttl`` seconds.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

import msgspec

from policies.base import KVEventView

__all__ = ["IndexStatistics", "KVIndex", "RecentlySent", "move_to_end_each"]


def move_to_end_each(order: OrderedDict[int, Any], keys: Iterable[int]) -> None:
    """Move each of ``keys`` still in ``order`` to its end, in turn: the
    order that moving each at once (when it was touched) would have given,
    for touches noted on a hot path and replayed later."""
    for key in keys:
        if key in order:
            order.move_to_end(key)


class IndexStatistics(msgspec.Struct, frozen=True, kw_only=True):
    blocks: int  # distinct hashes held
    max_blocks: int
    backends: dict[str, int]  # blocks held per backend
    gaps: int  # event-stream gaps and restarts seen (each dropped a backend's entries)
    evicted: int  # hashes dropped to stay within max_blocks


class _Slots:
    """Backend name <-> bit position."""

    def __init__(self) -> None:
        self.bit: dict[str, int] = {}
        self.names: list[str] = []
        self._masks: dict[tuple[str, ...], int] = {}
        self._last: tuple[tuple[str, ...] | None, int] = (None, 0)

    def of(self, name: str) -> int:
        bit = self.bit.get(name)
        if bit is None:
            bit = self.bit[name] = 1 << len(self.names)
            self.names.append(name)
        return bit

    def mask(self, names: Sequence[str]) -> int:
        if names is self._last[0]:  # the same tuple again (a caller that keeps its candidate set)
            return self._last[1]
        key = tuple(names)
        m = self._masks.get(key)
        if m is None:
            m = 0
            for n in names:
                m |= self.of(n)
            if len(self._masks) >= 64:  # candidate sets recur: keep a few
                self._masks.clear()
            self._masks[key] = m
        if type(names) is tuple:  # immutable: safe to know again by identity
            self._last = (names, m)
        return m

    def members(self, mask: int) -> list[str]:
        """The names of the set bits (one step per set bit, not per slot)."""
        names = self.names
        out = []
        while mask:
            low = mask & -mask
            out.append(names[low.bit_length() - 1])
            mask ^= low
        return out


def _match(owners: dict[int, int] | _Union, slots: _Slots, hashes: Sequence[int], names: Sequence[str]) -> dict[str, int]:
    """Leading blocks of ``hashes`` each of ``names`` holds (absent: none).

    A backend that holds block i of a chain holds blocks 0..i-1 too (an
    engine caches prefixes and evicts tails first; this index evicts them
    first as well), so the set of holders only shrinks along the chain and
    each point where it shrinks is found by binary search: a few lookups per
    distinct match length instead of one per block."""
    alive = slots.mask(names)
    found: dict[str, int] = {}
    get = owners.get
    n = len(hashes)
    lo = 0  # every backend in alive holds hashes[:lo]
    while alive and lo < n:
        if get(hashes[lo], 0) & alive != alive:
            ok, bad = lo - 1, lo  # the run's first block already loses some
        elif get(hashes[n - 1], 0) & alive == alive:
            lo = n
            break
        else:
            ok, bad = lo, n - 1  # hashes[ok] is held by all of alive, hashes[bad] is not
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if get(hashes[mid], 0) & alive == alive:
                ok = mid
            else:
                bad = mid
        held = get(hashes[bad], 0) & alive
        if bad:
            for name in slots.members(alive & ~held):
                found[name] = bad
        alive, lo = held, bad + 1
    if alive:
        for name in slots.members(alive):
            found[name] = n
    return found


class KVIndex:
    """Exact: built from each backend's KV events. Bounded by ``max_blocks``
    distinct hashes; set it above the blocks all engines can hold together
    and the bound is only a safety net (see :meth:`match` on what ages)."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._slots = _Slots()
        self._owners: OrderedDict[int, int] = OrderedDict()  # hash -> mask, LRU first
        # Per backend, the hashes it holds: dicts, not sets (a dict of ints is not
        # tracked by the cyclic collector; a set is, and millions of entries
        # made in it after the router's startup freeze are traversed by every full collection).
        self._held: dict[str, dict[int, None]] = {}
        self._seq: dict[str, int] = {}
        self._gaps = 0
        self._evicted = 0
        # Hashes matches touched, oldest first, not yet moved to the young end
        # of the LRU: a match only notes them (moving one is a few cache
        # misses in a large ordered dict, on the routing decision's path);
        # :meth:`settle` moves them, before anything that reads or changes
        # the order, so the order is the one touching at once gives.
        self._touched: list[int] = []

    def since(self, backend: str) -> int:
        """Where ``backend``'s event stream should resume (-1: from the start)."""
        return self._seq.get(backend, -1)

    def apply(self, backend: str, events: Iterable[KVEventView]) -> bool:
        """Apply events in order; ``False`` (and the backend's entries gone)
        at the first event that does not follow the last one applied."""
        self.settle()
        bit = self._slots.of(backend)
        held = self._held.setdefault(backend, {})
        for event in events:
            last = self._seq.get(backend, -1)
            if last >= 0 and event.seq != last + 1:
                self._gaps += 1
                self.reset(backend)
                return False
            self._seq[backend] = event.seq
            if event.kind == "stored":
                self._store(bit, held, event.block_hashes)
            elif event.kind == "removed":
                self._remove(bit, held, event.block_hashes)
            else:  # cleared
                self._remove(bit, held, list(held))
        return True

    def reset(self, backend: str) -> None:
        """Forget everything about ``backend`` (restart, gap, or it is gone)."""
        self.settle()
        held = self._held.pop(backend, {})
        if backend in self._slots.bit:
            self._remove(self._slots.bit[backend], held, list(held))
        self._seq.pop(backend, None)

    def blocks_of(self, backend: str) -> Iterable[int]:
        """The hashes ``backend`` holds (a live view: do not keep it)."""
        return self._held.get(backend, ())

    def follows(self, backend: str) -> bool:
        """Whether this index has applied events of ``backend`` (and not reset it)."""
        return backend in self._seq

    def match(self, hashes: Sequence[int], names: Sequence[str]) -> dict[str, int]:
        if hashes and hashes[0] not in self._owners:  # a cold prompt: nobody holds its first block
            self._slots.mask(names)  # (the names get their bits as in a full match)
            return {}
        found = _match(self._owners, self._slots, hashes, names)
        if found:
            # Matched chains are hot: their ends and heads move to the young
            # end of the LRU (a head last, so tails go first). Touching every
            # block would cost more than the match; the blocks between only
            # age while the index is at its bound, which it is not when
            # max_blocks covers the fleet's caches.
            touched = self._touched
            lengths = set(found.values())
            if len(lengths) == 1:
                touched.append(hashes[lengths.pop() - 1])
            else:
                touched.extend(hashes[n - 1] for n in sorted(lengths, reverse=True))
            touched.append(hashes[0])
            if len(touched) > 4096:  # nothing settled them lately
                self.settle()
        return found

    def settle(self) -> None:
        """Move the hashes matches touched to the young end of the LRU, in
        the order touched (the policy calls this from its feedback, off the
        decision's path)."""
        if self._touched:
            touched, self._touched = self._touched, []
            move_to_end_each(self._owners, touched)

    def _store(self, bit: int, held: dict[int, None], hashes: Iterable[int]) -> None:
        owners = self._owners
        # Newest last, and a chain's head newest of all: tails are evicted first.
        for h in reversed(tuple(hashes)):
            owners[h] = owners.get(h, 0) | bit
            owners.move_to_end(h)
            held[h] = None
        while len(owners) > self.max_blocks:
            h, mask = owners.popitem(last=False)
            self._evicted += 1
            for name in self._slots.members(mask):
                self._held[name].pop(h, None)

    def _remove(self, bit: int, held: dict[int, None], hashes: Iterable[int]) -> None:
        owners = self._owners
        for h in hashes:
            mask = owners.get(h)
            if mask is None:
                continue
            held.pop(h, None)
            mask &= ~bit
            if mask:
                owners[h] = mask
            else:
                del owners[h]

    def __len__(self) -> int:
        return len(self._owners)

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(
            blocks=len(self._owners),
            max_blocks=self.max_blocks,
            backends={n: len(h) for n, h in self._held.items()},
            gaps=self._gaps,
            evicted=self._evicted,
        )


class RecentlySent:
    """Approximate: the blocks of requests sent to each backend, kept at least
    ``ttl`` seconds after the last send (the router's own record; SGLang's
    approximate tree and Dynamo's ApproxKvIndexer play the same part).

    Records go into generations ``ttl / generations`` seconds wide; a
    generation is dropped whole once its newest possible record is ``ttl``
    old, so expiry costs nothing per block, and an entry lives between ``ttl``
    and ``ttl x (1 + 1 / generations)``. Over ``max_entries`` the oldest
    generations go early (so it holds at most ``max_entries`` plus the
    blocks of one send)."""

    def __init__(self, ttl: float = 120.0, max_entries: int = 1_000_000, generations: int = 4) -> None:
        if ttl <= 0 or max_entries < 1 or generations < 1:
            raise ValueError("ttl, max_entries and generations must be positive")
        self.ttl = ttl
        self.max_entries = max_entries
        self.width = ttl / generations
        self._slots = _Slots()
        # (start, hash -> mask, first hashes), oldest first: the first block of
        # each prompt recorded (a small dict) is what a match looks up first.
        self._gens: deque[tuple[float, dict[int, int], dict[int, None]]] = deque()
        self._expiry = math.inf  # when the oldest generation goes (a look-up per match without touching it)
        self._entries = 0

    def record(self, backend: str, hashes: Iterable[int], now: float) -> None:
        bit = self._slots.of(backend)
        self.expire(now)
        if not self._gens or now >= self._gens[-1][0] + self.width or len(self._gens[-1][1]) >= self.max_entries:
            self._gens.append((now, {}, {}))
        gen = self._gens[-1][1]
        before = len(gen)
        hashes = tuple(hashes)
        if hashes:
            self._gens[-1][2][hashes[0]] = None
        gen.update(zip(hashes, map(bit.__or__, map(gen.get, hashes, repeat(0))), strict=True))  # gen[h] |= bit, in C
        self._entries += len(gen) - before
        while self._entries > self.max_entries and len(self._gens) > 1:
            self._entries -= len(self._gens.popleft()[1])
        self._oldest_changed()

    def expire(self, now: float) -> None:
        if self._expiry > now:
            return
        gens = self._gens
        while gens and gens[0][0] + self.width + self.ttl <= now:
            self._entries -= len(gens.popleft()[1])
        self._oldest_changed()

    def _oldest_changed(self) -> None:
        gens = self._gens
        self._expiry = gens[0][0] + self.width + self.ttl if gens else math.inf

    def forget(self, backend: str) -> None:
        bit = self._slots.bit.get(backend)
        if bit is None:
            return
        for _, gen, _ in self._gens:
            for h in [h for h, mask in gen.items() if mask & bit]:
                if gen[h] == bit:
                    del gen[h]
                    self._entries -= 1
                else:
                    gen[h] &= ~bit

    def match(self, hashes: Sequence[int], names: Sequence[str], now: float) -> dict[str, int]:
        self.expire(now)
        if hashes:
            # Only generations where a prompt began with this one's first
            # block hold any block of its chain (a prompt is recorded from
            # its first block, and a chain's first block is a first block
            # wherever it is recorded), so the small dicts of first blocks
            # say which to look in: none for a new prompt, one most often.
            head = hashes[0]
            gens = [g for _, g, heads in self._gens if head in heads]
            if not gens:
                self._slots.mask(names)
                return {}
        else:
            gens = [g for _, g, _ in self._gens if g]
        if not gens:
            return {}
        if len(gens) == 1:
            return _match(gens[0], self._slots, hashes, names)
        return _match(_Union(gens), self._slots, hashes, names)

    def __len__(self) -> int:
        return self._entries


class _Union:
    """``get`` over several generations at once (the OR of their masks)."""

    __slots__ = ("gens",)

    def __init__(self, gens: list[dict[int, int]]) -> None:
        self.gens = gens

    def get(self, h: int, default: int = 0) -> int:
        mask = default
        for gen in self.gens:
            mask |= gen.get(h, 0)
        return mask

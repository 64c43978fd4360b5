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

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec

from policies.base import KVEventView

__all__ = ["IndexStatistics", "KVIndex", "RecentlySent"]


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

    def of(self, name: str) -> int:
        bit = self.bit.get(name)
        if bit is None:
            bit = self.bit[name] = 1 << len(self.names)
            self.names.append(name)
        return bit

    def mask(self, names: Iterable[str]) -> int:
        m = 0
        for n in names:
            m |= self.of(n)
        return m

    def members(self, mask: int) -> Iterable[str]:
        i = 0
        while mask:
            if mask & 1:
                yield self.names[i]
            mask >>= 1
            i += 1


def _match(owners: dict[int, int], slots: _Slots, hashes: Sequence[int], names: Sequence[str]) -> dict[str, int]:
    """Leading blocks of ``hashes`` each of ``names`` holds (absent: none)."""
    alive = slots.mask(names)
    found: dict[str, int] = {}
    for i, h in enumerate(hashes):
        holders = owners.get(h, 0) & alive
        dropped = alive & ~holders
        if dropped and i:
            for name in slots.members(dropped):
                found[name] = i
        alive = holders
        if not alive:
            return found
    for name in slots.members(alive):
        found[name] = len(hashes)
    return found


class KVIndex:
    """Exact: built from each backend's KV events."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._slots = _Slots()
        self._owners: OrderedDict[int, int] = OrderedDict()  # hash -> mask, LRU first
        self._held: dict[str, set[int]] = {}
        self._seq: dict[str, int] = {}
        self._gaps = 0
        self._evicted = 0

    def since(self, backend: str) -> int:
        """Where ``backend``'s event stream should resume (-1: from the start)."""
        return self._seq.get(backend, -1)

    def apply(self, backend: str, events: Iterable[KVEventView]) -> bool:
        """Apply events in order; ``False`` (and the backend's entries gone)
        at the first event that does not follow the last one applied."""
        bit = self._slots.of(backend)
        held = self._held.setdefault(backend, set())
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
        held = self._held.pop(backend, set())
        if backend in self._slots.bit:
            self._remove(self._slots.bit[backend], held, list(held))
        self._seq.pop(backend, None)

    def backends(self) -> set[str]:
        """The backends whose events this index has applied (and not reset)."""
        return set(self._seq)

    def match(self, hashes: Sequence[int], names: Sequence[str]) -> dict[str, int]:
        found = _match(self._owners, self._slots, hashes, names)
        if found:
            move = self._owners.move_to_end
            for h in hashes[: max(found.values())]:
                move(h)  # matched blocks are hot: evict them last
        return found

    def _store(self, bit: int, held: set[int], hashes: Iterable[int]) -> None:
        owners = self._owners
        for h in hashes:
            owners[h] = owners.get(h, 0) | bit
            owners.move_to_end(h)
            held.add(h)
        while len(owners) > self.max_blocks:
            h, mask = owners.popitem(last=False)
            self._evicted += 1
            for name in self._slots.members(mask):
                self._held[name].discard(h)

    def _remove(self, bit: int, held: set[int], hashes: Iterable[int]) -> None:
        owners = self._owners
        for h in hashes:
            mask = owners.get(h)
            if mask is None:
                continue
            held.discard(h)
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
    """Approximate: the blocks of requests sent to each backend, kept ``ttl``
    seconds after the last send (the router's own record; SGLang's approximate
    tree and Dynamo's ApproxKvIndexer play the same part)."""

    def __init__(self, ttl: float = 120.0, max_entries: int = 1_000_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._slots = _Slots()
        self._owners: dict[int, int] = {}
        # (bit, hash) -> expiry, in expiry order (every entry has the same ttl).
        self._expiry: OrderedDict[tuple[int, int], float] = OrderedDict()

    def record(self, backend: str, hashes: Iterable[int], now: float) -> None:
        bit = self._slots.of(backend)
        expiry, owners = self._expiry, self._owners
        until = now + self.ttl
        for h in hashes:
            key = (bit, h)
            expiry[key] = until
            expiry.move_to_end(key)
            owners[h] = owners.get(h, 0) | bit
        self.expire(now)
        while len(expiry) > self.max_entries:
            self._drop(*expiry.popitem(last=False)[0])

    def expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            key, until = next(iter(expiry.items()))
            if until > now:
                return
            del expiry[key]
            self._drop(*key)

    def forget(self, backend: str) -> None:
        bit = self._slots.bit.get(backend)
        if bit is None:
            return
        for key in [k for k in self._expiry if k[0] == bit]:
            del self._expiry[key]
            self._drop(*key)

    def _drop(self, bit: int, h: int) -> None:
        mask = self._owners.get(h, 0) & ~bit
        if mask:
            self._owners[h] = mask
        else:
            self._owners.pop(h, None)

    def match(self, hashes: Sequence[int], names: Sequence[str], now: float) -> dict[str, int]:
        self.expire(now)
        return _match(self._owners, self._slots, hashes, names)

    def __len__(self) -> int:
        return len(self._expiry)

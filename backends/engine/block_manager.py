"""Paged KV blocks with a prefix cache: which cache slots each sequence owns.

Torch-free: this module only hands out block ids; the runner owns the tensors.

- A sequence's ``block_table[i]`` holds the KV of its tokens
  ``[i * block_size, (i + 1) * block_size)``.
- **Prefix cache.** Once a block is full *and computed* it is registered under a
  chained hash ``hash_block(parent_hash, tokens)``, so a hash names the whole
  prefix up to that block. The block also keeps its tokens and parent hash, so a
  hash collision is caught by comparison, never served. A new sequence reuses the
  longest registered prefix of its full blocks, capped so that at least its last
  token is computed (the model must produce logits for it).
- **Ref counts and lazy eviction.** Blocks shared by several sequences are
  counted; a block whose count drops to zero keeps its hash and waits in an LRU
  of free cached blocks, so a later request can still hit it. New blocks come
  from never-cached free blocks first, then from the LRU head (evicting the hash).
  A sequence is freed tail first, so its tail is evicted before its head.
- **Compact ids.** Never-cached free blocks are handed out lowest id first, so the
  blocks in use and cached stay at the low ids and the KV cache the runner made
  resident (zeroed up to the highest id touched) stays as small as the load. When
  the engine goes idle, :meth:`trim` evicts the free cached blocks past a budget, so
  the runner can hand the memory above it back (``ModelRunner.release_kv``).
- **KV events.** Registration and eviction are recorded as
  :class:`backends.base.KVEvent` with a monotonically increasing ``seq`` for
  KV-aware routers (``drain_events``).

Hashing happens only when a block fills (once per ``block_size`` tokens), so the
per-step cost does not grow with sequence length.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

import msgspec

from backends.base import KVEvent, hash_block
from backends.engine.sequence import Sequence

__all__ = ["BlockManager", "BlockManagerStatistics", "hash_block"]


class _Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManagerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    num_blocks: int
    block_size: int
    num_free: int  # never-cached free blocks plus evictable cached ones
    num_used: int  # referenced by at least one sequence
    num_cached: int  # registered in the prefix cache (used or free)
    usage: float  # num_used / num_blocks
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_evictions: int


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_plain: list[int] = list(range(num_blocks))  # a min-heap: lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: head evicted first
        self._cache: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []
        self._event_seq = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0

    # -- capacity -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup --------------------------------------------------

    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Extend ``seq.block_hashes`` to its first ``num_full_blocks`` full blocks."""
        hashes, toks, bs = seq.block_hashes, seq.token_ids, self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, tuple(toks[i * bs : (i + 1) * bs]))
            hashes.append(parent)

    def lookup(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (not yet taken).

        Capped at ``(len(tokens) - 1) // block_size`` blocks so at least the last
        token is computed. Call before :meth:`allocate` for a sequence with no
        blocks (the hit rate is counted when the allocation succeeds).
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        hits: list[int] = []
        bs, parent = self.block_size, None
        for i in range(max_blocks):
            h = seq.block_hashes[i]
            bid = self._cache.get(h)
            if bid is None:
                break
            b = self._blocks[bid]
            if b.parent_hash != parent or b.token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break  # a hash collision: never serve someone else's KV
            hits.append(bid)
            parent = h
        return hits

    # -- allocation -----------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: Iterable[int] = ()) -> bool:
        hits = list(hits)
        have = len(seq.block_table) + len(hits)
        start = seq.num_computed_tokens + len(hits) * self.block_size
        need = self.blocks_needed(start + num_new_tokens) - have
        taken_from_free = sum(1 for bid in hits if self._blocks[bid].ref_cnt == 0)
        return need <= self.num_free_blocks - taken_from_free

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Give ``seq`` the blocks for ``num_new_tokens`` more tokens, after taking
        the prefix-cache ``hits`` (which advance ``num_computed_tokens``).
        Returns False, changing nothing, when there are not enough free blocks."""
        hits = hits or []
        if not self.can_allocate(seq, num_new_tokens, hits):
            return False
        if self.enable_prefix_caching and not seq.block_table:  # an admission
            self._query_tokens += len(seq.token_ids)
            self._hit_tokens += len(hits) * self.block_size
        for bid in hits:
            self._take(bid)
        if hits:
            seq.block_table.extend(hits)
            n = len(hits) * self.block_size
            seq.num_computed_tokens += n
            seq.num_registered_blocks = len(hits)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._new_block())
        return True

    def _take(self, bid: int) -> None:
        b = self._blocks[bid]
        if b.ref_cnt == 0:
            del self._free_cached[bid]
        b.ref_cnt += 1

    def _new_block(self) -> int:
        if self._free_plain:
            bid = heapq.heappop(self._free_plain)
        else:
            bid, _ = self._free_cached.popitem(last=False)
            self._evict(self._blocks[bid])
        self._blocks[bid].ref_cnt = 1
        return bid

    def _evict(self, b: _Block) -> None:
        h = b.block_hash
        if h is not None and self._cache.get(h) == b.block_id:
            del self._cache[h]
            self._evictions += 1
            self._emit("removed", (h,), None)
        b.block_hash = b.parent_hash = b.token_ids = None

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks, tail first; reset its KV progress."""
        self._release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _release(self, block_ids: Iterable[int]) -> None:
        for bid in block_ids:
            b = self._blocks[bid]
            if b.ref_cnt <= 0:
                raise RuntimeError(f"block {bid} released with ref count {b.ref_cnt}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is not None:
                    self._free_cached[bid] = None
                else:
                    heapq.heappush(self._free_plain, bid)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll ``seq`` back to its first ``num_tokens`` tokens (speculative
        rejection): drop later tokens and release blocks past the end. A shared
        (registered) block cut in the middle is released too and its tokens are
        recomputed, since other sequences may still read it."""
        bs = self.block_size
        del seq.token_ids[num_tokens:]
        full = num_tokens // bs
        del seq.block_hashes[full:]
        keep = self.blocks_needed(num_tokens)
        if (
            keep > full
            and full < len(seq.block_table)
            and self._is_registered(seq.block_table[full])
        ):
            keep = full  # the cut block is in the prefix cache: never write into it
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)
        self._release(reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens, keep * bs)

    def _is_registered(self, block_id: int) -> bool:
        return self._blocks[block_id].block_hash is not None

    # -- registration ---------------------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full, computed blocks to the prefix cache.
        Cheap when no block filled: one comparison."""
        full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if full <= start:
            return
        seq.num_registered_blocks = full
        if not self.enable_prefix_caching:
            return
        self._ensure_hashes(seq, full)
        stored: list[int] = []
        parent = seq.block_hashes[start - 1] if start else None
        first_parent = parent
        bs = self.block_size
        for i in range(start, full):
            h = seq.block_hashes[i]
            b = self._blocks[seq.block_table[i]]
            if b.block_hash is None and h not in self._cache:
                b.block_hash, b.parent_hash = h, parent
                b.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cache[h] = b.block_id
                stored.append(h)
            parent = h
        if stored:
            self._emit("stored", tuple(stored), first_parent)

    # -- events and statistics ------------------------------------------------

    def _emit(self, kind: str, hashes: tuple[int, ...], parent: int | None) -> None:
        if not self.record_events:
            return
        self._event_seq += 1
        self._events.append(
            KVEvent(seq=self._event_seq, kind=kind, block_hashes=hashes, parent_hash=parent)  # type: ignore[arg-type]
        )

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def clear_cache(self) -> int:
        """Forget every free cached block (e.g. after a weight reload); returns how many."""
        n = 0
        while self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)
            self._evict(self._blocks[bid])
            heapq.heappush(self._free_plain, bid)
            n += 1
        if self.record_events:
            self._event_seq += 1
            self._events.append(KVEvent(seq=self._event_seq, kind="cleared"))
        return n

    def trim(self, keep: int) -> int:
        """Evict the free cached blocks with ids from ``keep`` on (the prefix cache kept
        to the blocks below it); returns the high-water mark after: one past the
        highest block id still in use or cached (0 when none is). The blocks from the
        mark on hold nothing anyone can read, so their memory can go."""
        for bid in [b for b in self._free_cached if b >= keep]:
            del self._free_cached[bid]
            self._evict(self._blocks[bid])
            heapq.heappush(self._free_plain, bid)
        live = [b.block_id for b in self._blocks if b.ref_cnt or b.block_hash is not None]
        return 1 + max(live) if live else 0

    def statistics(self) -> BlockManagerStatistics:
        used = self.num_blocks - self.num_free_blocks
        q = self._query_tokens
        return BlockManagerStatistics(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free=self.num_free_blocks,
            num_used=used,
            num_cached=len(self._cache),
            usage=used / self.num_blocks,
            prefix_query_tokens=q,
            prefix_hit_tokens=self._hit_tokens,
            prefix_hit_rate=self._hit_tokens / q if q else 0.0,
            num_evictions=self._evictions,
        )

    # -- introspection for tests ---------------------------------------------

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def cached_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens a registered block holds (``None`` if unregistered)."""
        return self._blocks[block_id].token_ids

    def block_hash_of(self, block_id: int) -> int | None:
        return self._blocks[block_id].block_hash

"""``kv_aware``: send each request where its estimated time to first token is lowest.

For each candidate b the policy knows how many of the request's leading
blocks b holds (from b's KV events when it publishes them, else from what
this router sent it recently), and prices that against b's load as one
continuous estimate, not a threshold switch::

    cached(b)   = matched_blocks(b) x block_size          (text blocks: their share of the prompt)
    prefill(b)  = queued_prefill(b) + prompt_tokens - cached(b)
    ttft(b)     = prefill_s_per_token x prefill(b) + decode_s_per_seq x in_flight(b)

``queued_prefill`` is the uncached prompt tokens this policy sent to b that
have not had their first token yet (or the router's count in the view when no
feedback arrives). The two coefficients are the cost of one prefill token and
how much each running sequence delays a new one (a decode step it shares).

The argmin wins, among candidates under the bounded-load cap of
:mod:`policies.prefix_hash` (so a hot prefix spreads to more replicas instead
of piling up). When no candidate holds any block of the request (a cold
start), or several tie, the order of ``prefix_hash`` decides: the same key
lands on the same backend, so the next request with that prefix finds it
cached.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from policies.base import BackendView, KVEventView, RouteRequest
from policies.kv_index import IndexStatistics, KVIndex, RecentlySent
from policies.prefix_hash import TEXT_BLOCK_TOKENS, PrefixHash, capacity

__all__ = ["KVAware", "KVAwareStatistics"]


class KVAwareStatistics(msgspec.Struct, frozen=True, kw_only=True):
    picks: int
    cold: int  # no candidate held a block: prefix_hash placed it
    hits: int  # the pick holds at least one block of the request
    predicted_cached_tokens: int  # summed over picks
    index: IndexStatistics
    recent_entries: int


class KVAware:
    """Lowest estimated time to first token, from what each backend caches and its load."""

    name = "kv_aware"

    class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        prefill_s_per_token: float = 2e-4  # seconds of prefill per uncached prompt token
        decode_s_per_seq: float = 2e-3  # delay a new request takes per sequence running there
        load_factor: float = 1.25  # bounded-load cap, as prefix_hash
        prefix_tokens: int = 256  # the prefix_hash key for cold starts and ties
        vnodes: int = 160
        max_blocks: int = 1_000_000  # the KV index bound (distinct block hashes)
        recent_ttl_s: float = 120.0  # how long a send counts as cached where no events come
        pending_ttl_s: float = 5.0  # the same for backends with events, until their events arrive

        def __post_init__(self) -> None:
            if self.prefill_s_per_token < 0 or self.decode_s_per_seq < 0:
                raise ValueError("costs must be non-negative")
            if self.recent_ttl_s <= 0 or self.pending_ttl_s <= 0:
                raise ValueError("TTLs must be positive")

    def __init__(self, options: KVAware.Options | None = None) -> None:
        o = self.options = options or KVAware.Options()
        self.index = KVIndex(o.max_blocks)
        self.recent = RecentlySent(o.recent_ttl_s, o.max_blocks)
        self.pending = RecentlySent(o.pending_ttl_s, o.max_blocks)
        self.fallback = PrefixHash(
            PrefixHash.Options(prefix_tokens=o.prefix_tokens, load_factor=o.load_factor, vnodes=o.vnodes)
        )
        self._queued: dict[str, int] = {}  # backend -> uncached prompt tokens awaiting a first token
        self._owed: dict[tuple[str, str], int] = {}  # (backend, request id) -> its share of _queued
        self._feedback = False
        self._counts = {"picks": 0, "cold": 0, "hits": 0, "predicted_cached_tokens": 0}

    # ------------------------------------------------------------ decision

    def cached_tokens(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> dict[str, int]:
        """Prompt tokens each candidate is estimated to hold (absent: none)."""
        hashes = request.block_hashes
        if not hashes:
            return {}
        names = [c.name for c in candidates]
        exact = self.index.match(hashes, [c.name for c in candidates if c.kv_events])
        guessed = self.recent.match(hashes, [c.name for c in candidates if not c.kv_events], now)
        soon = self.pending.match(hashes, names, now)
        if request.block_size:
            per_block = float(request.block_size)
        else:  # text blocks: each is its share of the prompt
            per_block = request.prompt_tokens / len(hashes) if request.prompt_tokens else TEXT_BLOCK_TOKENS
        out: dict[str, int] = {}
        for name in names:
            blocks = max(exact.get(name, 0), guessed.get(name, 0), soon.get(name, 0))
            if blocks:
                out[name] = min(round(blocks * per_block), request.prompt_tokens or round(blocks * per_block))
        return out

    def estimate(self, c: BackendView, request: RouteRequest, cached: int) -> float:
        """Estimated seconds to the first token of ``request`` on ``c``."""
        o = self.options
        queued = self._queued.get(c.name, 0) if self._feedback else c.pending_prefill_tokens
        prefill = queued + max(request.prompt_tokens - cached, 0)
        return o.prefill_s_per_token * prefill + o.decode_s_per_seq * c.in_flight

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if not candidates:
            return None
        self._counts["picks"] += 1
        cached = self.cached_tokens(candidates, request, now)
        order = self.fallback.ordered(candidates, request)  # under the cap first, in ring order
        if not cached:
            self._counts["cold"] += 1
            return order[0]
        caps = capacity(candidates, self.options.load_factor)
        rank = {name: i for i, name in enumerate(order)}
        allowed = [c for c in candidates if c.in_flight < caps[c.name]] or list(candidates)
        best = min(allowed, key=lambda c: (round(self.estimate(c, request, cached.get(c.name, 0)), 9), rank[c.name]))
        hit = cached.get(best.name, 0)
        if hit:
            self._counts["hits"] += 1
            self._counts["predicted_cached_tokens"] += hit
        return best.name

    # ------------------------------------------------------------ feedback

    def on_dispatch(self, backend: str, request: RouteRequest, now: float) -> None:
        self._feedback = True
        # What it will prefill there: the uncached part, by what is known before this send.
        views = [BackendView(name=backend, kv_events=backend in self.index.backends())]
        owed = max(request.prompt_tokens - self.cached_tokens(views, request, now).get(backend, 0), 0)
        if request.block_hashes:
            self.recent.record(backend, request.block_hashes, now)
            self.pending.record(backend, request.block_hashes, now)
        if owed and request.request_id:
            key = (backend, request.request_id)
            self._owed[key] = self._owed.get(key, 0) + owed
            self._queued[backend] = self._queued.get(backend, 0) + owed

    def on_first_token(self, backend: str, request: RouteRequest, now: float) -> None:
        self._settle(backend, request)

    def on_complete(
        self, backend: str, request: RouteRequest, now: float, *, ok: bool, cached_tokens: int | None
    ) -> None:
        self._settle(backend, request)

    def _settle(self, backend: str, request: RouteRequest) -> None:
        owed = self._owed.pop((backend, request.request_id), 0)
        if owed:
            left = self._queued.get(backend, 0) - owed
            if left > 0:
                self._queued[backend] = left
            else:
                self._queued.pop(backend, None)

    # ------------------------------------------------------------ KV events

    def kv_since(self, backend: str) -> int:
        return self.index.since(backend)

    def on_kv_events(self, backend: str, events: Sequence[KVEventView], now: float) -> bool:
        return self.index.apply(backend, events)

    def on_kv_reset(self, backend: str) -> None:
        self.index.reset(backend)

    def statistics(self) -> KVAwareStatistics:
        return KVAwareStatistics(index=self.index.statistics(), recent_entries=len(self.recent), **self._counts)

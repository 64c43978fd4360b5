"""``kv_aware``: send each request where its estimated time to first token is lowest.

For each candidate b the policy knows how many of the request's leading
blocks b holds (from b's KV events when it publishes them, else from what
this router sent it recently), and prices that against b's load as one
continuous estimate, not a threshold switch::

    cached(b)   = matched_blocks(b) x block_size          (text blocks: their share of the prompt)
    uncached(b) = prompt_tokens - cached(b)
    prefill(b)  = queued_prefill(b) + uncached(b) x (1 if b is home else 1 + off_home_penalty)
    ttft(b)     = prefill_s_per_token x prefill(b) + decode_s_per_seq x in_flight(b)

``queued_prefill`` is the uncached prompt tokens this policy sent to b that
have not had their first token yet (or the router's count in the view when no
feedback arrives). The two coefficients are the cost of one prefill token and
how much each running sequence delays a new one (a decode step it shares).
*Home* is where prefix_hash places the request (its key's first backend under
its cap on the ring). Prefilling away from home copies a prefix into a cache
that is not its home and evicts that cache's own prefixes, which costs later
requests; the penalty prices that, so a backend that shares only a short
common head with the request (a chat template's first block, a preamble
every tenant sends) does not pull every group onto itself, while one that
holds most of the prompt still wins. Greedy TTFT alone (penalty 0) herds
groups onto whichever backend cached anything first.

The argmin wins, among candidates under the bounded-load cap of
:mod:`policies.prefix_hash` (so a hot prefix spreads to more replicas instead
of piling up). When no candidate holds any block of the request (a cold
start), or several tie, the order of ``prefix_hash`` decides: the same key
lands on the same backend, so the next request with that prefix finds it
cached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from policies.base import BackendView, KVEventView, RouteRequest
from policies.kv_index import IndexStatistics, KVIndex, RecentlySent
from policies.prefix_hash import TEXT_BLOCK_TOKENS, PrefixHash, request_key

__all__ = ["KVAware", "KVAwareStatistics"]


class KVAwareStatistics(msgspec.Struct, frozen=True, kw_only=True):
    picks: int
    cold: int  # no candidate held a block: prefix_hash placed it
    hits: int  # the pick holds at least one block of the request
    predicted_cached_tokens: int  # summed over picks
    checked: int  # completed requests whose backend reported its cached tokens
    agreed: int  # of those, the prediction at the pick was right within a block
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
        recent_ttl_s: float = 120.0  # how long a prefilled prompt counts as cached where no events come
        pending_ttl_s: float = 5.0  # the same for backends with events, until their own events arrive
        # Uncached tokens prefilled away from the request's home (its
        # prefix_hash placement) cost this much more: they copy a prefix
        # into a cache that is not its home and evict what is at home there.
        off_home_penalty: float = 1.0

        def __post_init__(self) -> None:
            if self.prefill_s_per_token < 0 or self.decode_s_per_seq < 0 or self.off_home_penalty < 0:
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
        self._last_pick: tuple[RouteRequest, dict[str, int]] | None = None
        self._predicted: dict[tuple[str, str], int] = {}  # (backend, request id) -> cached tokens predicted
        self._counts = dict.fromkeys(("picks", "cold", "hits", "predicted_cached_tokens", "checked", "agreed"), 0)

    # ------------------------------------------------------------ decision

    def cached_tokens(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> dict[str, int]:
        """Prompt tokens each candidate is estimated to hold (absent: none):
        by its events if it publishes them, else by the prompts it prefilled
        for this router; and either way by those of the last ``pending_ttl_s``
        (its events may not have arrived yet)."""
        hashes = request.block_hashes
        if not hashes:
            return {}
        names = [c.name for c in candidates]
        with_events = [c.name for c in candidates if c.kv_events]
        found = [self.pending.match(hashes, names, now)]
        if with_events:
            found.append(self.index.match(hashes, with_events))
        if len(with_events) < len(names):
            found.append(self.recent.match(hashes, [c.name for c in candidates if not c.kv_events], now))
        blocks: dict[str, int] = {}
        for part in found:
            for name, n in part.items():
                if n > blocks.get(name, 0):
                    blocks[name] = n
        if request.block_size:
            per_block = float(request.block_size)
        else:  # text blocks: each is its share of the prompt
            per_block = request.prompt_tokens / len(hashes) if request.prompt_tokens else TEXT_BLOCK_TOKENS
        limit = request.prompt_tokens
        return {name: min(round(n * per_block), limit) if limit else round(n * per_block) for name, n in blocks.items()}

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if not candidates:
            return None
        self._counts["picks"] += 1
        cached = self.cached_tokens(candidates, request, now)
        self._last_pick = (request, cached)
        if not cached:
            self._counts["cold"] += 1
            return self.fallback.pick(candidates, request, now)
        best = self._cheapest(candidates, request, cached)
        hit = cached.get(best, 0)
        if hit:
            self._counts["hits"] += 1
            self._counts["predicted_cached_tokens"] += hit
        return best

    def _cheapest(self, candidates: Sequence[BackendView], request: RouteRequest, cached: dict[str, int]) -> str:
        """The argmin of the cost in the module docstring among candidates
        under their bounded-load cap; ties go by prefix_hash's ring. (The
        cost and the caps are inlined: this runs for every candidate of
        every request.)"""
        o = self.options
        total, weight = 1, 0.0
        by_name: dict[str, BackendView] = {}
        for c in candidates:
            total += c.in_flight
            weight += c.weight
            by_name[c.name] = c
        scale = o.load_factor * total / weight
        home = self._home(by_name, scale, request)
        per_token, per_seq, prompt = o.prefill_s_per_token, o.decode_s_per_seq, request.prompt_tokens
        away = 1.0 + o.off_home_penalty
        queued, feedback, get = self._queued, self._feedback, cached.get
        least, tied = math.inf, list[str]()
        for c in candidates:
            if c.in_flight >= math.ceil(scale * c.weight):
                continue  # over its cap
            q = queued.get(c.name, 0) if feedback else c.pending_prefill_tokens
            uncached = prompt - get(c.name, 0)
            if uncached < 0:
                uncached = 0
            cost = per_token * (q + (uncached if c.name == home else away * uncached)) + per_seq * c.in_flight
            if cost < least - 1e-9:
                least, tied = cost, [c.name]
            elif cost <= least + 1e-9:
                tied.append(c.name)
        if len(tied) == 1:
            return tied[0]
        return self._first_on_ring(tied or [c.name for c in candidates], candidates, request)

    def _home(self, by_name: dict[str, BackendView], scale: float, request: RouteRequest) -> str | None:
        """Where prefix_hash would put the request: the first backend under
        its cap clockwise from the request's key."""
        ring = self.fallback.ring
        ring.update(list(by_name.values()))
        for name in ring.walk(request_key(request, self.options.prefix_tokens)):
            c = by_name.get(name)
            if c is not None and c.in_flight < math.ceil(scale * c.weight):
                return name
        return None

    def _first_on_ring(self, names: list[str], candidates: Sequence[BackendView], request: RouteRequest) -> str:
        """Of equally good backends, the one prefix_hash's ring reaches first."""
        ring = self.fallback.ring
        ring.update(candidates)
        wanted = set(names)
        for name in ring.walk(request_key(request, self.options.prefix_tokens)):
            if name in wanted:
                return name
        return names[0]  # pragma: no cover - every candidate is on the ring

    # ------------------------------------------------------------ feedback

    def on_dispatch(self, backend: str, request: RouteRequest, now: float) -> None:
        self._feedback = True
        # What it will prefill there: the uncached part, by what was known at
        # the pick (or, for a send this policy did not pick, by the index now).
        last = self._last_pick
        if last is not None and last[0] is request:
            cached = last[1].get(backend, 0)
        else:
            views = [BackendView(name=backend, kv_events=self.index.follows(backend))]
            cached = self.cached_tokens(views, request, now).get(backend, 0)
        self._last_pick = None
        if request.request_id:
            self._predicted[(backend, request.request_id)] = cached
        owed = max(request.prompt_tokens - cached, 0)
        if owed and request.request_id:
            key = (backend, request.request_id)
            self._owed[key] = self._owed.get(key, 0) + owed
            self._queued[backend] = self._queued.get(backend, 0) + owed

    def on_first_token(self, backend: str, request: RouteRequest, now: float) -> None:
        """Prefill done: the backend now holds the prompt's blocks (recorded
        here, not at dispatch: a request sent while another with its prefix
        is still prefilling does not share that prefill, so counting it
        cached then would be a wrong prediction)."""
        self._settle(backend, request)
        if request.block_hashes:
            record = self.pending if self.index.follows(backend) else self.recent
            record.record(backend, request.block_hashes, now)

    def on_complete(
        self, backend: str, request: RouteRequest, now: float, *, ok: bool, cached_tokens: int | None
    ) -> None:
        self._settle(backend, request)
        predicted = self._predicted.pop((backend, request.request_id), None)
        if predicted is not None and cached_tokens is not None:
            # What the backend reported against what was predicted at the pick:
            # agreeing within a block (an engine always computes the last one).
            self._counts["checked"] += 1
            if abs(predicted - cached_tokens) <= (request.block_size or TEXT_BLOCK_TOKENS):
                self._counts["agreed"] += 1

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

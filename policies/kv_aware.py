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
*Home* is the backend the request's prefix key is homed on: a key seen for
the first time is homed on the first backend along its prefix_hash ring walk
that homes fewer than its share of the keys seen lately
(``key_load_factor``; consistent hashing with bounded loads applied to the
keys themselves, so 16 system prompts on 8 backends home 2 each instead of
the 4,4,4,2,1,1,0,0 the ring alone gave), and stays there; a home over its
in-flight cap sends that one request along the ring, and so does a home that
took more than its share of the recent picks when the request continues no
conversation seen before (``balance_factor``: new conversations spread, the
turns of a conversation stay with its cache). Prefilling away from home copies a prefix into a cache
that is not its home and evicts that cache's own prefixes, which costs later
requests; the penalty prices that, so a backend that shares only a short
common head with the request (a chat template's first block, a preamble
every tenant sends) does not pull every group onto itself, while one that
holds most of the prompt still wins. Greedy TTFT alone (penalty 0) herds
groups onto whichever backend cached anything first.

The argmin wins, among candidates under a bounded-load cap: that of
:mod:`policies.prefix_hash`, ``ceil(load_factor x average in flight)``, but
never below the average plus ``load_slack`` streams (so a hot prefix spreads
to more replicas instead of piling up, while at low concurrency, where the
plain cap is 1 or 2, the estimate decides rather than a threshold: a strict
cap there sent conversations away from their caches, 74% hit rate against
89% in the simulator on the cache benchmark's requests). When no candidate holds any block of the request (a cold
start), or several tie, the order of ``prefix_hash`` decides: the same key
lands on the same backend, so the next request with that prefix finds it
cached.

What a backend holds by the time the request's prefill looks it up is not
what its last event said: the prompts sent there since (queued, or done and
not yet reported) store their blocks and evict the least recently used.
For a backend that gives its cache's size (``BackendView.cache_blocks``),
:mod:`policies.cache_model` replays those prompts on an LRU of that size and
``matched_blocks`` counts only what both the index and the model hold; and
where the backend shares a prefix that is still being prefilled with the
requests queued behind it (``prefix_sharing``), what was sent to the
request's home moments ago counts as held there. ``on_complete`` checks each
prediction against the ``cached_tokens`` the backend reports (the
statistics' agreed / over / under).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import is_not
from typing import Any

import msgspec

from policies.base import BackendView, KVEventView, RouteRequest
from policies.cache_model import CacheModel
from policies.kv_index import IndexStatistics, KVIndex, RecentlySent, move_to_end_each
from policies.prefix_hash import TEXT_BLOCK_TOKENS, PrefixHash, request_key

__all__ = ["KVAware", "KVAwareStatistics"]

_KEY_PROBES = 8  # distinct backends a new key's home is looked for among


def _discount(counts: dict[Any, int], key: Any) -> None:
    """One fewer of ``key`` in ``counts`` (gone at none)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


def _tokens(request: RouteRequest, blocks: int) -> int:
    """Prompt tokens in ``request``'s first ``blocks`` blocks (text blocks: their share of the prompt)."""
    if request.block_size:
        n = blocks * request.block_size
    else:
        n = round(blocks * (request.prompt_tokens / len(request.block_hashes) if request.prompt_tokens else TEXT_BLOCK_TOKENS))
    return min(n, request.prompt_tokens) if request.prompt_tokens else n


class KVAwareStatistics(msgspec.Struct, frozen=True, kw_only=True):
    picks: int
    cold: int  # no candidate held a block: prefix_hash placed it
    hits: int  # the pick holds at least one block of the request
    predicted_cached_tokens: int  # summed over picks
    checked: int  # completed requests whose backend reported its cached tokens
    agreed: int  # of those, the prediction at the pick was right within a block
    over: int  # ... predicted more than a block above what it reported (evicted, or never there)
    under: int  # ... predicted more than a block below (a prefill it was not known to hold)
    index: IndexStatistics
    recent_entries: int
    model_evictions: int  # blocks the cache model says prompts sent since evicted (backends of known capacity)


class KVAware:
    """Lowest estimated time to first token, from what each backend caches and its load."""

    name = "kv_aware"

    class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        prefill_s_per_token: float = 2e-4  # seconds of prefill per uncached prompt token
        decode_s_per_seq: float = 2e-3  # delay a new request takes per sequence running there
        load_factor: float = 1.25  # bounded-load cap, as prefix_hash ...
        # ... but never below the average plus this many streams: at low
        # concurrency ceil(1.25 x average) is 1 or 2, and a cap that tight
        # sends a conversation away from the cache that holds it while the
        # estimate (which prices queued prefill and running sequences) says
        # waiting there is cheaper; SGLang's cache-aware policy likewise
        # ignores imbalance below an absolute difference (balance_abs_threshold).
        load_slack: int = 8
        prefix_tokens: int = 256  # the prefix_hash key for cold starts and ties
        vnodes: int = 160
        max_blocks: int = 1_000_000  # the KV index bound (distinct block hashes)
        # The cache model's bound: blocks modelled over all backends of known
        # capacity (a block on two backends counts twice; a dict entry each).
        model_max_blocks: int = 2_000_000
        recent_ttl_s: float = 120.0  # how long a prefilled prompt counts as cached where no events come
        pending_ttl_s: float = 5.0  # the same for backends with events, until their own events arrive
        # Uncached tokens prefilled away from the request's home (its
        # prefix_hash placement) cost this much more: they copy a prefix
        # into a cache that is not its home and evict what is at home there.
        off_home_penalty: float = 1.0
        # Homes balanced by key (bounded loads on distinct prefix keys): a new
        # key's home is the first backend on its ring walk homing fewer than
        # ceil(key_load_factor x (K + 1) x w / W) of the K keys seen in the
        # last key_ttl_s, and it stays there. Few keys (16 system prompts on
        # 8 backends) hash unevenly (4,4,4,2,1,1,0,0 measured), and a backend
        # homing 4 long prefixes thrashes its cache while others idle; 0 turns
        # this off (homes are prefix_hash's ring order alone).
        key_load_factor: float = 1.0
        key_ttl_s: float = 300.0
        max_keys: int = 100_000
        # Conversations balanced across backends: a request that continues
        # no conversation this policy has seen (none of its blocks ends a
        # prompt sent before: a new conversation, or a new user of a shared
        # system prompt) skips backends that took more than
        # balance_factor x the average + balance_slack of the recent
        # requests (counts decayed with a half-life of balance_half_life_s).
        # Its home then moves along the ring for this request: a hot prefix
        # is copied to a second backend, and that conversation's later turns
        # follow it there. Continuing turns never move for this (their
        # history is cached where they are). 0: off. 1.1 (was 1.25): in the
        # simulator on the cache benchmark's 60 s traces (3 seeds, 400 and
        # 600-block caches, 10 and 20 req/s) requests max/avg 1.15-1.32 ->
        # 1.09-1.25 for 0.2-3.5 points of hit rate; a slack of 1 instead of 2
        # did as well there but moved a shared prompt's third request of a
        # second off its home.
        balance_factor: float = 1.1
        balance_slack: float = 2.0
        balance_half_life_s: float = 10.0

        def __post_init__(self) -> None:
            if self.prefill_s_per_token < 0 or self.decode_s_per_seq < 0 or self.off_home_penalty < 0:
                raise ValueError("costs must be non-negative")
            if self.recent_ttl_s <= 0 or self.pending_ttl_s <= 0 or self.key_ttl_s <= 0:
                raise ValueError("TTLs must be positive")
            if self.key_load_factor and self.key_load_factor < 1.0:
                raise ValueError("key_load_factor must be 0 (off) or at least 1")
            if self.balance_factor and self.balance_factor < 1.0:
                raise ValueError("balance_factor must be 0 (off) or at least 1")
            if self.balance_slack < 0 or self.balance_half_life_s <= 0:
                raise ValueError("balance_slack must be non-negative and balance_half_life_s positive")
            if self.load_slack < 0:
                raise ValueError("load_slack must be non-negative")
            if self.max_keys < 1:
                raise ValueError("max_keys must be at least 1")
            if self.model_max_blocks < 1:
                raise ValueError("model_max_blocks must be at least 1")

    def __init__(self, options: KVAware.Options | None = None) -> None:
        o = self.options = options or KVAware.Options()
        self.index = KVIndex(o.max_blocks)
        self.recent = RecentlySent(o.recent_ttl_s, o.max_blocks)
        self.pending = RecentlySent(o.pending_ttl_s, o.max_blocks, generations=2)  # short-lived: few dicts to look in
        self.model = CacheModel(o.model_max_blocks)  # what backends of known capacity will have evicted
        self.fallback = PrefixHash(
            PrefixHash.Options(prefix_tokens=o.prefix_tokens, load_factor=o.load_factor, vnodes=o.vnodes)
        )
        self._queued: dict[str, int] = {}  # backend -> uncached prompt tokens awaiting a first token
        self._owed: dict[tuple[str, str], int] = {}  # (backend, request id) -> its share of _queued
        self._feedback = False
        # The last candidate set the ring was updated for, and each name's position in it.
        self._ring_names: list[str] = []
        self._ring_weights: list[float] = []
        # The last pick's candidates and their in-flight counts and event
        # flags: the router hands back an actor's view while nothing in it
        # changed (a dispatch changes one), so only the views that are new
        # objects are read again.
        self._views: list[BackendView] = []
        self._flights: list[int] = []
        self._flight_sum = 0  # sum(_flights)
        self._events: list[bool] = []
        self._every_event = False  # all(_events)
        self._under: list[bool] = []  # the last pick's bounded-load test per candidate (uniform weights) ...
        self._under_cap = -1  # ... at this cap (-1: none kept)
        self._names_key: tuple[str, ...] = ()  # the same names as a tuple, which the indexes know by identity
        self._position: dict[str, int] = {}
        self._weight_sum = 0.0  # of _ring_weights
        self._uniform = True  # _ring_weights all equal
        self._last_pick: tuple[RouteRequest, dict[str, int]] | None = None
        self._predicted: dict[tuple[str, str], int] = {}  # (backend, request id) -> cached tokens predicted
        self._counts = dict.fromkeys(("picks", "cold", "hits", "predicted_cached_tokens", "checked", "agreed",
                                      "over", "under"), 0)
        self._keys: OrderedDict[int, list[Any]] = OrderedDict()  # key -> [home name, last seen], oldest first
        # Keys seen (touched or new) since the order was last brought up to
        # date, in the order seen: a pick only notes them (moving one to the
        # end of a large ordered dict is cache misses on the decision's path)
        # and _settle_keys replays the moves, in that order, before anything
        # reads the order (expiry) and from the feedback: the order touching
        # at once gives.
        self._key_moves: list[int] = []
        self._homed: dict[str, int] = {}  # backend -> keys it homes
        self._first_key = 0  # the oldest of _keys ...
        self._first_seen: float | None = None  # ... and when it was last seen (None: unknown)
        self._recent_load: dict[str, float] = {}  # backend -> decayed picks, scaled to _epoch (see _charge)
        self._epoch = 0.0
        self._loads: list[float] | None = None  # _recent_load of the last candidates, in their order
        self._loads_max = 0.0  # max(_loads)
        self._loads_sum = 0.0  # sum(_loads)
        # The last block of each prompt prefilled lately -> that prompt's first
        # block, and how many of those prompts each first block began: a
        # request whose first block began none continues none of them (a
        # chain that passes through a prompt's last block starts with its
        # first), so a new conversation skips the scan of its blocks.
        self._ends: dict[int, int] = {}
        self._heads: dict[int, int] = {}
        self._ends_order: deque[int] = deque()

    # ------------------------------------------------------------ decision

    def queued_prefill(self) -> Mapping[str, int] | None:
        """Uncached prompt tokens awaiting a first token per backend, by what
        this router sent (its dispatch and first-token feedback; absent:
        none), or None before any feedback. Where a backend holds most of a
        prompt this is what it must compute, not the prompt's length (what
        a view's ``pending_prefill_tokens`` counts)."""
        return self._queued if self._feedback else None

    def cached_tokens(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> dict[str, int]:
        """Prompt tokens each candidate is estimated to hold (absent: none):
        by its events if it publishes them, else by the prompts it prefilled
        for this router; and either way by those of the last ``pending_ttl_s``
        (its events may not have arrived yet)."""
        for c in candidates:
            self._learn_capacity(c)
        return self._cached([c.name for c in candidates], [c.kv_events for c in candidates], request, now)

    def _cached(self, names: Sequence[str], events: list[bool], request: RouteRequest, now: float,
                every: bool | None = None) -> dict[str, int]:
        """``every``: all(events), when the caller knows it."""
        hashes = request.block_hashes
        if not hashes:
            return {}
        blocks = self.pending.match(hashes, names, now)
        if all(events) if every is None else every:
            found = self.index.match(hashes, names)
        else:
            found = self.recent.match(hashes, [n for n, e in zip(names, events, strict=True) if not e], now)
            if any(events):
                found.update(self.index.match(hashes, [n for n, e in zip(names, events, strict=True) if e]))
        if not blocks:
            blocks = found
        else:
            for name, n in found.items():
                if n > blocks.get(name, 0):
                    blocks[name] = n
        if blocks and self.model.active:  # less what the prompts sent since will have evicted
            held = self.model.held
            for name, n in list(blocks.items()):
                m = held(name, hashes, n)
                if m < n:
                    if m:
                        blocks[name] = m
                    else:
                        del blocks[name]
        if not blocks:
            return {}
        size, prompt = request.block_size, request.prompt_tokens
        if size and prompt:  # _tokens, inline
            return {name: n * size if n * size < prompt else prompt for name, n in blocks.items()}
        return {name: _tokens(request, n) for name, n in blocks.items()}

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        """The argmin of the cost in the module docstring among candidates
        under their bounded-load cap; cold starts and ties by prefix_hash's
        ring. This runs for every request over every candidate, so the
        per-candidate work is a few list comprehensions (no per-candidate
        Python calls; only the views that changed since the last pick, when
        the router hands back the others), and only the backends that hold
        blocks of the request and its home are priced one by one."""
        if not candidates:
            return None
        counts = self._counts
        counts["picks"] += 1
        names, flights, weights, events, changed = self._columns(candidates)
        position = self._position
        cached = self._cached(self._names_key, events, request, now, self._every_event)
        self._last_pick = (request, cached)
        o = self.options
        share = (self._flight_sum + 1) / self._weight_sum  # in flight per unit of weight, this request included
        scale, slack = o.load_factor * share, o.load_slack
        if self._uniform:
            w0 = weights[0]
            cap = max(math.ceil(scale * w0), math.ceil(share * w0) + slack)
            if changed is not None and cap == self._under_cap:  # the last pick's, where the counts changed
                under = self._under
                for i in changed:
                    under[i] = flights[i] < cap
            else:
                under = self._under = [f < cap for f in flights]
                self._under_cap = cap
        else:
            self._under_cap = -1
            under = [f < max(math.ceil(scale * w), math.ceil(share * w) + slack)
                     for f, w in zip(flights, weights, strict=True)]
        key = request_key(request, o.prefix_tokens)
        growth = self._growth(now) if o.balance_factor else 0.0  # once: the balance and the charge
        if o.balance_factor and request.block_hashes:
            under = self._balanced(names, under, request.block_hashes, growth)
        if o.key_load_factor:
            home = self._key_home(key, names, weights, position, under, now)
        else:
            home = self.fallback.ring.first_index(key, position, under)
        if home >= 0 and candidates[home].prefix_sharing and request.block_hashes:
            # Its home prefills in arrival order and shares what it is
            # computing, so prompts sent there moments ago and still
            # prefilling (their events not in yet) are as good as cached
            # by the time this one is: the cache model holds them.
            name = names[home]
            n = self.model.held(name, request.block_hashes, len(request.block_hashes)) if self.model.modelled(name) else 0
            sent = _tokens(request, n) if n else 0
            if sent > cached.get(name, 0):
                cached = {**cached, name: sent}
                self._last_pick = (request, cached)
        if not cached:
            counts["cold"] += 1
            if home >= 0:
                best = names[home]
            else:  # pragma: no cover - caps sum past the load
                best = min(candidates, key=lambda v: v.in_flight / v.weight).name
        else:
            best = self._cheapest(candidates, names, flights, under, home, key, request, cached)
            hit = cached.get(best, 0)
            if hit:
                counts["hits"] += 1
                counts["predicted_cached_tokens"] += hit
        if o.balance_factor:
            self._charge(best, growth)
        self._learn_capacity(candidates[position[best]])
        return best

    def _columns(self, candidates: Sequence[BackendView]
                 ) -> tuple[list[str], list[int], list[float], list[bool], list[int] | None]:
        """The candidates' names, in-flight counts, weights and event flags,
        and the positions whose counts alone changed (None: all read anew).
        Views that are the last pick's objects are not read again; a changed
        one that keeps its name, weight and flag changes only its count."""
        last = self._views
        self._views = list(candidates)
        # (Both ends new: views built afresh, most likely; reading all is cheaper than finding which.)
        if (len(last) == len(candidates) and last and (candidates[0] is last[0] or candidates[-1] is last[-1])
                and len(changed := list(compress(range(len(last)), map(is_not, candidates, last)))) * 4 <= len(last)):
            names, weights, events, flights = self._ring_names, self._ring_weights, self._events, self._flights
            for i in changed:
                c = candidates[i]
                if c.name != names[i] or c.weight != weights[i] or c.kv_events is not events[i]:
                    break
                self._flight_sum += c.in_flight - flights[i]
                flights[i] = c.in_flight
            else:
                return names, flights, weights, events, changed
        names = [c.name for c in candidates]
        flights = self._flights = [c.in_flight for c in candidates]
        self._flight_sum = sum(flights)
        weights = [c.weight for c in candidates]
        if names != self._ring_names or weights != self._ring_weights:
            self._new_candidates(candidates, names, weights)
        self._events = [c.kv_events for c in candidates]
        self._every_event = all(self._events)
        return self._ring_names, flights, self._ring_weights, self._events, None

    def _learn_capacity(self, view: BackendView) -> None:
        """Model ``view``'s cache from its capacity (or stop, if it no longer gives one)."""
        if self.model.capacity_of(view.name) != view.cache_blocks:  # else it would change nothing
            self.model.capacity(view.name, view.cache_blocks, self.index.blocks_of(view.name))

    def _new_candidates(self, candidates: Sequence[BackendView], names: list[str], weights: list[float]) -> None:
        """What only changes with the candidate set (names and weights), kept between picks."""
        self.fallback.ring.update(candidates)
        self._ring_names, self._ring_weights = names, weights
        self._names_key = tuple(names)
        self._position = {n: i for i, n in enumerate(names)}
        self._weight_sum = sum(weights)
        self._uniform = weights.count(weights[0]) == len(weights)
        self._loads = None

    # Recent picks per backend, decayed with a half-life: kept scaled to an
    # epoch (a pick at time t adds 2^((t - epoch) / half-life)), so that
    # comparing backends needs no per-backend decay; the value now is the
    # scaled one over 2^((now - epoch) / half-life).

    def _growth(self, now: float) -> float:
        """(now - epoch) / half-life, the epoch moved to ``now`` (and every
        value rescaled) first when that is out of [-64, 64]: on the first
        call (the router's clock is not near 0), and every ~640 s after."""
        growth = (now - self._epoch) / self.options.balance_half_life_s
        if -64.0 <= growth <= 64.0:
            return growth
        shrink = 0.5 ** min(growth, 2048.0) if growth > 0 else 1.0  # time going back: keep the values
        self._recent_load = {n: v * shrink for n, v in self._recent_load.items()}
        self._epoch = now
        self._loads = None  # rebuilt from the rescaled values
        return 0.0

    def _charge(self, name: str, growth: float) -> None:
        """One more recent pick for ``name`` (``growth``: :meth:`_growth` now)."""
        add = 2.0 ** growth
        self._recent_load[name] = self._recent_load.get(name, 0.0) + add
        loads = self._loads
        if loads is not None:  # the candidates' scaled loads stay right without a rebuild
            i = self._position.get(name, -1)
            if i >= 0:
                loads[i] += add
                self._loads_sum += add
                if loads[i] > self._loads_max:  # loads only grow between rebuilds
                    self._loads_max = loads[i]
            else:
                self._loads = None

    def _balanced(self, names: list[str], under: list[bool], hashes: tuple[int, ...], growth: float) -> list[bool]:
        """``under`` without the backends that took more than their share of
        the recent picks (see ``balance_factor``) if the request continues no
        conversation seen lately (none of ``hashes`` ends a prompt prefilled
        lately); unchanged if that would leave none. The loads are compared
        first: they usually leave ``under`` as it is, and then the request's
        blocks need no look-up in the (large, cache-missing) set of ends."""
        o = self.options
        loads = self._loads
        if loads is None:  # the candidates' scaled loads, in their order (kept up to date by _charge)
            get = self._recent_load.get
            loads = self._loads = [get(n, 0.0) for n in names]
            self._loads_max = max(loads)
            self._loads_sum = sum(loads)
        threshold = o.balance_factor * self._loads_sum / len(loads) + o.balance_slack * 2.0 ** growth
        # From the last block back: where a continued conversation's previous prompt ended.
        if (self._loads_max <= threshold or (hashes[0] in self._heads
                                             and not self._ends.keys().isdisjoint(reversed(hashes)))):
            return under
        kept = under.copy()  # a loop that clears the few over the threshold: faster than a comprehension over pairs
        for i, v in enumerate(loads):
            if v > threshold:
                kept[i] = False
        return kept if any(kept) else under

    def _key_home(self, key: int, names: list[str], weights: list[float], position: dict[str, int],
                  under: list[bool], now: float) -> int:
        """The position of the request's home (-1: none under its cap): its
        key's assigned backend, or for a new key the first on the ring
        homing fewer keys than its share allows (see ``key_load_factor``).
        A home over its in-flight cap sends this pick along the ring as
        prefix_hash does, without moving the key."""
        keys, homed, ring = self._keys, self._homed, self.fallback.ring
        o = self.options
        seen = self._first_seen  # when the oldest key was last seen (None: look it up)
        if seen is None or not seen + o.key_ttl_s > now or len(keys) > o.max_keys:
            self._expire_keys(now)
        entry = keys.get(key)
        if entry is not None:
            if key == self._first_key:  # the oldest is the oldest no more
                self._first_seen = None
            self._note_key(key)
            entry[1] = now
            i = position.get(entry[0], -1)
            if i >= 0 and under[i]:
                return i
            return ring.first_index(key, position, under)
        scale = o.key_load_factor * (len(keys) + 1) / self._weight_sum
        get = homed.get
        # The first backend along the ring with room for one more key; past
        # _KEY_PROBES distinct backends without room, the least homed of
        # those (a walk bounded like a power-of-d choice: at 64 backends with
        # most of them at their share, an unbounded walk is the pick's cost).
        i, fewest = -1, math.inf
        limit = math.ceil(scale * weights[0]) if self._uniform else -1  # every backend's share, when one
        for name in ring.leading(key, _KEY_PROBES):
            j = position.get(name, -1)
            if j < 0 or not under[j]:
                continue
            held, w = get(name, 0), weights[j]
            if held < (limit if limit >= 0 else math.ceil(scale * w)):
                i = j
                break
            if held / w < fewest:
                i, fewest = j, held / w
        if i < 0:  # none of them under its in-flight cap
            i = ring.first_index(key, position, under)
        if i >= 0:
            if not keys:
                self._first_seen = None
            keys[key] = [names[i], now]
            self._note_key(key)  # already last; noted so that the replay keeps it after the keys seen before it
            homed[names[i]] = get(names[i], 0) + 1
        return i

    def _note_key(self, key: int) -> None:
        moves = self._key_moves
        moves.append(key)
        if len(moves) > 4096:  # no feedback lately
            self._settle_keys()

    def _settle_keys(self) -> None:
        if self._key_moves:
            moves, self._key_moves = self._key_moves, []
            move_to_end_each(self._keys, moves)

    def _expire_keys(self, now: float) -> None:
        """Forget keys not seen for key_ttl_s, or past max_keys, oldest
        first; then note the oldest (the next pick needs no look-up in the
        keys to know none expired)."""
        self._settle_keys()
        keys, homed, o = self._keys, self._homed, self.options
        self._first_seen = None
        while keys:
            key, first = next(iter(keys.items()))
            if first[1] + o.key_ttl_s > now and len(keys) <= o.max_keys:
                self._first_key, self._first_seen = key, first[1]
                break
            _discount(homed, keys.popitem(last=False)[1][0])

    def _cheapest(self, candidates: Sequence[BackendView], names: list[str], flights: list[int], under: list[bool],
                  home: int, key: int, request: RouteRequest, cached: dict[str, int]) -> str:
        """The least cost wins, ties by the ring from ``key``. Only the few
        candidates that hold blocks, and the home, are priced one by one;
        every other one costs at least ``per_token x far + per_seq x
        min(in_flight)`` (it holds nothing and is away from home), so when a
        priced one is cheaper than that bound it wins without pricing the
        rest; otherwise all are priced (one comprehension)."""
        o = self.options
        per_token, per_seq, prompt = o.prefill_s_per_token, o.decode_s_per_seq, request.prompt_tokens
        away = 1.0 + o.off_home_penalty
        position = self._position
        feedback, queued_by_name = self._feedback, self._queued
        priced: dict[int, float] = {}
        least = math.inf
        for name, have in cached.items():
            i = position[name]
            if under[i]:
                q = queued_by_name.get(name, 0) if feedback else candidates[i].pending_prefill_tokens
                uncached = prompt - have if have < prompt else 0
                x = priced[i] = per_token * (q + (uncached if i == home else away * uncached)) + per_seq * flights[i]
                if x < least:
                    least = x
        if home >= 0 and under[home] and names[home] not in cached:
            q = queued_by_name.get(names[home], 0) if feedback else candidates[home].pending_prefill_tokens
            x = priced[home] = per_token * (q + (prompt if prompt > 0 else 0)) + per_seq * flights[home]
            if x < least:
                least = x
        far = away * prompt
        # Below every unpriced candidate? (The first test implies the second,
        # in floating point too: min(in_flight) >= 0; it spares the min.)
        if priced and (least < per_token * far - 1e-9 or least < per_token * far + per_seq * min(flights) - 1e-9):
            if len(priced) == 1:
                return names[next(iter(priced))]
            bound = least + 1e-9
            tied = [i for i, x in priced.items() if x <= bound]
            if len(tied) == 1:
                return names[tied[0]]
            return self.fallback.ring.first(key, {names[i] for i in tied}) or names[tied[0]]
        if feedback:  # sparse: only backends with prefill outstanding
            queued = [0] * len(names)
            for name, q in queued_by_name.items():
                i = position.get(name, -1)
                if i >= 0:
                    queued[i] = q
        else:
            queued = [c.pending_prefill_tokens for c in candidates]
        inf = math.inf
        costs = [per_token * (q + far) + per_seq * f if ok else inf
                 for q, f, ok in zip(queued, flights, under, strict=True)]
        for i, x in priced.items():
            costs[i] = x
        least = min(costs)
        if least == inf:  # pragma: no cover - some candidate is always under its cap
            return self.fallback.ring.first(key, set(names)) or names[0]
        bound = least + 1e-9
        tied = [i for i, x in enumerate(costs) if x <= bound]
        if len(tied) == 1:
            return names[tied[0]]
        # Of equally good backends, the one prefix_hash's ring reaches first.
        return self.fallback.ring.first(key, {names[i] for i in tied}) or names[tied[0]]

    # ------------------------------------------------------------ feedback

    def on_dispatch(self, backend: str, request: RouteRequest, now: float) -> None:
        self._feedback = True
        # What it will prefill there: the uncached part, by what was known at
        # the pick (or, for a send this policy did not pick, by the index now).
        last = self._last_pick
        if last is not None and last[0] is request:
            cached = last[1].get(backend, 0)
        else:
            views = [BackendView(name=backend, kv_events=self.index.follows(backend),
                                 cache_blocks=self.model.capacity_of(backend))]
            cached = self.cached_tokens(views, request, now).get(backend, 0)
        self._last_pick = None
        self.model.send(backend, request.block_hashes)
        if not request.request_id:
            return
        key = (backend, request.request_id)
        self._predicted[key] = cached
        owed = request.prompt_tokens - cached
        if owed > 0:
            self._owed[key] = self._owed.get(key, 0) + owed
            self._queued[backend] = self._queued.get(backend, 0) + owed

    def on_first_token(self, backend: str, request: RouteRequest, now: float) -> None:
        """Prefill done: the backend now holds the prompt's blocks (recorded
        here, not at dispatch: a request sent while another with its prefix
        is still prefilling does not share that prefill, so counting it
        cached then would be a wrong prediction)."""
        self._catch_up(backend, request)
        if request.block_hashes:
            record = self.pending if self.index.follows(backend) else self.recent
            record.record(backend, request.block_hashes, now)
            if self.options.balance_factor:  # a later turn of this conversation holds this block
                hashes, ends, heads = request.block_hashes, self._ends, self._heads
                end = hashes[-1]
                if end not in ends:
                    ends[end] = head = hashes[0]
                    heads[head] = heads.get(head, 0) + 1
                    self._ends_order.append(end)
                    if len(ends) > self.options.max_keys:
                        _discount(heads, ends.pop(self._ends_order.popleft()))

    def on_complete(
        self, backend: str, request: RouteRequest, now: float, *, ok: bool, cached_tokens: int | None
    ) -> None:
        self._catch_up(backend, request)
        if self.options.key_load_factor:  # new keys' homes walk the ring less
            self.fallback.ring.prepare(_KEY_PROBES, 8)
        predicted = self._predicted.pop((backend, request.request_id), None)
        if predicted is not None and cached_tokens is not None:
            # What the backend reported against what was predicted at the pick:
            # agreeing within a block (an engine always computes the last one).
            counts = self._counts
            counts["checked"] += 1
            tolerance = request.block_size or TEXT_BLOCK_TOKENS
            if predicted > cached_tokens + tolerance:
                counts["over"] += 1
            elif predicted < cached_tokens - tolerance:
                counts["under"] += 1
            else:
                counts["agreed"] += 1

    def _catch_up(self, backend: str, request: RouteRequest) -> None:
        """Feedback for ``request`` (its prefill is over): its queued tokens
        leave ``backend``, and what the decisions left for later is done, off
        their path (the prompts sent to the cache model, the LRU order the
        index's matches and the prefix keys touched)."""
        self._settle(backend, request)
        self.model.flush()
        self.index.settle()
        self._settle_keys()

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
        if self.index.apply(backend, events):
            self.model.apply(backend, events)
            return True
        self.model.reset(backend)
        return False

    def on_kv_reset(self, backend: str) -> None:
        self.index.reset(backend)
        self.model.reset(backend)

    def statistics(self) -> KVAwareStatistics:
        return KVAwareStatistics(index=self.index.statistics(), recent_entries=len(self.recent),
                                 model_evictions=self.model.evictions, **self._counts)

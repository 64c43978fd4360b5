"""``prefix_hash``: consistent hashing with bounded loads on the prompt's leading blocks.

The key is the chained hash of the request's first K full blocks (K blocks
cover ``prefix_tokens`` tokens; a chained hash names the whole prefix up to
it), so requests sharing a system prompt share a key, and the same key lands
on the same backend in every router process with the same backend set: the
ring is built from backend names and weights only, hashed with BLAKE2b (never
Python's per-process ``str`` hash).

Bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018): a backend of
weight w may hold at most ``cap = ceil(load_factor * (m + 1) * w / W)``
requests, m being the requests in flight on all candidates and W their total
weight; the request walks the ring clockwise from its key to the first
candidate under its cap. Some backend is always under its cap (the caps sum
to more than m + 1), so the walk always ends. Each backend has ``vnodes x
weight`` points on the ring, so a backend joining or leaving moves about 1/n
of the keys, and only to or from itself.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Collection, Iterator, Sequence

import msgspec

from policies.base import BackendView, RouteRequest

__all__ = ["TEXT_BLOCK_TOKENS", "HashRing", "PrefixHash", "request_key", "stable_hash"]

_MASK63 = (1 << 63) - 1
_RING = 1 << 63  # every point and key is below this
# A text block (RouteRequest.block_size == 0) covers about this many tokens.
TEXT_BLOCK_TOKENS = 16


def stable_hash(data: bytes) -> int:
    """63 bits of BLAKE2b: the same in every process and on every machine."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK63


def mix(x: int) -> int:
    """splitmix64's finaliser, to 63 bits: spreads any integer key (an
    engine's block hash need not be uniform) evenly around the ring."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK63


def request_key(request: RouteRequest, prefix_tokens: int) -> int:
    """The ring key: the hash of the first ``prefix_tokens`` tokens' worth of
    full blocks (all of them when there are fewer); a prompt too short for one
    block hashes its token ids or text."""
    hashes = request.block_hashes
    if hashes:
        k = prefix_tokens // (request.block_size or TEXT_BLOCK_TOKENS)
        n = len(hashes)
        return mix(hashes[(k if k < n else n) - 1 if k > 1 else 0])  # block min(max(1, k), n)
    if request.prompt_token_ids is not None:
        ids = request.prompt_token_ids[:prefix_tokens]
        return stable_hash(b"ids:" + ",".join(map(str, ids)).encode())
    return stable_hash(b"text:" + request.prefix.encode("utf-8", "surrogatepass"))


class HashRing:
    """Points for each backend, sorted; rebuilt only when names or weights change."""

    def __init__(self, vnodes: int) -> None:
        self.vnodes = vnodes
        self._members: tuple[tuple[str, float], ...] = ()
        self._known: dict[str, float] = {}
        self._points: list[int] = []
        self._owners: list[str] = []
        self._by_owner: dict[str, list[int]] = {}  # each backend's points, sorted
        self._leading: dict[int, dict[int, tuple[str, ...]]] = {}  # limit -> start point -> leading()
        self._buckets: list[int] = [0, 0]  # see _start
        self._prepared: dict[int, int] = {}  # limit -> the next starting point prepare() looks at
        self._shift = 62

    def update(self, candidates: Sequence[BackendView]) -> None:
        """Make the ring hold (at least) these backends with these weights.
        Backends that are only missing from this call's candidates (a retry
        excluded them, or they are briefly down) stay on the ring and are
        skipped by the walk, which places every other key exactly as a ring
        without them would."""
        known = self._known
        if all(known.get(c.name) == c.weight for c in candidates):
            return
        merged = dict(known)
        merged.update((c.name, c.weight) for c in candidates)
        self._build(tuple(sorted(merged.items())))

    def _build(self, members: tuple[tuple[str, float], ...]) -> None:
        ring: list[tuple[int, str]] = []
        for name, weight in members:
            for i in range(max(1, round(self.vnodes * weight))):
                ring.append((stable_hash(f"{name}#{i}".encode()), name))
        ring.sort()
        self._members = members
        self._known = dict(members)
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]
        self._by_owner = {name: [p for p, n in ring if n == name] for name, _ in members}
        self._leading = {}
        self._prepared = {}
        # About a point per bucket, up to 2^14: bucket b starts at the first
        # point >= b << shift (the points whose top bits are below b).
        bits = min(14, max(1, len(self._points).bit_length()))
        shift = self._shift = 63 - bits
        counts = [0] * ((1 << bits) + 1)
        for p in self._points:
            counts[(p >> shift) + 1] += 1
        self._buckets = list(itertools.accumulate(counts))

    def _start(self, key: int) -> int:
        """``bisect_left(points, key)``: within the points of the key's bucket
        (its top bits), a step or two instead of ~log2(points) comparisons
        of ints scattered in memory, each a cache miss on a large ring."""
        b = key >> self._shift
        return bisect.bisect_left(self._points, key, self._buckets[b], self._buckets[b + 1])

    def first(self, key: int, wanted: Collection[str]) -> str | None:
        """The first of ``wanted`` clockwise from ``key`` (what :meth:`walk`
        reaches first): for a few names, a bisection in each one's points
        instead of a walk past every other backend."""
        if len(wanted) > 8:
            for name in self.walk(key):
                if name in wanted:
                    return name
            return None
        best, best_gap = None, _RING
        by_owner = self._by_owner
        for name in wanted:
            points = by_owner.get(name)
            if not points:
                continue
            i = bisect.bisect_left(points, key)
            gap = points[i] - key if i < len(points) else points[0] + _RING - key
            if gap < best_gap or (gap == best_gap and best is not None and name < best):
                best, best_gap = name, gap
        return best

    def first_index(self, key: int, position: dict[str, int], ok: list[bool]) -> int:
        """The position of the first backend clockwise from ``key`` that is
        in ``position`` with ``ok[position[name]]`` true, or -1 (the walk
        without a generator: a pick usually stops at the first point)."""
        owners = self._owners
        n = len(owners)
        start = self._start(key)
        get = position.get
        for step in range(n):
            i = get(owners[(start + step) % n], -1)
            if i >= 0 and ok[i]:
                return i
        return -1

    def leading(self, key: int, limit: int) -> tuple[str, ...]:
        """The first ``limit`` backends :meth:`walk` yields from ``key``, as a
        tuple kept per starting point until the ring changes (a ring has
        ``vnodes x backends`` starting points, so a busy router soon knows
        them all, and a walk becomes one bisection and one look-up)."""
        known = self._leading_of(limit)
        start = self._start(key)
        names = known.get(start)
        if names is None:
            names = known[start] = tuple(self._walk_from(start, limit))
        return names

    def _leading_of(self, limit: int) -> dict[int, tuple[str, ...]]:
        """:meth:`leading`'s answers for ``limit``, by starting point."""
        known = self._leading.get(limit)
        if known is None:
            known = self._leading[limit] = {}
        return known

    def prepare(self, limit: int, steps: int) -> None:
        """Compute up to ``steps`` more starting points' :meth:`leading` (a
        caller's spare moment, so that a pick rarely walks the ring itself:
        a new ring has ``vnodes x backends`` of them to learn)."""
        n = len(self._points)
        start = self._prepared.get(limit, 0)
        if start > n:
            return
        known = self._leading_of(limit)
        while steps > 0 and start <= n:
            if start not in known:
                known[start] = tuple(self._walk_from(start, limit))
                steps -= 1
            start += 1
        self._prepared[limit] = start

    def walk(self, key: int, limit: int = 0) -> Iterator[str]:
        """Every backend once (the first ``limit`` when given), in ring order
        clockwise from ``key`` (lazily: a pick usually stops at the first)."""
        return self._walk_from(self._start(key), limit)

    def _walk_from(self, start: int, limit: int) -> Iterator[str]:
        seen: set[str] = set()
        owners = self._owners
        n = len(owners)
        stop = min(limit, len(self._members)) if limit else len(self._members)
        for i in range(n):
            name = owners[(start + i) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == stop:
                    return


def capacity(candidates: Sequence[BackendView], load_factor: float) -> dict[str, int]:
    """Each candidate's bounded-load cap for one more request."""
    scale = load_factor * (sum(c.in_flight for c in candidates) + 1) / sum(c.weight for c in candidates)
    return {c.name: math.ceil(scale * c.weight) for c in candidates}  # as pick() computes it


class PrefixHash:
    """Consistent hashing with bounded loads on the prompt's leading KV blocks."""

    name = "prefix_hash"

    class Options(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        prefix_tokens: int = 256  # how much of the prompt the key covers
        load_factor: float = 1.25  # cap = ceil(load_factor * average load), >= 1
        vnodes: int = 160  # ring points per unit of weight

        def __post_init__(self) -> None:
            if self.prefix_tokens < 1 or self.vnodes < 1:
                raise ValueError("prefix_tokens and vnodes must be at least 1")
            if self.load_factor < 1.0:
                raise ValueError("load_factor must be at least 1 (1 = perfectly even)")

    def __init__(self, options: PrefixHash.Options | None = None) -> None:
        self.options = options or PrefixHash.Options()
        self.ring = HashRing(self.options.vnodes)

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        if not candidates:
            return None
        self.ring.update(candidates)
        total, weight = 1, 0.0
        by_name: dict[str, BackendView] = {}
        for c in candidates:
            total += c.in_flight
            weight += c.weight
            by_name[c.name] = c
        scale = self.options.load_factor * total / weight
        for name in self.ring.walk(request_key(request, self.options.prefix_tokens)):
            view = by_name.get(name)
            if view is not None and view.in_flight < math.ceil(scale * view.weight):
                return name
        # Not reached (the caps sum to more than the load); the least loaded is the safe answer.
        return min(candidates, key=lambda v: v.in_flight / v.weight).name  # pragma: no cover

    def ordered(self, candidates: Sequence[BackendView], request: RouteRequest) -> list[str]:
        """Candidates in the order this policy would try them: under their
        cap in ring order from the request's key, then the rest by load."""
        self.ring.update(candidates)
        by_name = {c.name: c for c in candidates}
        caps = capacity(candidates, self.options.load_factor)
        key = request_key(request, self.options.prefix_tokens)
        ring = [n for n in self.ring.walk(key) if n in by_name]
        under = [n for n in ring if by_name[n].in_flight < caps[n]]
        over = sorted((n for n in ring if by_name[n].in_flight >= caps[n]), key=lambda n: by_name[n].in_flight / by_name[n].weight)
        return under + over

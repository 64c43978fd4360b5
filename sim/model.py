"""A discrete-event simulation of routing policies against modelled backends.

No trio and no sleeping: a heap of ``(time, seq, kind, ...)`` events and a
virtual ``now``, the same ``now`` a policy's methods already take. The policy
object is the one the router would run; the simulator calls it as the router
does (``pick``, then each feedback method the policy has)::

    arrival ──> pick(views, request, now) ──> on_dispatch
                  backend b:  queue (over max_running) ──> ttft_s ──> prefill lane (FIFO, one)
                    lane start: cached = cache.match(...)      duration uncached x prefill_s_per_token
                    lane end:   cache.store(...) ──> on_kv_events(b, [stored, removed])
                                first token ──> on_first_token ──> decode batch
                    decode:     one token per step for every running sequence
                    last token ──> on_complete(b, request, now, ok=True, cached_tokens)

Model, per backend (one accelerator; the same shape as ``headrace mock`` with
its prefix-cache model, ``backends.mock_cache``, whose LRU it reuses):

- A request is *active* from admission to its last token; at most
  ``max_running`` are (0: no limit), the rest queue at the backend in order.
- ``TTFT = queueing + ttft_s + lane wait + (prompt - cached) x prefill_s_per_token``,
  ``cached`` being the leading blocks in the LRU when its prefill starts (at
  most ``(prompt - 1) // block_size`` blocks), after which all its full blocks
  are stored (tail first, so chains are evicted from the tail).
- Decode is a running batch of ``n`` sequences; a step takes
  ``step(n) = decode_step_s x (1 + batch_slope x (n - 1))`` and gives each one
  token, so a request's remaining ``output_tokens - 1`` tokens take as many
  steps. Steps are fluid (a backend's step counter advances at ``1 / step(n)``
  per second between membership changes), so finishing times are exact
  without an event per step: events are O(requests), not O(tokens).
- Prefill and decode do not slow each other (a simplification: one lane each).

Reported (:mod:`sim.report`): prefix-cache hit rate (cached / prompt tokens),
TTFT percentiles, throughput over the makespan, and load balance.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from backends.base import KVEvent
from backends.mock_cache import PrefixCache
from policies.base import BackendView
from sim.trace import SimRequest

__all__ = ["BackendResult", "ModelConfig", "RequestRecord", "SimError", "SimResult", "simulate"]

Progress = Callable[[int], None]  # called with the requests dispatched so far


class SimError(Exception):
    """A policy that broke the contract (picked a name it was not offered)."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    backends: Annotated[int, Meta(ge=1)] = 8
    block_size: Annotated[int, Meta(ge=1)] = 16
    cache_blocks: Annotated[int, Meta(ge=1)] = 2048  # per backend
    ttft_s: Annotated[float, Meta(ge=0)] = 0.005
    prefill_s_per_token: Annotated[float, Meta(ge=0)] = 0.0001
    decode_step_s: Annotated[float, Meta(ge=0)] = 0.010
    batch_slope: Annotated[float, Meta(ge=0)] = 0.002
    max_running: Annotated[int, Meta(ge=0)] = 64  # per backend; 0: no limit
    kv_events: bool = True  # publish KV events to policies that take them
    name_prefix: str = "b"  # backends are named prefix + index (the router's are "backend-0", ...)


class RequestRecord(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    backend: str
    arrival: float
    first_token: float
    done: float
    prompt_tokens: int
    cached_tokens: int


class BackendResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    served: int
    in_flight_mean: float  # time-averaged over the makespan
    prompt_tokens: int
    cached_tokens: int
    evictions: int


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    completed: int
    refused: int  # pick() returned None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    makespan_s: float  # first arrival to last token
    ttft_s: array  # type: ignore[type-arg]
    backends: list[BackendResult]
    kv_events: int
    kv_resyncs: int  # on_kv_events returned False
    wall_s: float
    records: list[RequestRecord] | None = None


_ARRIVE, _LANE, _PREFILLED, _DECODE = 0, 1, 2, 3


class _Seq:
    __slots__ = ("arrival", "cached", "first", "request", "route")

    def __init__(self, request: SimRequest) -> None:
        self.request, self.route, self.arrival = request, request.route, request.arrival
        self.cached, self.first = 0, 0.0


class _Backend:
    __slots__ = ("active", "area", "batch", "cache", "cached_tokens", "changed", "decoding",
                 "in_flight", "lane", "lane_busy", "last_step", "name", "pending_tokens",
                 "prompt_tokens", "served", "steps", "version", "view", "waiting")

    def __init__(self, name: str, config: ModelConfig) -> None:
        self.name = name
        self.cache = PrefixCache(config.cache_blocks, config.block_size, history=0)
        self.in_flight = self.pending_tokens = self.active = self.served = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.area, self.changed = 0.0, 0.0  # integral of in_flight dt, and since when
        self.waiting: deque[_Seq] = deque()  # over max_running
        self.lane: deque[_Seq] = deque()
        self.lane_busy = False
        self.decoding: list[tuple[float, int, _Seq]] = []  # (step at which it is done, tie, seq)
        self.batch = 0
        self.steps, self.last_step, self.version = 0.0, 0.0, 0
        self.view: BackendView | None = None


class _Sim:
    def __init__(self, policy: Any, config: ModelConfig, record: bool) -> None:
        self.policy, self.config = policy, config
        self.backends = [_Backend(f"{config.name_prefix}{i}", config) for i in range(config.backends)]
        self.by_name = {b.name: b for b in self.backends}
        self.events: list[tuple[Any, ...]] = []
        self.tie = 0
        self.ttft = array("d")
        self.records: list[RequestRecord] | None = [] if record else None
        self.completed = self.refused = self.output = self.kv_events = self.resyncs = 0
        self.last_done = 0.0
        self.on_dispatch = getattr(policy, "on_dispatch", None)
        self.on_first_token = getattr(policy, "on_first_token", None)
        self.on_complete = getattr(policy, "on_complete", None)
        self.on_kv = getattr(policy, "on_kv_events", None) if config.kv_events else None
        if self.on_kv is not None and hasattr(policy, "kv_since"):
            for b in self.backends:
                policy.kv_since(b.name)  # the router subscribes from here

    def push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        self.tie += 1
        heapq.heappush(self.events, (t, self.tie, kind, a, b))

    # -- the router's side ---------------------------------------------------------

    def arrive(self, seq: _Seq, now: float) -> None:
        views = [b.view or self._view(b) for b in self.backends]
        name = self.policy.pick(views, seq.route, now)
        if name is None:
            self.refused += 1
            return
        b = self.by_name.get(name)
        if b is None:
            raise SimError(f"the policy picked {name!r}, not one of the candidates")
        self._load(b, now, +1)
        b.pending_tokens += seq.route.prompt_tokens
        if self.on_dispatch is not None:
            self.on_dispatch(name, seq.route, now)
        if self.config.max_running and b.active >= self.config.max_running:
            b.waiting.append(seq)
        else:
            self.admit(b, seq, now)

    def _view(self, b: _Backend) -> BackendView:
        b.view = BackendView(name=b.name, in_flight=b.in_flight, pending_prefill_tokens=b.pending_tokens,
                             kv_events=self.on_kv is not None, block_size=self.config.block_size,
                             cache_blocks=self.config.cache_blocks, prefix_sharing=True)  # its lane is FIFO
        return b.view

    def _load(self, b: _Backend, now: float, delta: int) -> None:
        b.area += b.in_flight * (now - b.changed)
        b.changed, b.in_flight, b.view = now, b.in_flight + delta, None

    # -- the backend's side ------------------------------------------------------------

    def admit(self, b: _Backend, seq: _Seq, now: float) -> None:
        b.active += 1
        if self.config.ttft_s:
            self.push(now + self.config.ttft_s, _LANE, b, seq)
        else:
            self.lane(b, seq, now)

    def lane(self, b: _Backend, seq: _Seq, now: float) -> None:
        b.lane.append(seq)
        if not b.lane_busy:
            self.prefill(b, now)

    def prefill(self, b: _Backend, now: float) -> None:
        seq = b.lane.popleft()
        route = seq.route
        seq.cached = b.cache.match(route.block_hashes, route.prompt_tokens)
        b.lane_busy = True
        cost = (route.prompt_tokens - seq.cached) * self.config.prefill_s_per_token
        self.push(now + cost, _PREFILLED, b, seq)

    def prefilled(self, b: _Backend, seq: _Seq, now: float) -> None:
        route = seq.route
        events = b.cache.store(route.block_hashes)
        if events and self.on_kv is not None:
            self._publish(self.on_kv, b, events, now)
        seq.first = now
        self.ttft.append(now - seq.arrival)
        b.pending_tokens -= route.prompt_tokens
        b.prompt_tokens += route.prompt_tokens
        b.cached_tokens += seq.cached
        b.view = None
        if self.on_first_token is not None:
            self.on_first_token(b.name, route, now)
        b.lane_busy = False
        if b.lane:
            self.prefill(b, now)
        steps = seq.request.output_tokens - 1
        if steps <= 0:
            self.complete(b, seq, now)
            return
        self._advance(b, now)
        self.tie += 1
        heapq.heappush(b.decoding, (b.steps + steps, self.tie, seq))
        self._reschedule(b, now)

    def _publish(self, sink: Callable[..., Any], b: _Backend, events: list[KVEvent], now: float) -> None:
        self.kv_events += len(events)
        if sink(b.name, events, now) is False:
            # What the router does on a gap: resubscribe from kv_since (then -1)
            # and take everything the backend still has, here as one snapshot.
            self.resyncs += 1
            if hasattr(self.policy, "kv_since"):
                self.policy.kv_since(b.name)
            snapshot = KVEvent(seq=b.cache.seq, kind="stored", block_hashes=tuple(b.cache.contents()))
            sink(b.name, [snapshot], now)

    def _step_s(self, n: int) -> float:
        return self.config.decode_step_s * (1.0 + self.config.batch_slope * (n - 1))

    def _advance(self, b: _Backend, now: float) -> None:
        if b.batch:
            b.steps += (now - b.last_step) / self._step_s(b.batch) if self.config.decode_step_s else float("inf")
        b.last_step = now

    def _reschedule(self, b: _Backend, now: float) -> None:
        b.version += 1
        b.batch = len(b.decoding)
        if b.decoding:
            left = max(0.0, b.decoding[0][0] - b.steps)
            self.push(now + left * self._step_s(b.batch), _DECODE, b, b.version)

    def decode(self, b: _Backend, version: int, now: float) -> None:
        if version != b.version:
            return  # superseded by a later change of the batch
        self._advance(b, now)
        done = b.steps + 1e-9
        while b.decoding and b.decoding[0][0] <= done:
            self.complete(b, heapq.heappop(b.decoding)[2], now)
        self._reschedule(b, now)

    def complete(self, b: _Backend, seq: _Seq, now: float) -> None:
        self._load(b, now, -1)
        b.active -= 1
        b.served += 1
        self.completed += 1
        self.output += seq.request.output_tokens
        self.last_done = max(self.last_done, now)
        if self.on_complete is not None:
            self.on_complete(b.name, seq.route, now, ok=True, cached_tokens=seq.cached)
        if self.records is not None:
            route = seq.route
            self.records.append(RequestRecord(route.request_id, b.name, seq.arrival, seq.first, now,
                                              route.prompt_tokens, seq.cached))
        if b.waiting:
            self.admit(b, b.waiting.popleft(), now)

    # -- the loop ----------------------------------------------------------------------

    def run(self, requests: Iterable[SimRequest], progress: Progress | None) -> tuple[int, float]:
        source = iter(requests)
        first = next(source, None)
        if first is None:
            return 0, 0.0
        start, n = first.arrival, 0
        self.push(first.arrival, _ARRIVE, _Seq(first))
        events, pop = self.events, heapq.heappop
        while events:
            now, _, kind, a, b = pop(events)
            if kind == _DECODE:
                self.decode(a, b, now)
            elif kind == _PREFILLED:
                self.prefilled(a, b, now)
            elif kind == _LANE:
                self.lane(a, b, now)
            else:
                n += 1
                if progress is not None and n % 4096 == 0:
                    progress(n)
                following = next(source, None)
                if following is not None:
                    self.push(max(following.arrival, now), _ARRIVE, _Seq(following))
                self.arrive(a, now)
        return n, start


def simulate(policy: Any, requests: Iterable[SimRequest], config: ModelConfig | None = None, *,
             record: bool = False, progress: Progress | None = None) -> SimResult:
    """Run ``requests`` (in arrival order) through ``policy`` on
    ``config.backends`` modelled backends; ``record`` keeps every request's times."""
    config = config or ModelConfig()
    sim = _Sim(policy, config, record)
    wall = time.perf_counter()
    n, start = sim.run(requests, progress)
    end = max(sim.last_done, start)
    makespan = end - start
    for b in sim.backends:
        sim._load(b, end, 0)
    backends = [
        BackendResult(name=b.name, served=b.served, in_flight_mean=b.area / makespan if makespan else 0.0,
                      prompt_tokens=b.prompt_tokens, cached_tokens=b.cached_tokens,
                      evictions=b.cache.statistics().evictions)
        for b in sim.backends
    ]
    return SimResult(
        requests=n, completed=sim.completed, refused=sim.refused,
        prompt_tokens=sum(b.prompt_tokens for b in backends),
        cached_tokens=sum(b.cached_tokens for b in backends), output_tokens=sim.output,
        makespan_s=makespan, ttft_s=sim.ttft, backends=backends, kv_events=sim.kv_events,
        kv_resyncs=sim.resyncs, wall_s=time.perf_counter() - wall, records=sim.records,
    )


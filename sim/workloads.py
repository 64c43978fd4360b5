"""Built-in workloads: generators of :class:`sim.trace.TraceRecord` in arrival order.

``shared_prefix`` (the cache-aware routing benchmark's workload, issue 13):
``groups`` applications, each with its own system prompt of
``system_tokens`` tokens, shared by every conversation of the group; each
group belongs to one of ``tenants`` tenants. Conversations start as a Poisson
process; each has ``turns`` turns, and turn k's prompt is turn k-1's plus the
previous answer and a new user message, so conversations grow::

    turn 0: [system g][user 0]
    turn 1: [system g][user 0][answer 0][user 1]
    turn 2: [system g][user 0][answer 0][user 1][answer 1][user 2]

Timing: conversation starts at rate ``rate / mean turns``; a turn follows the
previous one after an exponential gap of mean ``think_s`` (think time plus
the answer's own time, which an open-loop trace cannot know), so requests
arrive at ``rate`` on average. The process is warmed up: it starts
``warmup_s`` (default: three times the longest conversation's mean span)
before t = 0 and only the turns from t = 0 on are kept, so the rate holds
from the first request, and some first requests are late turns of
conversations whose start no cache saw, as in a router that just came up. A group is picked with weight ``1 / (g + 1) **
skew`` (0: uniform). Every draw comes from one ``random.Random(seed)``, so a
seed names one trace. Generation is lazy: memory follows the conversations
in progress, not the trace length.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from sim.trace import TraceRecord

__all__ = ["WORKLOADS", "SharedPrefix", "shared_prefix"]

Positive = Annotated[int, Meta(ge=1)]
Range = tuple[Positive, Positive]


class SharedPrefix(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    requests: Positive = 10_000
    rate: Annotated[float, Meta(gt=0)] = 40.0  # requests per second, on average
    groups: Positive = 16
    tenants: Positive = 4
    system_tokens: Range = (1500, 2000)
    turns: Range = (1, 8)
    user_tokens: Range = (40, 200)
    output_tokens: Range = (50, 300)
    think_s: Annotated[float, Meta(gt=0)] = 8.0
    skew: Annotated[float, Meta(ge=0)] = 0.0
    warmup_s: Annotated[float, Meta(ge=0)] | None = None  # None: 3 x turns[1] x think_s


class _Conversation:
    __slots__ = ("cid", "group", "segments", "turn", "turns")

    def __init__(self, cid: int, group: int, turns: int, system: tuple[str, int]) -> None:
        self.cid, self.group, self.turns, self.turn = cid, group, turns, 0
        self.segments: list[tuple[str, int]] = [system]


def shared_prefix(params: SharedPrefix | None = None, *, seed: int = 0) -> Iterator[TraceRecord]:
    """The ``shared_prefix`` workload (see the module docstring)."""
    p = params or SharedPrefix()
    for lo, hi in (p.system_tokens, p.turns, p.user_tokens, p.output_tokens):
        if lo > hi:
            raise ValueError(f"empty range ({lo}, {hi})")
    rng = random.Random(seed)
    systems = [(f"{seed}.sys{g}", rng.randint(*p.system_tokens)) for g in range(p.groups)]
    weights = list(itertools.accumulate(1.0 / (g + 1) ** p.skew for g in range(p.groups)))
    start_rate = p.rate / ((p.turns[0] + p.turns[1]) / 2)
    warmup = 3 * p.turns[1] * p.think_s if p.warmup_s is None else p.warmup_s
    next_start = rng.expovariate(start_rate) - warmup
    pending: list[tuple[float, int, _Conversation]] = []  # (next turn's arrival, cid, conversation)
    cids = itertools.count()
    emitted = 0
    while emitted < p.requests:
        while not pending or next_start <= pending[0][0]:
            cid = next(cids)
            group = rng.choices(range(p.groups), cum_weights=weights)[0]
            conv = _Conversation(cid, group, rng.randint(*p.turns), systems[group])
            heapq.heappush(pending, (next_start, cid, conv))
            next_start += rng.expovariate(start_rate)
        t, _, conv = heapq.heappop(pending)
        record = _turn(conv, t, p, rng, seed)
        if t >= 0:
            emitted += 1
            yield record
        if conv.turn < conv.turns:
            heapq.heappush(pending, (t + rng.expovariate(1.0 / p.think_s), conv.cid, conv))


def _turn(conv: _Conversation, t: float, p: SharedPrefix, rng: random.Random, seed: int) -> TraceRecord:
    """The next turn of ``conv`` (advances it: the answer joins its history)."""
    k, tag = conv.turn, f"{seed}.c{conv.cid}"
    conv.segments.append((f"{tag}.u{k}", rng.randint(*p.user_tokens)))
    output = rng.randint(*p.output_tokens)
    record = TraceRecord(
        t=t, output_tokens=output, prompt=list(conv.segments), id=f"c{conv.cid}.t{k}",
        tenant=f"tenant-{conv.group % p.tenants}", group=conv.group, conversation=conv.cid, turn=k,
    )
    conv.segments.append((f"{tag}.a{k}", output))
    conv.turn += 1
    return record


WorkloadFactory = Callable[..., Iterator[TraceRecord]]

# name -> (params type, generator(params, seed=...)); adding a workload is a line here.
WORKLOADS: dict[str, tuple[type[Any], WorkloadFactory]] = {
    "shared_prefix": (SharedPrefix, shared_prefix),
}

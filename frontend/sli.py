"""Per-call SLIs (queue time, time to first token, inter-token latency,
inference time, end-to-end latency) as a gate: the router's last pipeline
stage, and the engine server's only one.

::

    arrival ──(rate limits, admission queue)──> admit ──> first event ... last event ──> gate exits
    │<──────────── queue ──────────────────────>│<────────────── inference ──────────────────>│
    │<──────────────────── ttft (per choice) ──────────────>│ itl: between token events        │
    │<──────────────────────────────────── e2e ──────────────────────────────────────────────>│

Each histogram is labelled by what ``labels(context, call)`` returns (the
router: route, model, tenant, priority; the engine: route, model), which
must be a bounded set: the caller maps unknown tenants and models to
:data:`~frontend.metric_names.OTHER`. A histogram left out (None) is not
observed: the engine has no queue before its gate, so it exports no queue
time rather than zeros. Label children are cached per label tuple, not
looked up per token, and a stream's inter-token gaps are observed
:data:`GAP_BATCH` at a time (and the rest when it ends), not one at a
time: a scrape sees a long stream's gaps at most that many tokens late.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import trio

from backends.base import Event
from frontend.context import HeldStage, Leave, RequestContext
from frontend.exposition import observe_many, observe_one

if TYPE_CHECKING:
    from prometheus_client import Histogram

    from frontend.call import Call

__all__ = ["ROUTE_OF_KIND", "CallTimer"]

GAP_BATCH = 16  # inter-token gaps a stream holds before they are observed


class GapBatch:
    """A stream's inter-token gaps, handed to ``sink`` :data:`GAP_BATCH` at
    a time and the rest by :meth:`flush` (when the stream ends), not per
    token: the SLI timer's and the dispatcher's per-backend histograms."""

    __slots__ = ("sink", "values")

    def __init__(self, sink: Callable[[list[float]], None]) -> None:
        self.sink = sink
        self.values: list[float] = []

    def add(self, seconds: float, zeros: int = 0) -> None:
        """A gap, then ``zeros`` gaps of 0 (tokens that came with it)."""
        self.values.append(seconds)
        if zeros:
            self.values += [0.0] * zeros
        if len(self.values) >= GAP_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.values:
            self.sink(self.values)
            self.values = []

class ReadClock:
    """The time of each event of a stream, one clock reading for the events
    of one upstream read: they came together (each but the last marked
    ``more_ready``) and leave for the client in one write, so their gaps are
    0 and the next read's gap is counted from the first one's reading. A
    clock reading an event cost ~2% of the router's CPU a streamed request
    where a whole answer comes in one read."""

    __slots__ = ("at", "clock")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.at: float | None = None  # the current read's reading, while its events last

    def of(self, event: Event) -> float:
        at = self.at
        if at is None:
            at = self.clock()
        self.at = at if event.more_ready else None
        return at


ROUTE_OF_KIND = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "native": "/v1/generate"}

Labels = Callable[[RequestContext, "Call"], tuple[str, ...]]


class _Children:
    """One histogram's children by label tuple."""

    __slots__ = ("cache", "family")

    def __init__(self, family: Histogram) -> None:
        self.family = family
        self.cache: dict[tuple[str, ...], Histogram] = {}

    def child(self, labels: tuple[str, ...]) -> Histogram:
        child = self.cache.get(labels)
        if child is None:
            child = self.cache[labels] = self.family.labels(*labels)
        return child

    def observe(self, labels: tuple[str, ...], seconds: float) -> None:
        observe_one(self.child(labels), seconds)

    def observe_many(self, labels: tuple[str, ...], seconds: list[float]) -> None:
        observe_many(self.child(labels), seconds)


class CallTimer(HeldStage):
    """A :class:`~frontend.context.Gate` that times each call it admits."""

    def __init__(
        self,
        labels: Labels,
        *,
        ttft: Histogram,
        itl: Histogram,
        e2e: Histogram,
        queue: Histogram | None = None,
        inference: Histogram | None = None,
        done: Callable[[tuple[str, ...], float], None] | None = None,
    ) -> None:
        self.labels, self.done = labels, done
        self.ttft, self.itl, self.e2e = _Children(ttft), _Children(itl), _Children(e2e)
        self.queue = _Children(queue) if queue is not None else None
        self.inference = _Children(inference) if inference is not None else None

    async def _admit(self, context: RequestContext, call: Call) -> Leave:
        admitted = trio.current_time()
        labels = self.labels(context, call)
        if self.queue is not None:
            self.queue.observe(labels, admitted - context.arrival)
        call.watch(partial(_TimedStream, self, labels, context.arrival))
        return partial(self._done, labels, context.arrival, admitted)

    def _done(self, labels: tuple[str, ...], arrival: float, admitted: float) -> None:
        done = trio.current_time()
        self.e2e.observe(labels, done - arrival)
        if self.inference is not None:
            self.inference.observe(labels, done - admitted)
        if self.done is not None:  # the slot's hold time: the service time of a capacity model
            self.done(labels, done - admitted)


class _TimedStream:
    """One stream's first event and token gaps, timed (a
    :class:`~frontend.call.StreamWatch`)."""

    __slots__ = ("arrival", "clock", "gaps", "labels", "last", "timer")

    def __init__(self, timer: CallTimer, labels: tuple[str, ...], arrival: float) -> None:
        self.timer, self.labels, self.arrival = timer, labels, arrival
        self.clock = ReadClock(trio.current_time)
        self.last: float | None = None
        self.gaps = GapBatch(partial(timer.itl.observe_many, labels))

    def events(self, events: Sequence[Event]) -> None:
        # One clock reading for the events of one read (shown together, or
        # one at a time, ``more_ready``): the first token's gap is since the
        # last read, the others' 0.
        now = self.clock.of(events[-1])
        last, tokens = self.last, 0
        for event in events:
            if last is None:
                self.timer.ttft.observe(self.labels, now - self.arrival)
                last = now
            elif event.token_ids or event.text:
                tokens += 1
        if tokens and last is not None:  # (it is, once there are tokens)
            self.gaps.add(now - last, tokens - 1)
            last = now
        self.last = last

    def end(self) -> None:
        self.gaps.flush()

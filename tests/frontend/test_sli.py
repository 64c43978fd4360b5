"""The per-call SLI histograms: inter-token gaps observed a batch at a time
while the stream runs, and the rest however it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
import trio.testing
from prometheus_client import CollectorRegistry, Histogram

from backends.base import Event, GenerateRequest
from frontend.call import watched
from frontend.sli import GAP_BATCH, CallTimer, _TimedStream


class _Tokens:
    """A backend stub: ``n`` token events, ``gap`` seconds apart."""

    def __init__(self, n: int, gap: float) -> None:
        self.n, self.gap = n, gap

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        for i in range(self.n):
            await trio.sleep(self.gap)
            yield Event(text=f" t{i}", token_ids=[i])


def _timer() -> tuple[CallTimer, Histogram]:
    registry = CollectorRegistry()
    hist = lambda name: Histogram(name, name, ["route"], registry=registry, buckets=(0.05, 0.5))  # noqa: E731
    itl = hist("itl")
    return CallTimer(lambda c, k: ("r",), ttft=hist("ttft"), itl=itl, e2e=hist("e2e")), itl


def _count(itl: Histogram) -> tuple[float, float]:
    samples = {s.name: s.value for metric in itl.collect() for s in metric.samples}
    return samples.get("itl_count", 0.0), samples.get("itl_sum", 0.0)


async def test_gaps_are_observed_at_most_a_batch_late_and_all_of_them_at_the_end(autojump_clock: trio.testing.MockClock) -> None:
    timer, itl = _timer()
    n = 2 * GAP_BATCH + 3
    stream = watched(_Tokens(n, 0.1).stream(GenerateRequest()), [_TimedStream(timer, ("r",), trio.current_time())])
    seen = []
    async for _ in stream:
        seen.append(_count(itl)[0])
    count, total = _count(itl)
    assert count == n - 1 and abs(total - (n - 1) * 0.1) < 1e-9
    assert all(0 <= k - 1 - c < GAP_BATCH for k, c in enumerate(seen, start=1)), seen
    assert seen[GAP_BATCH] == GAP_BATCH


async def test_a_stream_the_client_leaves_still_observes_its_gaps(autojump_clock: trio.testing.MockClock) -> None:
    timer, itl = _timer()
    stream = watched(_Tokens(100, 0.1).stream(GenerateRequest()), [_TimedStream(timer, ("r",), trio.current_time())])
    got = 0
    async for _ in stream:
        got += 1
        if got == 5:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert _count(itl)[0] == 4


class _Reads:
    """Reads of 3 token events 0.1 s apart, each read's events but its last ``more_ready``."""

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        for i in range(6):
            if i % 3 == 0:
                await trio.sleep(0.1)
            yield Event(text=f" t{i}", token_ids=[i], more_ready=i % 3 != 2)


async def test_the_events_of_one_read_have_no_gap_between_them(autojump_clock: trio.testing.MockClock) -> None:
    """They leave for the client in one write: one clock reading for them
    (at the first), however long the consumer takes over each (here 10 ms,
    which the gap to the next read then includes: 0.1 + 3 x 0.01 s)."""
    timer, itl = _timer()
    async for _ in watched(_Reads().stream(GenerateRequest()), [_TimedStream(timer, ("r",), trio.current_time())]):
        await trio.sleep(0.01)
    count, total = _count(itl)
    assert count == 5 and abs(total - 0.13) < 1e-9  # a clock reading per event: 4 x 0.01 more

"""The events waiting between a streamed call's backend pumps and its producer
are bounded by count and by text (frontend/call.py CHANNEL_TEXT_BYTES): for a
client that stops reading, that is what the router holds per stream beyond
its unsent-output limits before it stops reading the backend (issue 17: 100
zero-window streams of 1 KB tokens held 64 events each)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
import trio.testing

from backends.base import Event
from frontend.call import CHANNEL_EVENTS, _pump, _TextBudget


class Source:
    """An endless backend stream of events of ``size`` characters, counting what it yields."""

    def __init__(self, size: int) -> None:
        self.size, self.yielded = size, 0

    async def stream(self) -> AsyncIterator[Event]:
        while True:
            self.yielded += 1
            yield Event(token_ids=[self.yielded], text="x" * self.size)
            await trio.lowlevel.checkpoint()


async def _pumped(size: int, limit: int, take: int = 0) -> tuple[Source, _TextBudget, int]:
    """Pump ``Source(size)`` with nobody reading until it blocks; then the
    producer's part for ``take`` events; returns what it yielded by then."""
    source, budget = Source(size), _TextBudget(limit)
    send, recv = trio.open_memory_channel[tuple[int, object]](CHANNEL_EVENTS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_pump, 0, source.stream(), send, budget)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(take):
            _, event = recv.receive_nowait()
            budget.give(len(event.text))  # type: ignore[attr-defined]
        await trio.testing.wait_all_tasks_blocked()
        yielded = source.yielded
        nursery.cancel_scope.cancel()
    return source, budget, yielded


async def test_large_events_stop_the_pump_at_the_text_bound() -> None:
    _, budget, yielded = await _pumped(size=1000, limit=8192)
    assert budget.held == 8000  # 8 events in the channel; the 9th waits in the pump
    assert yielded == 9


async def test_the_pump_resumes_as_the_producer_takes_text() -> None:
    _, budget, yielded = await _pumped(size=1000, limit=8192, take=3)
    assert budget.held == 8000  # refilled to the bound, no further
    assert yielded == 12


async def test_small_events_are_bounded_by_count_as_before() -> None:
    _, budget, yielded = await _pumped(size=5, limit=8192)
    # The count binds (one upstream read's events stay together): a full
    # channel, and one more taken from the budget that waits to be sent.
    assert budget.held == 5 * (CHANNEL_EVENTS + 1)
    assert yielded == CHANNEL_EVENTS + 1


async def test_an_event_larger_than_the_bound_still_passes_alone() -> None:
    _, budget, yielded = await _pumped(size=20_000, limit=8192)
    assert budget.held == 20_000  # one in the channel; the next waits for it to be taken
    assert yielded == 2

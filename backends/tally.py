"""Counting a backend's streams: in flight, and how each one ended."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Literal

from backends.base import Event
from backends.errors import HeadraceError

__all__ = ["Outcome", "StreamTally"]

Outcome = Literal["completed", "failed", "cancelled"]


class StreamTally:
    """A stream is *completed* once its final event went out, *failed* when
    it raised a :class:`~backends.errors.HeadraceError`, and *cancelled*
    otherwise (the consumer left).

    :meth:`track` counts an async generator of events; a consumer that runs a
    stream without one (the mock's fast path) calls :meth:`begin` and
    :meth:`end` itself."""

    def __init__(self) -> None:
        self.in_flight = self.started = 0
        self.completed = self.failed = self.cancelled = 0

    def begin(self) -> None:
        self.in_flight += 1
        self.started += 1

    def end(self, outcome: Outcome) -> None:
        self.in_flight -= 1
        setattr(self, outcome, getattr(self, outcome) + 1)

    async def track(self, events: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
        self.begin()
        outcome: Outcome = "cancelled"
        try:
            async with aclosing(events) as stream:
                async for event in stream:
                    if event.finish_reason is not None:
                        outcome = "completed"
                    yield event
        except HeadraceError:
            outcome = "failed"
            raise
        finally:
            self.end(outcome)

"""Counting a backend's streams: in flight, and how each one ended."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from backends.base import Event
from backends.errors import HeadraceError

__all__ = ["StreamTally"]


class StreamTally:
    """A stream is *completed* once its final event went out, *failed* when
    it raised a :class:`~backends.errors.HeadraceError`, and *cancelled*
    otherwise (the consumer left)."""

    def __init__(self) -> None:
        self.in_flight = self.started = 0
        self.completed = self.failed = self.cancelled = 0

    async def track(self, events: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
        self.in_flight += 1
        self.started += 1
        outcome = "cancelled"
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
            self.in_flight -= 1
            setattr(self, outcome, getattr(self, outcome) + 1)

"""Fakes for router tests: wrappers that make any Backend slow, flaky or
stalling, in the spirit of httpx's ``MockTransport``.

Each is a real :class:`~backends.base.Backend` (it wraps one, by default a
:class:`~backends.mock.MockBackend`), so it runs through the conformance
suite too; with its failure knobs at zero it behaves exactly like the inner
backend. Delays use ``trio.sleep``, so ``MockClock`` drives them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager

import msgspec
import trio

from backends.base import Backend, BackendInfo, Event, GenerateRequest, Health
from backends.errors import BackendUnavailable, HeadraceError, StreamBroken
from backends.mock import MockBackend

__all__ = ["FakeStatistics", "FlakyBackend", "SlowBackend", "StallingBackend", "WrappedBackend"]

ErrorFactory = Callable[[str], HeadraceError]


@asynccontextmanager
async def _closing(events: AsyncIterator[Event]) -> AsyncGenerator[AsyncIterator[Event], None]:
    """``aclosing`` for a Backend's stream, typed as the protocol's iterator."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class FakeStatistics(msgspec.Struct, frozen=True):
    requests: int  # streams started
    injected: int  # streams the fake broke (failed or stalled)
    in_flight: int


class WrappedBackend:
    """Delegates everything to ``inner``; subclasses change ``stream``."""

    def __init__(self, inner: Backend | None = None) -> None:
        self.inner: Backend = inner if inner is not None else MockBackend()
        self.requests = 0
        self.injected = 0
        self.in_flight = 0

    def info(self) -> BackendInfo:
        return self.inner.info()

    async def health(self) -> Health:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> FakeStatistics:
        return FakeStatistics(self.requests, self.injected, self.in_flight)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.requests += 1
        self.in_flight += 1
        try:
            async with aclosing(self._stream(self.requests, request)) as events:
                async for event in events:
                    yield event
        finally:
            self.in_flight -= 1

    async def _stream(self, number: int, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        async with _closing(self.inner.stream(request)) as events:
            async for event in events:
                yield event

    async def _prefix(self, request: GenerateRequest, limit: int, sent: list[int]) -> AsyncGenerator[Event, None]:
        """The inner stream's first ``limit`` events, never its final one;
        ``sent[0]`` counts what went out (for the fault's message)."""
        self.injected += 1
        async with _closing(self.inner.stream(request)) as events:
            async for event in events:
                if sent[0] == limit or event.finish_reason is not None:
                    break
                sent[0] += 1
                yield event


class SlowBackend(WrappedBackend):
    """Adds ``ttft_s`` before the first event and ``tpot_s`` before each
    later one."""

    def __init__(
        self, inner: Backend | None = None, *, ttft_s: float = 0.0, tpot_s: float = 0.0
    ) -> None:
        super().__init__(inner)
        if ttft_s < 0 or tpot_s < 0:
            raise ValueError("delays must be non-negative")
        self.ttft_s, self.tpot_s = ttft_s, tpot_s

    async def _stream(self, number: int, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        first = True
        async with _closing(self.inner.stream(request)) as events:
            async for event in events:
                await trio.sleep(self.ttft_s if first else self.tpot_s)
                first = False
                yield event


class FlakyBackend(WrappedBackend):
    """Fails the first ``fail_first`` streams, and every ``fail_every``-th one
    (counting from 1). A failing stream raises ``error(message)`` after
    ``after_events`` events: before any event it defaults to
    :class:`BackendUnavailable` (retry elsewhere), after some to
    :class:`StreamBroken` (migrate)."""

    def __init__(
        self,
        inner: Backend | None = None,
        *,
        fail_first: int = 0,
        fail_every: int = 0,
        after_events: int = 0,
        error: ErrorFactory | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(inner)
        if fail_first < 0 or fail_every < 0 or after_events < 0:
            raise ValueError("fail_first, fail_every and after_events must be non-negative")
        self.fail_first, self.fail_every, self.after_events = fail_first, fail_every, after_events
        self.retry_after = retry_after
        self.error = error or self._default_error

    def fails(self, number: int) -> bool:
        """Whether stream number ``number`` (from 1) is one that fails."""
        return number <= self.fail_first or (self.fail_every > 0 and number % self.fail_every == 0)

    def _default_error(self, message: str) -> HeadraceError:
        if self.after_events:
            return StreamBroken(message)
        return BackendUnavailable(message, retry_after=self.retry_after)

    async def _stream(self, number: int, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        if not self.fails(number):
            async with aclosing(super()._stream(number, request)) as events:
                async for event in events:
                    yield event
            return
        sent = [0]
        async with aclosing(self._prefix(request, self.after_events, sent)) as events:
            async for event in events:
                yield event
        raise self.error(f"flaky backend: stream {number} failed after {sent[0]} events")


class StallingBackend(WrappedBackend):
    """After ``after_events`` events, stops sending and keeps the stream open
    until cancelled: the first ``stall_first`` streams, and every
    ``stall_every``-th (counting from 1). Defaults stall every stream."""

    def __init__(
        self,
        inner: Backend | None = None,
        *,
        after_events: int = 0,
        stall_first: int = 0,
        stall_every: int = 1,
    ) -> None:
        super().__init__(inner)
        if after_events < 0 or stall_first < 0 or stall_every < 0:
            raise ValueError("after_events, stall_first and stall_every must be non-negative")
        self.after_events, self.stall_first, self.stall_every = (
            after_events,
            stall_first,
            stall_every,
        )
        self.stalled = 0  # streams now stalled

    def stalls(self, number: int) -> bool:
        return number <= self.stall_first or (
            self.stall_every > 0 and number % self.stall_every == 0
        )

    async def _stream(self, number: int, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        if not self.stalls(number):
            async with aclosing(super()._stream(number, request)) as events:
                async for event in events:
                    yield event
            return
        async with aclosing(self._prefix(request, self.after_events, [0])) as events:
            async for event in events:
                yield event
        self.stalled += 1
        try:
            await trio.sleep_forever()
        finally:
            self.stalled -= 1

"""Slow, flaky and stalling wrappers: real Backends whose misbehaviour is
exactly what they promise, on the trio MockClock."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio
import trio.testing

from backends.base import Backend, GenerateRequest
from backends.errors import BackendUnavailable, StreamBroken, UpstreamError
from backends.fakes import FlakyBackend, SlowBackend, StallingBackend
from backends.mock import MockBackend
from tests.backends.conftest import collect, collect_until_error, ids_of

REQUEST = GenerateRequest(prompt="fake", max_tokens=5, seed=3)


async def test_fakes_are_backends_that_pass_through_when_their_knobs_are_zero() -> None:
    expected = ids_of(await collect(MockBackend(), REQUEST))
    for fake in (SlowBackend(), FlakyBackend(), StallingBackend(stall_every=0)):
        assert isinstance(fake, Backend)
        assert ids_of(await collect(fake, REQUEST)) == expected
        assert fake.info().token_ids and (await fake.health()).ok
        assert fake.statistics().injected == 0
        await fake.aclose()


async def test_slow_backend_adds_its_delays(autojump_clock: trio.testing.MockClock) -> None:
    fake = SlowBackend(ttft_s=1.0, tpot_s=0.25)
    start, stamps = trio.current_time(), []
    async with aclosing(fake.stream(REQUEST)) as events:
        async for _ in events:
            stamps.append(trio.current_time() - start)
    assert stamps == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])


async def test_flaky_backend_fails_the_first_k_then_every_kth() -> None:
    fake = FlakyBackend(fail_first=2, fail_every=4, retry_after=1.5)
    outcomes = []
    for _ in range(8):
        try:
            await collect(fake, REQUEST)
            outcomes.append("ok")
        except BackendUnavailable as exc:
            assert exc.retry_after == 1.5
            outcomes.append("fail")
    assert outcomes == ["fail", "fail", "ok", "fail", "ok", "ok", "ok", "fail"]
    assert fake.statistics().injected == 4 and fake.statistics().in_flight == 0


async def test_flaky_backend_can_break_mid_stream_with_valid_tokens_first() -> None:
    fake = FlakyBackend(fail_first=1, after_events=2)
    events, exc = await collect_until_error(fake, REQUEST)
    assert isinstance(exc, StreamBroken)
    assert ids_of(events) == ids_of(await collect(MockBackend(), REQUEST))[:2]
    custom = FlakyBackend(fail_first=1, error=UpstreamError)
    _, exc = await collect_until_error(custom, REQUEST)
    assert type(exc) is UpstreamError


async def test_stalling_backend_goes_silent_until_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inner = MockBackend()
    fake = StallingBackend(inner, after_events=2, stall_first=1, stall_every=0)
    got = []
    with trio.move_on_after(1000) as scope:
        async with aclosing(fake.stream(REQUEST)) as events:
            async for e in events:
                got.append(e)
                assert fake.stalled == 0
    assert scope.cancelled_caught and len(got) == 2 and fake.stalled == 0
    assert inner.statistics().cancelled == 1
    assert len(await collect(fake, REQUEST)) == 5  # only the first stalls


def test_bad_knobs_are_rejected() -> None:
    with pytest.raises(ValueError):
        FlakyBackend(fail_first=-1)
    with pytest.raises(ValueError):
        SlowBackend(ttft_s=-1)
    with pytest.raises(ValueError):
        StallingBackend(after_events=-2)

"""Backend health as a transition table; actors probe, count and get restarted."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from backends.base import GenerateRequest
from router.actors import BackendActor, Supervisor
from router.health import TRANSITIONS, HealthEvent, HealthState, LifecycleError, next_state
from tests.router.fakes import FakeBackend


@given(st.lists(st.sampled_from(list(HealthEvent)), max_size=30))
def test_health_table_follows_the_last_probe_until_close(events: list[HealthEvent]) -> None:
    state = HealthState.UNKNOWN
    for event in events:
        if state is HealthState.CLOSED:
            with pytest.raises(LifecycleError):
                next_state(state, event)
            continue
        state = next_state(state, event)
        expected = {HealthEvent.PROBE_OK: HealthState.UP, HealthEvent.PROBE_FAILED: HealthState.DOWN}
        assert state is expected.get(event, HealthState.CLOSED)


def test_health_table_is_the_only_source_of_transitions() -> None:
    open_states = [s for s in HealthState if s is not HealthState.CLOSED]
    assert set(TRANSITIONS) == {(s, e) for s in open_states for e in HealthEvent}
    with pytest.raises(LifecycleError, match="no transition from CLOSED on PROBE_OK"):
        next_state(HealthState.CLOSED, HealthEvent.PROBE_OK)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_actor_marks_down_after_two_failed_probes_and_up_when_one_passes(clock: trio.testing.MockClock) -> None:
    """The first failure re-probes at once; the second takes the backend down."""
    fake = FakeBackend()
    actor = BackendActor("a", fake, probe_interval=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        assert actor.state is HealthState.UP and actor.models == ("m",)
        fake.healthy = False
        await trio.sleep(1.5)
        assert actor.state is HealthState.DOWN
        assert actor.statistics().detail == "connection refused"
        fake.healthy = True
        await trio.sleep(1.0)
        assert actor.state is HealthState.UP
        nursery.cancel_scope.cancel()
    assert fake.probes == 4


async def test_one_failed_probe_does_not_eject_an_up_backend(clock: trio.testing.MockClock) -> None:
    fake = FakeBackend()
    actor = BackendActor("a", fake, unhealthy_threshold=3)
    await actor.probe()
    fake.healthy = False
    await actor.probe()
    await actor.probe()
    assert actor.state is HealthState.UP and actor.eligible(None)
    fake.healthy = True
    await actor.probe()  # a success resets the count
    fake.healthy = False
    await actor.probe()
    await actor.probe()
    assert actor.state is HealthState.UP
    await actor.probe()
    assert actor.state is HealthState.DOWN
    assert actor.statistics().probe_failures == 5


async def test_probe_slower_than_timeout_counts_as_failed(clock: trio.testing.MockClock) -> None:
    fake = FakeBackend()
    fake.hang_probe = True
    actor = BackendActor("a", fake, probe_timeout=0.5)
    start = trio.current_time()
    await actor.probe()
    assert trio.current_time() - start == pytest.approx(0.5)
    assert actor.state is HealthState.DOWN
    assert actor.statistics().probe_failures == 1


async def test_suspect_triggers_a_probe_before_the_interval(clock: trio.testing.MockClock) -> None:
    fake = FakeBackend()
    actor = BackendActor("a", fake, probe_interval=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        fake.healthy = False
        actor.suspect()
        await trio.sleep(0.01)
        assert actor.state is HealthState.DOWN
        nursery.cancel_scope.cancel()


async def test_drained_or_down_actor_is_not_eligible() -> None:
    actor = BackendActor("a", FakeBackend(models=("m",)))
    assert not actor.eligible(None)  # not probed yet
    await actor.probe()
    assert actor.eligible("m") and actor.eligible(None) and not actor.eligible("other")
    actor.drain()
    assert not actor.eligible("m") and actor.view().draining
    actor.undrain()
    assert actor.eligible("m")


async def test_actor_counts_in_flight_tokens_and_cancellations() -> None:
    fake = FakeBackend(delay=0.01)
    actor = BackendActor("a", fake)
    seen = []
    async for event in actor.stream(GenerateRequest(max_tokens=3)):
        seen.append(actor.in_flight)
        assert event.token_ids
    assert seen == [1, 1, 1] and actor.in_flight == 0
    with trio.move_on_after(0.015):
        async for _ in actor.stream(GenerateRequest(max_tokens=100)):
            pass
    stats = actor.statistics()
    assert (stats.requests, stats.tokens, stats.cancelled, stats.in_flight) == (2, 4, 1, 0)
    assert fake.cancelled == 1


async def test_supervisor_restarts_a_crashed_actor_with_backoff(
    clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeBackend()
    fake.crash_probe = 3  # the first probe, then two restarts, crash
    actor = BackendActor("a", fake, probe_interval=100.0)
    supervisor = Supervisor([actor], backoff=1.0, backoff_max=8.0)
    with caplog.at_level(logging.ERROR, logger="router.actors"):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            assert actor.state is HealthState.DOWN  # crashed on its first probe
            # backoff 1 + 2 + 4 before the fourth run succeeds
            await trio.sleep(6.9)
            assert actor.state is HealthState.DOWN
            await trio.sleep(0.2)
            assert actor.state is HealthState.UP
            nursery.cancel_scope.cancel()
    assert actor.statistics().restarts == 3
    assert sum("crashed; restarting" in r.message for r in caplog.records) == 3


async def test_closed_actor_stops_probing_and_closes_its_backend(clock: trio.testing.MockClock) -> None:
    fake = FakeBackend()
    actor = BackendActor("a", fake, probe_interval=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(Supervisor([actor]).run)
        await actor.aclose()
        await trio.sleep(5)
        assert fake.probes == 1 and fake.closed and actor.state is HealthState.CLOSED

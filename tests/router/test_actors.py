"""Backend health as one transition table fed by probes, by every request
outcome and by the breaker's transitions; actors probe, count, and report
each stream's outcome."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Event, GenerateRequest
from backends.errors import BackendUnavailable, BadRequest, StreamBroken, UpstreamRateLimited
from router.actors import BackendActor, Supervisor
from router.health import (
    TRANSITIONS,
    BackendHealth,
    HealthEvent,
    HealthState,
    LifecycleError,
    next_state,
)
from tests.router.fakes import FakeBackend

S, E = HealthState, HealthEvent
PROBES = (E.PROBE_OK, E.PROBE_FAILED, E.PROBE_THRESHOLD)
REQUESTS = (E.REQUEST_OK, E.REQUEST_FAILED_EARLY, E.REQUEST_FAILED_LATE)
BREAKER = (E.EJECT, E.COOLED, E.RECOVERED)

# Written out pair by pair (not derived from the module) so a change to the
# table is a change here too.
EXPECTED = {
    S.UNKNOWN: {E.PROBE_OK: S.UP, E.PROBE_FAILED: S.DOWN, E.PROBE_THRESHOLD: S.DOWN,
                E.REQUEST_OK: S.UNKNOWN, E.REQUEST_FAILED_EARLY: S.UNKNOWN, E.REQUEST_FAILED_LATE: S.UNKNOWN,
                E.CRASHED: S.DOWN, E.CLOSE: S.CLOSED},
    S.UP: {E.PROBE_OK: S.UP, E.PROBE_FAILED: S.SUSPECT, E.PROBE_THRESHOLD: S.DOWN,
           E.REQUEST_OK: S.UP, E.REQUEST_FAILED_EARLY: S.SUSPECT, E.REQUEST_FAILED_LATE: S.SUSPECT,
           E.EJECT: S.EJECTED, E.CRASHED: S.DOWN, E.CLOSE: S.CLOSED},
    S.SUSPECT: {E.PROBE_OK: S.UP, E.PROBE_FAILED: S.SUSPECT, E.PROBE_THRESHOLD: S.DOWN,
                E.REQUEST_OK: S.SUSPECT, E.REQUEST_FAILED_EARLY: S.SUSPECT, E.REQUEST_FAILED_LATE: S.SUSPECT,
                E.EJECT: S.EJECTED, E.CRASHED: S.DOWN, E.CLOSE: S.CLOSED},
    # The breaker's states: probes do not end an ejection, a failed one is
    # DOWN at once (no trial requests to a backend whose probes fail).
    S.EJECTED: {E.PROBE_OK: S.EJECTED, E.PROBE_FAILED: S.DOWN, E.PROBE_THRESHOLD: S.DOWN,
                E.REQUEST_OK: S.EJECTED, E.REQUEST_FAILED_EARLY: S.EJECTED, E.REQUEST_FAILED_LATE: S.EJECTED,
                E.COOLED: S.HALF_OPEN, E.CRASHED: S.DOWN, E.CLOSE: S.CLOSED},
    S.HALF_OPEN: {E.PROBE_OK: S.HALF_OPEN, E.PROBE_FAILED: S.DOWN, E.PROBE_THRESHOLD: S.DOWN,
                  E.REQUEST_OK: S.HALF_OPEN, E.REQUEST_FAILED_EARLY: S.HALF_OPEN, E.REQUEST_FAILED_LATE: S.HALF_OPEN,
                  E.EJECT: S.EJECTED, E.RECOVERED: S.UP, E.CRASHED: S.DOWN, E.CLOSE: S.CLOSED},
    S.DOWN: {E.PROBE_OK: S.UP, E.PROBE_FAILED: S.DOWN, E.PROBE_THRESHOLD: S.DOWN,
             E.REQUEST_OK: S.DOWN, E.REQUEST_FAILED_EARLY: S.DOWN, E.REQUEST_FAILED_LATE: S.DOWN,
             E.CRASHED: S.DOWN, E.CLOSE: S.CLOSED},
    S.CLOSED: {E.REQUEST_OK: S.CLOSED, E.REQUEST_FAILED_EARLY: S.CLOSED, E.REQUEST_FAILED_LATE: S.CLOSED},
}


@pytest.mark.parametrize("state", list(HealthState))
@pytest.mark.parametrize("event", list(HealthEvent))
def test_health_table_has_every_legal_pair_and_raises_on_the_rest(state: HealthState, event: HealthEvent) -> None:
    expected = EXPECTED[state].get(event)
    if expected is None:
        assert (state, event) not in TRANSITIONS
        with pytest.raises(LifecycleError, match=f"no transition from {state.name} on {event.name}"):
            next_state(state, event)
    else:
        assert next_state(state, event) is expected


def test_health_table_holds_exactly_the_legal_pairs() -> None:
    assert {(s, e): t for s, row in EXPECTED.items() for e, t in row.items()} == TRANSITIONS


def model_state(events: list[HealthEvent], threshold: int) -> tuple[HealthState, int]:
    """An independent model of BackendHealth: the state and failed-probe count
    after ``events`` (none of which is illegal)."""
    state, failed = S.UNKNOWN, 0
    for event in events:
        if event is E.CLOSE:
            state = S.CLOSED
        elif event is E.CRASHED:
            state = S.DOWN
        elif event is E.PROBE_OK:
            state, failed = (state if state in (S.EJECTED, S.HALF_OPEN) else S.UP), 0
        elif event in (E.PROBE_FAILED, E.PROBE_THRESHOLD):
            failed += 1
            known_up = state in (S.UP, S.SUSPECT)
            state = S.SUSPECT if known_up and failed < threshold else S.DOWN
        elif event is E.EJECT:
            state = S.EJECTED
        elif event is E.COOLED:
            state = S.HALF_OPEN
        elif event is E.RECOVERED:
            state = S.UP
        elif event is not E.REQUEST_OK and state is S.UP:
            state = S.SUSPECT
    return state, failed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(HealthEvent)), max_size=40), st.integers(1, 4))
def test_backend_health_follows_probes_requests_and_the_breaker_until_close(events: list[HealthEvent], threshold: int) -> None:
    """Probes move the state (an up backend needs ``threshold`` failures in a
    row to go down), request failures only make an up backend suspect, the
    breaker's transitions eject and restore a backend the probes keep up, and
    after close only request outcomes are legal."""
    health = BackendHealth(threshold)
    legal: list[HealthEvent] = []
    for event in events:
        if event not in EXPECTED[health.state]:
            with pytest.raises(LifecycleError):
                health.handle(event)
            continue
        legal.append(event)
        assert health.handle(event) is health.state
        assert (health.state, health.failed_probes) == model_state(legal, threshold)
    stats = health.statistics()
    assert sum(stats.events.values()) == len(legal)
    assert stats.state == health.state.value


def test_the_threshold_th_failed_probe_is_counted_as_probe_threshold() -> None:
    health = BackendHealth(3)
    for event in (E.PROBE_OK, E.PROBE_FAILED, E.PROBE_FAILED):
        health.handle(event)
    assert (health.state, health.failed_probes) == (S.SUSPECT, 2)
    assert health.handle(E.PROBE_FAILED) is S.DOWN
    stats = health.statistics()
    assert (stats.events["probe_failed"], stats.events["probe_threshold"]) == (2, 1)
    assert stats.transitions == 3  # UNKNOWN -> UP -> SUSPECT -> DOWN
    assert health.handle(E.PROBE_OK) is S.UP and health.failed_probes == 0


def test_an_illegal_event_changes_nothing() -> None:
    health = BackendHealth()
    health.handle(E.CLOSE)
    with pytest.raises(LifecycleError):
        health.handle(E.PROBE_FAILED)
    assert health.failed_probes == 0 and health.statistics().events["probe_threshold"] == 0


def test_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BackendHealth(0)


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
    assert actor.state is HealthState.SUSPECT and actor.eligible(None) and actor.view().healthy
    fake.healthy = True
    await actor.probe()  # a success resets the count
    assert actor.state is HealthState.UP
    fake.healthy = False
    await actor.probe()
    await actor.probe()
    assert actor.state is HealthState.SUSPECT and actor.statistics().health.failed_probes == 2
    await actor.probe()
    assert actor.state is HealthState.DOWN and not actor.eligible(None)
    assert actor.statistics().probe_failures == 5


async def test_a_backend_not_yet_up_goes_down_on_its_first_failed_probe() -> None:
    fake = FakeBackend()
    fake.healthy = False
    actor = BackendActor("a", fake, unhealthy_threshold=3)
    await actor.probe()
    assert actor.state is HealthState.DOWN


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


async def test_closed_actor_stops_probing_and_closes_its_backend(clock: trio.testing.MockClock) -> None:
    fake = FakeBackend()
    actor = BackendActor("a", fake, probe_interval=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(Supervisor([actor]).run)
        await actor.aclose()
        await trio.sleep(5)
        assert fake.probes == 1 and fake.closed and actor.state is HealthState.CLOSED


async def drain(actor: BackendActor, request: GenerateRequest | None = None) -> int:
    n = 0
    async for _ in actor.stream(request or GenerateRequest(max_tokens=3)):
        n += 1
    return n


async def test_a_request_that_fails_before_its_first_token_makes_an_up_backend_suspect_and_probed(
    clock: trio.testing.MockClock,
) -> None:
    fake = FakeBackend(fail_before=BackendUnavailable("refused"))
    actor = BackendActor("a", fake, probe_interval=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        with pytest.raises(BackendUnavailable):
            await drain(actor)
        assert actor.state is HealthState.SUSPECT and actor.eligible(None)
        assert fake.probes == 1
        await trio.sleep(0.01)  # the prober probes at once, not after 60 s
        assert fake.probes == 2 and actor.state is HealthState.UP
        nursery.cancel_scope.cancel()
    events = actor.statistics().health.events
    assert events["request_failed_early"] == 1 and events["probe_ok"] == 2


async def test_a_stream_that_breaks_after_its_first_token_is_reported_as_a_late_failure(
    clock: trio.testing.MockClock,
) -> None:
    fake = FakeBackend(break_after=1)
    actor = BackendActor("a", fake, probe_interval=60.0, unhealthy_threshold=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        fake.healthy = False  # the backend died: the probe the failure triggers finds it down
        with pytest.raises(StreamBroken):
            await drain(actor)
        assert actor.state is HealthState.SUSPECT
        await trio.sleep(0.01)
        assert actor.state is HealthState.DOWN
        nursery.cancel_scope.cancel()
    stats = actor.statistics()
    assert stats.health.events["request_failed_late"] == 1 and stats.failures == 1


async def test_untranslated_adapter_errors_are_failures_early_or_late() -> None:
    class Buggy(FakeBackend):
        async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
            if request.max_tokens == 1:
                raise KeyError("early")
            async for event in super().stream(request):
                yield event
                raise KeyError("late")

    actor = BackendActor("a", Buggy())
    await actor.probe()
    with pytest.raises(StreamBroken):
        await drain(actor, GenerateRequest(max_tokens=2))
    with pytest.raises(BackendUnavailable):
        await drain(actor, GenerateRequest(max_tokens=1))
    events = actor.statistics().health.events
    assert (events["request_failed_late"], events["request_failed_early"]) == (1, 1)


async def test_finished_streams_and_client_errors_are_request_ok_and_cancels_are_not_reported() -> None:
    actor = BackendActor("a", FakeBackend(delay=0.01))
    await actor.probe()
    assert await drain(actor) == 3
    actor.backend = FakeBackend(fail_before=BadRequest("prompt too long"))
    with pytest.raises(BadRequest):
        await drain(actor)
    actor.backend = FakeBackend(fail_before=UpstreamRateLimited("slow down", retry_after=2))
    with pytest.raises(UpstreamRateLimited):
        await drain(actor)  # a 429 is an answer: the backend is alive, not suspect
    actor.backend = FakeBackend(delay=0.01)
    with trio.move_on_after(0.015):
        await drain(actor, GenerateRequest(max_tokens=100))
    stats = actor.statistics()
    assert stats.health.events["request_ok"] == 3 and stats.cancelled == 1
    assert stats.state == "up" and stats.up and stats.health.transitions == 1


async def test_request_outcomes_never_bring_a_backend_up_or_down() -> None:
    """Probes decide: a success on a suspect backend leaves it suspect; a
    failure on a down one leaves it down."""
    fake = FakeBackend()
    actor = BackendActor("a", fake)
    await actor.probe()
    actor.report(HealthEvent.REQUEST_FAILED_EARLY)
    actor.report(HealthEvent.REQUEST_OK)
    assert actor.state is HealthState.SUSPECT
    fake.healthy = False
    await actor.probe()
    await actor.probe()
    assert actor.state is HealthState.DOWN
    actor.report(HealthEvent.REQUEST_OK)
    actor.report(HealthEvent.REQUEST_FAILED_LATE)
    assert actor.state is HealthState.DOWN


async def test_a_stream_ending_after_close_is_still_reported() -> None:
    actor = BackendActor("a", FakeBackend(delay=0.01))
    await actor.probe()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain, actor)
        await trio.sleep(0.015)
        await actor.aclose()
    assert actor.state is HealthState.CLOSED
    assert actor.statistics().health.events["request_ok"] == 1


async def test_a_probe_that_returns_after_close_is_dropped(clock: trio.testing.MockClock) -> None:
    fake = FakeBackend()
    fake.hang_probe = True
    actor = BackendActor("a", fake, probe_timeout=5.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.probe)
        await trio.sleep(1.0)
        await actor.aclose()
    assert actor.state is HealthState.CLOSED and actor.statistics().probes == 0


async def test_a_crashed_actor_is_down_until_a_probe_passes() -> None:
    actor = BackendActor("a", FakeBackend())
    await actor.probe()
    actor.crashed(RuntimeError("bug"))
    stats = actor.statistics()
    assert (stats.state, stats.up, stats.restarts) == ("down", False, 1)
    assert stats.detail == "actor crashed: RuntimeError('bug')"
    await actor.probe()
    assert actor.state is HealthState.UP



async def test_a_view_is_reused_until_something_it_shows_changes() -> None:
    """A pick takes every candidate's view and a dispatch changes one backend,
    so an actor hands back its last view while nothing in it changed, and a
    new one as soon as anything did."""
    fake = FakeBackend(models=("m",))
    actor = BackendActor("a", fake, unhealthy_threshold=1)
    await actor.probe()
    first = actor.view()
    assert actor.view() is first and first.in_flight == 0 and first.models == {"m"}
    actor.in_flight += 1  # what a dispatch does
    assert actor.view() is not first and actor.view().in_flight == 1
    actor.pending_prefill_tokens += 300
    assert actor.view().pending_prefill_tokens == 300
    actor.weight = 2.0
    assert actor.view().weight == 2.0
    fake.models = ("m", "n")
    await actor.probe()  # a new BackendInfo
    assert actor.view().models == {"m", "n"}
    fake.healthy = False
    await actor.probe()
    assert actor.state is HealthState.DOWN and not actor.view().healthy
    actor.drain()
    assert actor.view().draining
    last = actor.view()
    assert actor.view() is last


async def test_a_probe_whose_backend_is_closed_under_it_ends_quietly() -> None:
    """``aclose()`` while a probe is in flight: the adapter's client is closed
    under it and raises a non-project error (httpx's RuntimeError); the
    actor's run ends without crashing. (An open actor's probe that raises so
    is still a crash: tests/router/test_services.py.)"""
    gate, waiting = trio.Event(), trio.Event()

    class ClosedUnder(FakeBackend):
        async def health(self):  # type: ignore[no-untyped-def]
            if self.probes:
                waiting.set()
                await gate.wait()
                if self.closed:
                    raise RuntimeError("Cannot send a request, as the client has been closed.")
            return await super().health()

    backend = ClosedUnder()
    actor = BackendActor("c", backend, probe_interval=0.01)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            await waiting.wait()  # the second probe is in flight
            await actor.aclose()
            gate.set()
    assert actor.closed and backend.closed

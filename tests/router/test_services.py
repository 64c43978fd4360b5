"""The supervisor runs any Service: a crash is restarted with backoff, a return
is final, and backend actors are supervised beside other services."""

from __future__ import annotations

import logging

import msgspec
import pytest
import trio
import trio.testing

from router.actors import BackendActor
from router.health import HealthState
from router.services import Service, ServiceStatistics, Supervisor
from tests.router.fakes import FakeBackend


class Crashy:
    """Crashes ``crashes`` times (before or after reporting started), then runs
    until cancelled; records when each run began."""

    def __init__(self, name: str = "crashy", *, crashes: int = 0, after_start: bool = False) -> None:
        self.name = name
        self.crashes = crashes
        self.after_start = after_start
        self.began: list[float] = []
        self.seen: list[BaseException] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.began.append(trio.current_time())
        if self.after_start:
            task_status.started()
        if self.crashes:
            self.crashes -= 1
            raise RuntimeError(f"crash {len(self.began)}")
        if not self.after_start:
            task_status.started()
        await trio.sleep_forever()

    def crashed(self, exc: BaseException) -> None:
        self.seen.append(exc)


class OneShot:
    """Does its work and returns: finished on purpose."""

    name = "oneshot"

    def __init__(self) -> None:
        self.runs = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.runs += 1
        task_status.started()
        await trio.sleep(1.0)

    def crashed(self, exc: BaseException) -> None:
        raise AssertionError("never crashed")


class Sampler:
    """A non-actor service with its own statistics(), like a metrics sampler."""

    name = "sampler"

    def __init__(self, every: float) -> None:
        self.every = every
        self.samples = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.every)
            self.samples += 1

    def crashed(self, exc: BaseException) -> None:
        pass

    def statistics(self) -> dict[str, int]:
        return {"samples": self.samples}


def stats(supervisor: Supervisor, name: str) -> ServiceStatistics:
    return next(s for s in supervisor.statistics().services if s.name == name)


def test_actors_and_the_test_services_satisfy_the_protocol() -> None:
    for service in (BackendActor("a", FakeBackend()), Crashy(), OneShot(), Sampler(1.0)):
        assert isinstance(service, Service)


@pytest.mark.parametrize("after_start", [False, True])
async def test_a_crashing_service_is_restarted_with_exponential_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, after_start: bool
) -> None:
    """Delays 1, 2, 4 (capped at 8) between runs, whether the crash comes
    before or after the service reported started; each crash reaches
    ``crashed`` unwrapped from the nursery's exception group."""
    service = Crashy(crashes=3, after_start=after_start)
    supervisor = Supervisor([service], backoff=1.0, backoff_max=8.0)
    with caplog.at_level(logging.ERROR, logger="router.services"):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await trio.sleep(20)
            nursery.cancel_scope.cancel()
    start = service.began[0]
    assert [t - start for t in service.began] == [0, 1, 3, 7]
    assert [str(e) for e in service.seen] == ["crash 1", "crash 2", "crash 3"]
    assert all(type(e) is RuntimeError for e in service.seen)
    s = stats(supervisor, "crashy")
    assert (s.starts, s.restarts, s.finished, s.last_error) == (4, 3, False, "RuntimeError('crash 3')")
    assert sum("crashy crashed; restarting" in r.message for r in caplog.records) == 3


async def test_backoff_is_capped_and_starts_over_after_a_long_run(autojump_clock: trio.testing.MockClock) -> None:
    class Flaky(Crashy):
        async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            self.began.append(trio.current_time())
            task_status.started()
            n = len(self.began)
            await trio.sleep(10.0 if n == 5 else 0.0)  # the fifth run lasts longer than backoff_max
            raise RuntimeError(f"crash {n}")

    service = Flaky()
    supervisor = Supervisor([service], backoff=1.0, backoff_max=4.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.run)
        await trio.sleep(24.5)
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(service.began, service.began[1:], strict=False)]
    assert gaps == [1, 2, 4, 4, 11, 2]  # capped at 4; 11 = a 10 s run, then the backoff back at 1


async def test_a_service_that_returns_is_not_restarted(autojump_clock: trio.testing.MockClock) -> None:
    service = OneShot()
    supervisor = Supervisor([service], backoff=0.1)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        assert stats(supervisor, "oneshot").running
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    s = stats(supervisor, "oneshot")
    assert service.runs == 1 and (s.starts, s.restarts, s.running, s.finished) == (1, 0, False, True)


async def test_the_supervisor_returns_when_every_service_has_finished(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(5):
        await Supervisor([OneShot()]).run()


async def test_a_service_beside_actors_is_supervised_and_reports_its_statistics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Started is reported once the actor has made its first probe; the
    sampler runs and crashes independently of the actor."""
    fake = FakeBackend()
    actor = BackendActor("a", fake, probe_interval=100.0)
    sampler, crashy = Sampler(every=1.0), Crashy("kv-events", crashes=1, after_start=True)
    supervisor = Supervisor([actor, sampler, crashy], backoff=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        assert actor.state is HealthState.UP and fake.probes == 1
        await trio.sleep(5.5)
        nursery.cancel_scope.cancel()
    assert sampler.samples == 5 and actor.state is HealthState.UP and actor.statistics().restarts == 0
    reports = supervisor.reports()
    assert set(reports) == {"a", "sampler"}  # Crashy has no statistics()
    assert reports["sampler"] == {"samples": 5} and reports["a"].state == "up"
    assert [(s.name, s.restarts) for s in supervisor.statistics().services] == [
        ("a", 0),
        ("sampler", 0),
        ("kv-events", 1),
    ]
    assert msgspec.to_builtins(supervisor.statistics())["services"][2]["last_error"] == "RuntimeError('crash 1')"


async def test_a_service_that_cannot_start_does_not_hold_up_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    crashy = Crashy(crashes=100)
    supervisor = Supervisor([crashy, Sampler(1.0)], backoff=50.0, backoff_max=50.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        assert trio.current_time() == 0 and len(crashy.began) == 1
        nursery.cancel_scope.cancel()


async def test_a_crashed_actor_is_down_and_restarted_with_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeBackend()
    fake.crash_probe = 3  # the first probe, then two restarts, crash
    actor = BackendActor("a", fake, probe_interval=100.0)
    supervisor = Supervisor([actor], backoff=1.0, backoff_max=8.0)
    with caplog.at_level(logging.ERROR, logger="router.services"):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            assert actor.state is HealthState.DOWN  # crashed on its first probe
            # backoff 1 + 2 + 4 before the fourth run succeeds
            await trio.sleep(6.9)
            assert actor.state is HealthState.DOWN
            await trio.sleep(0.2)
            assert actor.state is HealthState.UP
            nursery.cancel_scope.cancel()
    assert actor.statistics().restarts == 3 == stats(supervisor, "a").restarts
    assert sum("crashed; restarting" in r.message for r in caplog.records) == 3


def test_service_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        Supervisor([Sampler(1.0), Sampler(2.0)])

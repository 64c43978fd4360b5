"""One state per backend: the breaker's transitions reach the actor's health
state, which routing, admission, /admin/backends, /ready and /metrics all
read; a backend whose probes fail is not tried by half-open requests; the
503 when every backend of a group is ejected says when the first returns;
each backend's concurrency limit learned from its 429s; a backend at its
limit is passed over while another has room.

Fake time (trio's MockClock, autojump) with in-process fakes, then the real
router to real mock servers over loopback (the router's clock pushed forward
to end an ejection)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

from backends.base import GenerateRequest
from backends.errors import BackendUnavailable, UpstreamRateLimited
from backends.mock import MockConfig
from backends.openai_http import OpenAIHTTPBackend
from policies.breaker import Breakers, BreakerState
from router.actors import BackendActor
from router.app import NamedBackend, Router
from router.config import ModelRoute, decode_config
from router.dispatch import Dispatcher
from router.health import HealthState
from router.routes import RouteTable
from tests.backends.conftest import serve_mock
from tests.router.fakes import FakeBackend
from tests.router.test_breakers import BODY, Prefer, drain_stream, hits, options
from tests.router.test_dispatch import actors_for
from tests.router.test_integration import serve_router
from tests.router.test_model_routes import FakeClock, status

S = HealthState


async def ejected_pair(**kw: Any) -> tuple[FakeBackend, FakeBackend, list[BackendActor], Dispatcher, Breakers]:
    """``a`` fails once (ejected for 10 s), ``b`` answers."""
    a, b = FakeBackend("a", fail_before=BackendUnavailable("refused")), FakeBackend("b")
    breakers = Breakers(options(**kw))
    actors = await actors_for(a, b)
    d = Dispatcher(actors, Prefer("a", "b"), breakers=breakers, draw=lambda: 0.0)
    assert await drain_stream(d) == 4  # a failed, b answered
    return a, b, actors, d, breakers


async def test_a_backend_the_breaker_ejects_is_ejected_in_its_one_state_until_its_trial_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, _, actors, d, breakers = await ejected_pair()
    stats = {s.name: s for s in d.backend_statistics()}
    assert (stats["a"].state, stats["a"].up, actors[0].eligible(None)) == ("ejected", False, False)
    assert d.ejection_wait(["a", "b"]) == pytest.approx(10)
    await trio.sleep(10)
    d.sync()
    assert actors[0].state is S.HALF_OPEN and actors[0].eligible(None)
    a.fail_before = None
    assert await drain_stream(d, max_tokens=2) == 2  # the trial: a is preferred
    assert a.started == 2 and actors[0].state is S.UP
    assert breakers.state("a", trio.current_time()) is BreakerState.CLOSED


async def test_a_failed_trial_ejects_it_again_for_longer(autojump_clock: trio.testing.MockClock) -> None:
    a, _, actors, d, _ = await ejected_pair()
    await trio.sleep(10)
    assert await drain_stream(d) == 4  # the trial failed on a, b answered
    assert a.started == 2 and actors[0].state is S.EJECTED
    assert d.ejection_wait(["a"]) == pytest.approx(20)  # second ejection: 2 x base


async def test_a_passing_probe_does_not_end_an_ejection(autojump_clock: trio.testing.MockClock) -> None:
    a, _, actors, d, _ = await ejected_pair()
    a.fail_before = None
    await actors[0].probe()
    d.sync()
    assert actors[0].state is S.EJECTED
    assert await drain_stream(d) == 4 and a.started == 1


async def test_a_backend_whose_probe_fails_while_ejected_gets_no_trial_requests_until_a_probe_passes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b, actors, d, breakers = await ejected_pair()
    a.healthy = False
    await actors[0].probe()
    assert actors[0].state is S.DOWN
    d.sync()  # probes decide now: its breaker is reset
    assert breakers.state("a", trio.current_time()) is BreakerState.CLOSED
    await trio.sleep(30)  # long past the ejection's end: no half-open trial
    for _ in range(3):
        assert await drain_stream(d) == 4
    assert (a.started, b.started) == (1, 4)
    a.healthy, a.fail_before = True, None
    await actors[0].probe()
    assert actors[0].state is S.UP
    assert await drain_stream(d) == 4 and a.started == 2
    # The streak was kept: failing again ejects it for 2 x base.
    a.fail_before = BackendUnavailable("refused")
    assert await drain_stream(d) == 4
    assert actors[0].state is S.EJECTED and d.ejection_wait(["a"]) == pytest.approx(20)


async def test_a_backend_the_probes_hold_down_counts_for_the_fleet_rule(autojump_clock: trio.testing.MockClock) -> None:
    """Two backends, b down by its probes: a is the last one serving and
    its failures do not eject it."""
    a, b = FakeBackend("a", fail_before=BackendUnavailable("refused")), FakeBackend("b")
    b.healthy = False
    breakers = Breakers(options(max_ejection_fraction=1.0))
    d = Dispatcher(await actors_for(a, b), Prefer("a", "b"), breakers=breakers, draw=lambda: 0.0)
    for _ in range(3):
        with pytest.raises(BackendUnavailable, match="refused"):
            await drain_stream(d)
    assert d.actors["a"].state is S.SUSPECT and a.started == 3
    assert breakers.statistics(trio.current_time())[0].refused_trips == 3


async def test_when_no_backend_of_a_group_takes_requests_the_503_says_when_the_first_ejection_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fakes = [FakeBackend(n, fail_before=BackendUnavailable("refused") if n in "ab" else None) for n in "abcd"]
    breakers = Breakers(options(max_ejection_fraction=0.5))
    table = RouteTable([ModelRoute(name="m", backends=("a", "b"))], Prefer("a", "b", "c", "d"), lambda r: Prefer("a", "b"))
    d = Dispatcher(await actors_for(*fakes), Prefer("a", "b"), routes=table, breakers=breakers, draw=lambda: 0.0)
    with pytest.raises(BackendUnavailable):
        await drain_stream(d)  # a and b both fail: a is ejected, b is the group's last
    await trio.sleep(3)
    assert d.actors["a"].state is S.EJECTED and d.actors["b"].state is not S.EJECTED
    assert breakers.state("b", trio.current_time()) is BreakerState.CLOSED
    d.actors["b"].drain()  # the group's other backend takes nothing either
    with pytest.raises(BackendUnavailable, match="ejected") as info:
        await drain_stream(d)
    assert info.value.retry_after == pytest.approx(7)  # a's 10 s ejection, 3 s into it
    assert (fakes[0].started, fakes[1].started) == (1, 1)


async def test_a_backends_429s_halve_its_concurrency_limit_and_answers_at_the_limit_raise_it() -> None:
    fake = FakeBackend("a", fail_before=UpstreamRateLimited("slow down", retry_after=1))
    actor = BackendActor("a", fake, max_concurrency=8)
    await actor.probe()
    for _ in range(2):  # the second was sent after the first cut: cut again
        with pytest.raises(UpstreamRateLimited):
            async for _ in actor.stream(GenerateRequest(model="m")):
                pass
        await trio.sleep(0.001)
    assert actor.limit == 2 and actor.statistics().concurrency is not None
    assert actor.state is S.UP  # a 429 is an answer, not a failure
    fake.fail_before, fake.delay = None, 0.01

    async def one() -> None:
        async for _ in actor.stream(GenerateRequest(model="m", max_tokens=1)):
            pass

    for _ in range(4):  # two at a time: at its limit
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    assert actor.limit == 3
    learned = BackendActor("b", FakeBackend("b"), max_concurrency=8, learn_concurrency=False)
    assert learned.limit == 8 and learned.statistics().concurrency is None


async def test_a_backend_at_its_limit_is_passed_over_while_another_has_room(autojump_clock: trio.testing.MockClock) -> None:
    a, b = FakeBackend("a", delay=1.0), FakeBackend("b", delay=1.0)
    actors = [BackendActor("a", a, max_concurrency=1), BackendActor("b", b, max_concurrency=1)]
    for actor in actors:
        await actor.probe()
    d = Dispatcher(actors, Prefer("a", "b"))
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(drain_stream, d)
            await trio.sleep(0.1)
        assert (a.in_flight, b.in_flight) == (2, 1)  # the third: both full, the policy's choice
    assert (a.started, b.started) == (2, 1)


# ---------------------------------------------------------------- loopback


async def start(nursery: trio.Nursery, clock: FakeClock, mocks: dict[str, list[Any]], **sections: Any) -> tuple[Router, str]:
    served = {name: await serve_mock(nursery, MockConfig(name=name, models=("m",)), faults) for name, faults in mocks.items()}
    config = decode_config({
        "backends": [{"kind": "mock", "name": name, "max_concurrency": 4} for name in mocks],
        "health": {"interval": 30},
        **sections,
    })  # fmt: skip
    router = Router(config, [NamedBackend(n, OpenAIHTTPBackend(s.url, name=n)) for n, s in served.items()], clock=clock)
    router.served = served  # type: ignore[attr-defined]
    return router, await serve_router(nursery, router)


async def test_an_ejected_backend_shows_as_ejected_everywhere_and_comes_back_the_same(nursery: trio.Nursery) -> None:
    clock = FakeClock()
    breaker = {"options": {"consecutive_failures": 1, "failure_rate": 2.0, "base_ejection": 30, "half_open_successes": 1}}
    router, url = await start(nursery, clock, {"a": status(503), "b": []}, breaker=breaker,
                              models=[{"name": "m", "backends": ["a", "b"], "policy": "round_robin"}])  # fmt: skip
    served = router.served  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while served["a"].injector.requests < 1:
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200

        async def everywhere() -> tuple[Any, ...]:
            listed = {b["name"]: b for b in (await client.get("/admin/backends")).json()["data"]}
            ready = (await client.get("/ready")).json()["backends_up"]
            metrics = (await client.get("/metrics")).text
            up = 'headrace_backend_up{backend="a"} 1.0' in metrics
            breaker = next(line for line in metrics.splitlines() if line.startswith('headrace_backend_breaker_state{backend="a"}'))
            a = listed["a"]
            return a["state"], a["up"], a["breaker"]["state"], "a" in ready, up, breaker.split()[-1], router.capacity()

        assert await everywhere() == ("ejected", False, "open", False, False, "2.0", 4)
        served["a"].injector.faults = []
        clock.offset += 30
        assert await everywhere() == ("half_open", True, "half_open", True, True, "1.0", 5)
        before = hits(served)["a"]
        for _ in range(2):  # round robin reaches a within two: its trial
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert hits(served)["a"] == before + 1
        assert await everywhere() == ("up", True, "closed", True, True, "0.0", 8)


async def test_a_group_whose_backends_are_ejected_or_drained_is_503_with_the_soonest_return_as_retry_after(
    nursery: trio.Nursery,
) -> None:
    clock = FakeClock()
    breaker = {"options": {"consecutive_failures": 1, "failure_rate": 2.0, "base_ejection": 30, "max_ejection_fraction": 0.5}}
    router, url = await start(nursery, clock, {"a": status(503), "b": status(503), "c": [], "d": []}, breaker=breaker,
                              models=[{"name": "m", "backends": ["a", "b"], "policy": "round_robin"},
                                      {"name": "n", "backends": ["c", "d"], "upstream_model": "m"}])  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 503  # a then b: a is ejected
        # b is the group's last: its trip is refused, whatever c and d do
        state = {b["name"]: b["breaker"] for b in (await client.get("/admin/backends")).json()["data"]}
        assert (state["a"]["state"], state["b"]["state"], state["b"]["refused_trips"]) == ("open", "closed", 1)
        drained = await client.post("/admin/backends", json={"backend": "b", "action": "drain"})
        assert drained.status_code == 200
        clock.offset += 12
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
        assert r.headers["retry-after"] == "18"  # 30 s ejections, 12 s in
        assert router.capacity(router.group_of("m")) == 0 and router.capacity(router.group_of("n")) == 8
        # The other group is untouched.
        assert (await client.post("/v1/completions", json={**BODY, "model": "n"})).status_code == 200

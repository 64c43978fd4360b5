"""Circuit breakers and the retry budget in the request path.

Under fake time (trio's MockClock, autojump) with in-process fakes: a retry
waits its full-jitter backoff on trio's clock, a spent retry budget gives
the request the upstream error, a cancelled backoff or half-open probe gives
its slot back. Through the real router to real mock servers over loopback
(the router's clock pushed forward to end an ejection): a backend that fails
three times in a row is ejected, gets no traffic until its ejection ends and
a half-open probe succeeds; a 429 or a 400 is never a breaker failure; the
budget stops retries; /admin/backends and /metrics show it all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from backends.base import GenerateRequest
from backends.errors import BackendUnavailable
from backends.mock import Fault, MockConfig
from backends.openai_http import OpenAIHTTPBackend
from policies.base import BackendView, RouteRequest
from policies.breaker import BreakerOptions, Breakers, BreakerState, RetryBudget
from router.app import NamedBackend, Router
from router.config import ModelRoute, decode_config
from router.dispatch import Dispatcher
from router.routes import RouteTable
from tests.backends.conftest import Served, serve_mock
from tests.router.fakes import FakeBackend
from tests.router.test_dispatch import ListRecorder, actors_for
from tests.router.test_integration import serve_router
from tests.router.test_model_routes import FakeClock, status


class Prefer:
    """A routing policy that picks the first of ``order`` among the candidates."""

    name = "prefer"

    def __init__(self, *order: str) -> None:
        self.order = order

    def pick(self, backends: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        names = {b.name for b in backends}
        return next((n for n in self.order if n in names), None)


def options(**kw: Any) -> BreakerOptions:
    base: dict[str, Any] = {"consecutive_failures": 1, "failure_rate": 2.0, "base_ejection": 10.0,
                            "max_ejection": 100.0, "half_open_successes": 1}  # fmt: skip
    return BreakerOptions(**(base | kw))


async def drain_stream(d: Dispatcher, **kw: Any) -> int:
    return len([e async for e in d.stream(GenerateRequest(model="m", **kw))])


# ---------------------------------------------------------------- fake time, fakes


async def test_a_retry_waits_a_full_jitter_backoff_on_trios_clock(autojump_clock: trio.testing.MockClock) -> None:
    bad, good = FakeBackend("a", fail_before=BackendUnavailable("refused")), FakeBackend("b")
    recorder = ListRecorder()
    d = Dispatcher(await actors_for(bad, good), Prefer("a", "b"), recorder=recorder, retry_budget=RetryBudget(0, 1),
                   backoff_base=0.5, backoff_cap=4.0, draw=lambda: 0.75)  # fmt: skip
    assert await drain_stream(d, max_tokens=2) == 2
    # Queue time of the retry on b: the first backoff, 0.75 x base.
    waits = [seconds for kind, backend, seconds in recorder.calls if (kind, backend) == ("queue", "b")]
    assert waits == [pytest.approx(0.375)]
    stats = d.statistics()
    assert stats.retries == 1 and stats.retry_budget is not None
    assert (stats.retry_budget.granted, stats.retry_budget.active, stats.retry_budget.refused) == (1, 0, 0)


async def test_a_spent_retry_budget_gives_the_request_the_upstream_error(autojump_clock: trio.testing.MockClock) -> None:
    """One retry in flight at most: the first request's retry holds it (b is
    slow), so the second request's failure on a is its answer."""
    bad = FakeBackend("a", fail_before=BackendUnavailable("a refused"))
    slow = FakeBackend("b", delay=1.0)
    budget = RetryBudget(ratio=0, min_retries=1)
    d = Dispatcher(await actors_for(bad, slow), Prefer("a", "b"), retry_budget=budget, draw=lambda: 0.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain_stream, d)
        await trio.sleep(0.5)
        assert budget.active == 1 and slow.in_flight == 1
        with pytest.raises(BackendUnavailable, match="a refused"):
            await drain_stream(d)
    assert (bad.started, slow.started) == (2, 1)
    assert budget.active == 0 and (budget.granted, budget.refused) == (1, 1)
    assert d.statistics().retries_refused == 1


async def test_a_retry_cancelled_in_its_backoff_gives_its_budget_slot_back(autojump_clock: trio.testing.MockClock) -> None:
    bad, good = FakeBackend("a", fail_before=BackendUnavailable("refused")), FakeBackend("b")
    budget = RetryBudget(ratio=0, min_retries=1)
    d = Dispatcher(await actors_for(bad, good), Prefer("a", "b"), retry_budget=budget,
                   backoff_base=10.0, backoff_cap=10.0, draw=lambda: 1.0)  # fmt: skip
    with trio.move_on_after(5):
        await drain_stream(d)
    assert good.started == 0 and budget.active == 0 and budget.granted == 1


async def test_the_fleet_rule_counts_each_model_groups_ejections_apart(autojump_clock: trio.testing.MockClock) -> None:
    """At a quarter, a fleet-wide count (1 of 6) would keep b1 in after a1
    went; per group, model mb may lose one of its own four."""
    fakes = {n: FakeBackend(n, fail_before=BackendUnavailable("refused")) for n in ("a1", "b1")}
    fakes |= {n: FakeBackend(n) for n in ("a2", "b2", "b3", "b4")}
    breakers = Breakers(options(max_ejection_fraction=0.25))
    order = Prefer("a1", "b1", "a2", "b2", "b3", "b4")
    routes = RouteTable([ModelRoute(name="ma", backends=("a1", "a2")), ModelRoute(name="mb", backends=("b1", "b2", "b3", "b4"))],
                        order, lambda r: order)  # fmt: skip
    d = Dispatcher(await actors_for(*fakes.values()), order, routes=routes, breakers=breakers, draw=lambda: 0.0)
    for model in ("ma", "mb"):
        assert len([e async for e in d.stream(GenerateRequest(model=model))]) == 4  # retried on the group's next
    now = trio.current_time()
    assert {n: breakers.state(n, now) for n in ("a1", "b1")} == {"a1": BreakerState.OPEN, "b1": BreakerState.OPEN}
    assert breakers.groups_of("b1") == [frozenset({"b1", "b2", "b3", "b4"})]


async def test_a_cancelled_half_open_probe_does_not_wedge_the_breaker(autojump_clock: trio.testing.MockClock) -> None:
    a, b = FakeBackend("a", fail_before=BackendUnavailable("refused")), FakeBackend("b")
    breakers = Breakers(options())
    actors = await actors_for(a, b)
    d = Dispatcher(actors, Prefer("a", "b"), breakers=breakers, draw=lambda: 0.0)
    assert await drain_stream(d) == 4  # a failed (ejected), b answered
    assert breakers.state("a", trio.current_time()) is BreakerState.OPEN
    assert await drain_stream(d) == 4 and a.started == 1  # ejected: not even tried
    await trio.sleep(10)
    a.fail_before, a.delay = None, 1.0
    actors[1].drain()  # only a may take the probe
    with trio.move_on_after(0.5):
        await drain_stream(d)
    assert a.started == 2 and a.cancelled == 1
    # The probe gave its slot back: the next request is the probe, and closes it.
    assert breakers.state("a", trio.current_time()) is BreakerState.HALF_OPEN and breakers.allows("a", trio.current_time())
    assert await drain_stream(d, max_tokens=2) == 2
    assert breakers.state("a", trio.current_time()) is BreakerState.CLOSED


# ---------------------------------------------------------------- loopback


async def start(
    nursery: trio.Nursery, mocks: dict[str, list[Fault]], clock: FakeClock, **sections: Any
) -> tuple[Router, dict[str, Served], httpx.AsyncClient]:
    """One mock per name (all serve model ``m``), a router over them with
    ``sections`` and a round-robin group of them all."""
    served = {name: await serve_mock(nursery, MockConfig(name=name, models=("m",)), faults) for name, faults in mocks.items()}
    config = decode_config({
        "backends": [{"kind": "mock", "name": name} for name in mocks],
        "models": [{"name": "m", "backends": list(mocks), "policy": "round_robin"}],
        "health": {"interval": 30},
        **sections,
    })  # fmt: skip
    router = Router(config, [NamedBackend(n, OpenAIHTTPBackend(s.url, name=n)) for n, s in served.items()], clock=clock)
    url = await serve_router(nursery, router)
    return router, served, httpx.AsyncClient(base_url=url, timeout=10)


BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}
BREAKER = {"consecutive_failures": 3, "failure_rate": 2.0, "base_ejection": 30, "max_ejection": 300, "half_open_successes": 1}


def hits(served: dict[str, Served]) -> dict[str, int]:
    """Generation requests that reached each mock."""
    return {name: s.injector.requests for name, s in served.items()}


async def breaker_of(client: httpx.AsyncClient, backend: str) -> dict[str, Any]:
    r = await client.get("/admin/backends")
    found: dict[str, Any] = next(b["breaker"] for b in r.json()["data"] if b["name"] == backend)
    return found


async def test_a_backend_failing_three_times_in_a_row_is_ejected_until_its_half_open_probe_succeeds(
    nursery: trio.Nursery,
) -> None:
    clock = FakeClock()
    router, served, client = await start(nursery, {"a": status(503), "b": []}, clock, breaker={"options": BREAKER})
    async with client:
        while served["a"].injector.requests < 3:  # every request that meets a retries on b
            r = await client.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
        assert (await breaker_of(client, "a"))["state"] == "open"
        assert (await breaker_of(client, "a"))["ejections"] == 1
        metrics = (await client.get("/metrics")).text
        assert 'headrace_backend_breaker_state{backend="a"} 2.0' in metrics
        assert 'headrace_backend_breaker_state{backend="b"} 0.0' in metrics
        assert 'headrace_backend_ejections_total{backend="a"} 1.0' in metrics
        served["a"].injector.faults = []  # a is fine again, but still ejected
        before = hits(served)
        for _ in range(6):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert hits(served) == {"a": before["a"], "b": before["b"] + 6}
        assert router.capacity() == 64  # admission counts b's slots only
        clock.offset += 29
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert hits(served)["a"] == before["a"]  # 29 s of the 30 s ejection: still out
        clock.offset += 1
        assert (await breaker_of(client, "a"))["state"] == "half_open"
        for _ in range(2):  # round robin reaches a within two: the probe
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert hits(served)["a"] == before["a"] + 1
        assert (await breaker_of(client, "a"))["state"] == "closed"
        for _ in range(4):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert hits(served)["a"] == before["a"] + 3  # back in the rotation
        assert router.capacity() == 128


async def test_a_half_open_probe_the_client_abandons_does_not_wedge_the_breaker(nursery: trio.Nursery) -> None:
    clock = FakeClock()
    router, served, client = await start(nursery, {"a": status(503), "b": []}, clock,
                                         breaker={"options": {**BREAKER, "consecutive_failures": 1}})  # fmt: skip
    async with client:
        while served["a"].injector.requests < 1:
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert (await breaker_of(client, "a"))["state"] == "open"
        clock.offset += 30
        served["a"].injector.faults = [Fault(kind="slow_first_token", delay_s=5.0)]
        router.actor("b").drain()  # only a may take the probe
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=BODY, timeout=0.3)
        with trio.fail_after(2):
            while router.actor("a").in_flight:  # the router cancels the abandoned probe
                await trio.sleep(0.01)
        assert (await breaker_of(client, "a"))["state"] == "half_open"
        served["a"].injector.faults = []
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text  # the probe slot was given back: a takes the next one
        assert (await breaker_of(client, "a"))["state"] == "closed"


async def test_429s_and_400s_never_eject_a_backend(nursery: trio.Nursery) -> None:
    clock = FakeClock()
    router, served, client = await start(nursery, {"a": status(429, 1), "b": status(400)}, clock,
                                         breaker={"options": {**BREAKER, "consecutive_failures": 1}})  # fmt: skip
    async with client:
        for _ in range(4):
            assert (await client.post("/v1/completions", json=BODY)).status_code in (400, 429)
            clock.offset += 2  # past a's cool-down
    assert hits(served)["a"] >= 2 and hits(served)["b"] >= 2
    assert {b.name: (b.state, b.ejections) for b in router.dispatcher.statistics().breakers} == {
        "a": ("closed", 0), "b": ("closed", 0)
    }  # fmt: skip


async def test_a_spent_retry_budget_gives_the_client_the_upstream_error_instead_of_a_retry(nursery: trio.Nursery) -> None:
    router, served, client = await start(nursery, {"a": status(503), "b": []}, FakeClock(),
                                         retry={"budget_ratio": 0, "min_retries": 0})  # fmt: skip
    async with client:
        codes = sorted([(await client.post("/v1/completions", json=BODY)).status_code for _ in range(2)])
        assert codes == [200, 503]  # round robin: one met a, and was not retried on b
        assert hits(served) == {"a": 1, "b": 1}
        metrics = (await client.get("/metrics")).text
    stats = router.dispatcher.statistics()
    assert stats.retries_refused == 1 and stats.retry_budget is not None and stats.retry_budget.refused == 1
    assert "headrace_retry_budget_refused_total 1.0" in metrics
    assert "headrace_dispatch_retries_refused_total 1.0" in metrics
    assert "headrace_retry_budget_active 0.0" in metrics


async def test_metrics_export_the_pipelines_rejections_queue_depth_and_admitted(nursery: trio.Nursery) -> None:
    _, _, client = await start(nursery, {"a": []}, FakeClock(),
                               auth={"keys": {"sk-t": "t"}}, tenants={"t": {"requests_per_minute": 1}})  # fmt: skip
    headers = {"authorization": "Bearer sk-t"}
    async with client:
        assert (await client.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
        assert (await client.post("/v1/completions", json=BODY, headers=headers)).status_code == 429
        metrics = (await client.get("/metrics")).text
    for line in (
        'headrace_pipeline_rejected_total{code="rate_limited"} 1.0',
        "headrace_pipeline_admitted_total 1.0",
        "headrace_pipeline_in_flight 0.0",
        'headrace_queue_depth{class="interactive"} 0.0',
        'headrace_queue_depth{class="default"} 0.0',
        'headrace_queue_depth{class="batch"} 0.0',
        "headrace_queue_capacity 64.0",
        "headrace_queue_busy 0.0",
        'headrace_queue_admitted_total{how="at_once"} 1.0',
        'headrace_backend_breaker_state{backend="a"} 0.0',
        "headrace_retry_budget_granted_total 0.0",
        'headrace_backend_concurrency_limit{backend="a"} 64.0',
        'headrace_queue_group_capacity{group="*"} 64.0',
        'headrace_queue_group_busy{group="*"} 0.0',
    ):
        assert line in metrics, line


async def test_the_breakers_are_told_when_what_the_probes_say_changes_not_on_every_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``set_serving`` each time a backend's probed state changes (and at
    first sight), not once per candidate per request."""
    told: list[tuple[str, bool]] = []

    class Recording(Breakers):
        def set_serving(self, backend: str, serving: bool, now: float) -> None:
            told.append((backend, serving))
            super().set_serving(backend, serving, now)

    a, b = FakeBackend("a"), FakeBackend("b")
    actors = await actors_for(a, b)
    d = Dispatcher(actors, Prefer("a", "b"), breakers=Recording(options()), draw=lambda: 0.0)
    for _ in range(5):
        assert await drain_stream(d) == 4
    assert sorted(told) == [("a", True), ("b", True)]
    a.healthy = False
    while actors[0].state.probed_up:
        await actors[0].probe()
    for _ in range(3):
        assert await drain_stream(d) == 4
    assert told[2:] == [("a", False)]
    assert b.started == 3  # a is down: b answered
    a.healthy = True
    while not actors[0].state.probed_up:
        await actors[0].probe()
    assert await drain_stream(d) == 4 and a.started == 6
    assert told[3:] == [("a", True)]
    d.remove("b")
    assert told[4:] == [("b", False)]

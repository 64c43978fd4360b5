"""``headrace_desired_replicas{model}`` from a live in-process router, on
trio's MockClock (arrivals, hold times and the scrape all on virtual time,
so the figures are exact): the scrape equals the M/M/c answer for the
arrival rate and service time the router measured."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from backends.mock import MockBackend, MockConfig
from frontend import metric_names as N
from policies.erlang import servers_needed
from router.app import NamedBackend, Router
from router.config import decode_config


def _gauges(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (N.DESIRED_REPLICAS.name, N.ARRIVAL_RATE.name, N.REPLICA_SERVICE_RATE.name, N.MODEL_REPLICAS.name):
            out[family.name] = {s.labels["model"]: s.value for s in family.samples}
    return out


async def test_desired_replicas_follow_the_live_arrival_rate(autojump_clock: trio.testing.MockClock) -> None:
    # 1 s to the first token, 0.1 s per token, 10 tokens: each request holds its slot 1.9 s
    backends = [MockBackend(MockConfig(name=f"mock-{i}", models=("mock",), ttft_s=1.0, tpot_s=0.1)) for i in range(2)]
    config = decode_config({"admission": {"backend_concurrency": 2}, "capacity": {"p99_ms": 20000, "window": 10}})
    router = Router(config, [NamedBackend(b.info().name, b) for b in backends])
    async with trio.open_nursery() as nursery, httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
        await nursery.start(router.run)
        idle = _gauges((await client.get("/metrics")).text)
        # nothing measured yet: the replicas it has, no service-rate sample (not a zero)
        assert idle[N.DESIRED_REPLICAS.name] == {"mock": 2.0} and idle[N.REPLICA_SERVICE_RATE.name] == {}
        assert idle[N.MODEL_REPLICAS.name] == {"mock": 2.0}

        async def one() -> None:
            r = await client.post("/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 10})
            assert r.status_code == 200

        async with trio.open_nursery() as calls:
            for _ in range(60):  # 4 per second for 15 s
                calls.start_soon(one)
                await trio.sleep(0.25)
            text = (await client.get("/metrics")).text  # at the last arrival, a queue still in front
            assert router.metrics.estimator is not None
            e = router.metrics.estimator.estimate("mock", trio.current_time(), replicas=2, slots=2)
        nursery.cancel_scope.cancel()
    got = _gauges(text)
    lam, per_replica = got[N.ARRIVAL_RATE.name]["mock"], got[N.REPLICA_SERVICE_RATE.name]["mock"]
    assert lam == pytest.approx(4 * (1 - 2.718281828 ** -1.5), rel=0.05)  # 4/s for 15 s, smoothed over 10 s
    assert per_replica == pytest.approx(2 / 1.9, rel=0.02)  # two slots of 1.9 s each
    desired = got[N.DESIRED_REPLICAS.name]["mock"]
    assert desired == e.desired == servers_needed(20.0, lam, per_replica / 2, per_replica=2)
    assert desired > 2  # about 7 erlangs on two-slot replicas: more than the two it has


async def test_requests_over_a_tenants_own_rate_limit_are_not_demand() -> None:
    """A tenant limited to 2 requests a minute sends 5: 3 get 429 from its
    own limit, which more replicas would not change, so only 2 arrive for
    the estimator; a queue refusal would count (it is past the limits)."""
    backends = [MockBackend(MockConfig(name="mock-0", models=("mock",)))]
    config = decode_config({"tenants": {"default": {"requests_per_minute": 2}}})
    router = Router(config, [NamedBackend(b.info().name, b) for b in backends])
    async with trio.open_nursery() as nursery, httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
        await nursery.start(router.run)
        codes = [(await client.post("/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2})).status_code for _ in range(5)]
        nursery.cancel_scope.cancel()
    assert codes == [200, 200, 429, 429, 429]
    assert router.metrics.estimator is not None
    assert router.metrics.estimator.arrived("mock") == 2

"""Model routes through the real router to real mock servers over loopback:
fallback chains past 429/503/500, 400 never retried, context length moving
to a larger model, 429 cool-downs and Retry-After, canary splits (sticky,
weighted, changed at run time), and the routes' model names."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Event, GenerateRequest
from backends.errors import UpstreamRateLimited
from backends.mock import Fault, MockConfig
from backends.openai_http import OpenAIHTTPBackend
from policies.routing import RoundRobin
from router.actors import BackendActor
from router.app import NamedBackend, Router
from router.config import decode_config
from router.dispatch import Dispatcher
from router.routes import RouteTable, conversation_key, pick_version
from tests.backends.conftest import serve_mock
from tests.router.fakes import FakeBackend
from tests.router.test_integration import serve_router


class FakeClock:
    """The router's clock, ``offset`` seconds ahead of trio's (cool-downs
    tested over real sockets without waiting them out)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return trio.current_time() + self.offset


MockSpec = tuple[str, str, list[Fault], dict[str, Any]]  # name, upstream model, faults, MockConfig fields


def status(code: int, retry_after: float | None = None) -> list[Fault]:
    return [Fault(kind="status", status=code, retry_after=retry_after)]


async def route_through(
    nursery: trio.Nursery, mocks: list[MockSpec], models: list[dict[str, Any]], clock: FakeClock | None = None
) -> tuple[Router, httpx.AsyncClient]:
    """Serve one mock per spec, and a router over them with ``models``."""
    backends = []
    for name, model, faults, fields in mocks:
        served = await serve_mock(nursery, MockConfig(name=name, models=(model,), **fields), faults)
        backends.append(NamedBackend(name, OpenAIHTTPBackend(served.url, name=name)))
    config = decode_config({
        "backends": [{"kind": "mock", "name": name} for name, *_ in mocks],
        "models": models,
        "health": {"interval": 30},
    })  # fmt: skip
    router = Router(config, backends, clock=clock or FakeClock())
    url = await serve_router(nursery, router)
    return router, httpx.AsyncClient(base_url=url, timeout=10)


def requests_per_backend(router: Router) -> dict[str, int]:
    return {a.name: a.statistics().requests for a in router.actors}


def chat(text: str, *turns: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
    for turn in turns:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": turn}]
    return {"messages": messages, "max_tokens": 3, **body}


async def test_a_chain_moves_on_past_429_503_and_500_and_the_answer_names_the_model_that_answered(
    nursery: trio.Nursery,
) -> None:
    router, client = await route_through(
        nursery,
        [("a", "m-big", status(429, 2), {}), ("b", "m-mid", status(503), {}), ("c", "m-small", status(500), {}), ("d", "m-tiny", [], {})],
        [
            {"name": "chat", "upstream_model": "m-big", "backends": ["a"], "fallbacks": ["mid"]},
            {"name": "mid", "upstream_model": "m-mid", "backends": ["b"], "fallbacks": ["small"]},
            {"name": "small", "upstream_model": "m-small", "backends": ["c"], "fallbacks": ["tiny"]},
            {"name": "tiny", "upstream_model": "m-tiny", "backends": ["d"]},
        ],
    )
    async with client:
        r = await client.post("/v1/chat/completions", json=chat("hi", model="chat"))
        assert r.status_code == 200, r.text
        body = r.json()
        # The mocks serve only their own model (any other name is a 404), so
        # the answer shows the upstream request named the fallback's model.
        assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 3
        assert requests_per_backend(router) == {"a": 1, "b": 1, "c": 1, "d": 1}
        # Streaming: a is cooling down (its 429 said 2 s), so it is not asked.
        async with client.stream("POST", "/v1/chat/completions", json=chat("hi", model="chat", stream=True)) as s:
            data = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and {json.loads(d)["model"] for d in data[:-1]} == {"tiny"}
        assert requests_per_backend(router) == {"a": 1, "b": 2, "c": 2, "d": 2}
    stats = router.dispatcher.statistics()
    assert (stats.fallbacks, stats.rate_limited, stats.cooling, stats.failed) == (2, 1, ("a",), 0)


async def test_a_400_is_the_clients_error_returned_as_is_and_never_retried(nursery: trio.Nursery) -> None:
    router, client = await route_through(
        nursery,
        [("a", "m1", status(400), {}), ("b", "m2", [], {})],
        [{"name": "m1", "backends": ["a"], "fallbacks": ["m2"]}, {"name": "m2", "backends": ["b"]}],
    )
    async with client:
        r = await client.post("/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert requests_per_backend(router) == {"a": 1, "b": 0}
    assert router.dispatcher.statistics().retries == 0


async def test_context_length_moves_on_only_when_a_later_model_exists(nursery: trio.Nursery) -> None:
    router, client = await route_through(
        nursery,
        [("short", "m-short", [], {"max_context": 64}), ("long", "m-long", [], {"max_context": 4096})],
        [
            {"name": "small", "upstream_model": "m-short", "backends": ["short"], "fallbacks": ["large"]},
            {"name": "large", "upstream_model": "m-long", "backends": ["long"]},
            {"name": "small-only", "upstream_model": "m-short", "backends": ["short"]},
        ],
    )
    body = {"prompt": "x" * 200, "max_tokens": 2}
    async with client:
        r = await client.post("/v1/completions", json={"model": "small", **body})
        assert r.status_code == 200 and r.json()["model"] == "large", r.text
        r = await client.post("/v1/completions", json={"model": "small-only", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = await client.post("/v1/completions", json={"model": "small", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "small"  # fits: the first model answers
    assert requests_per_backend(router) == {"short": 3, "long": 1}


async def test_a_429_nothing_absorbs_reaches_the_client_with_its_retry_after_and_cools_the_backend(
    nursery: trio.Nursery,
) -> None:
    """Before routes: a 503, and the next request went to the backend at once
    despite ``Retry-After: 2``."""
    clock = FakeClock()
    router, client = await route_through(nursery, [("a", "m", status(429, 2), {})], [{"name": "m", "backends": ["a"]}], clock)
    async with client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and r.headers["retry-after"] in ("1", "2")
        assert requests_per_backend(router) == {"a": 1}  # cooling: not asked
        clock.offset += 2.1
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and requests_per_backend(router) == {"a": 2}


async def test_a_group_absorbs_a_429_and_the_backend_that_sent_it_rests_for_its_retry_after(
    nursery: trio.Nursery,
) -> None:
    router, client = await route_through(
        nursery,
        [("a", "m", status(429, 30), {}), ("b", "m", [], {})],
        [{"name": "m", "backends": ["a", "b"], "policy": "round_robin"}],
    )
    async with client:
        for _ in range(6):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    assert requests_per_backend(router) == {"a": 1, "b": 6}


async def test_a_canary_split_is_about_95_to_5_over_conversations_and_sticky_within_one(nursery: trio.Nursery) -> None:
    router, client = await route_through(
        nursery,
        [("a", "m-v1", [], {}), ("b", "m-v2", [], {})],
        [
            {"name": "assistant", "versions": [{"model": "m-v1", "weight": 95}, {"model": "m-v2", "weight": 5}]},
            {"name": "m-v1", "backends": ["a"]},
            {"name": "m-v2", "backends": ["b"]},
        ],
    )
    answered: dict[str, list[str]] = {}

    async def conversation(i: int) -> None:
        for turns in ((), ("and then?",)):
            r = await client.post("/v1/chat/completions", json=chat(f"question {i}", *turns, model="assistant"))
            assert r.status_code == 200, r.text
            answered.setdefault(f"question {i}", []).append(r.json()["model"])

    async with client:
        for start in range(0, 200, 20):
            async with trio.open_nursery() as batch:
                for i in range(start, start + 20):
                    batch.start_soon(conversation, i)
    assert all(len(set(models)) == 1 for models in answered.values())  # no conversation flipped
    canary = sum(models[0] == "m-v2" for models in answered.values())
    assert 3 <= canary <= 20, canary  # ~5% of 200
    versions = {(v.version, v.requests) for v in router.dispatcher.statistics().versions}
    assert versions == {("m-v1", 2 * (200 - canary)), ("m-v2", 2 * canary)}


async def test_weights_change_at_run_time_without_dropping_a_stream_in_flight(nursery: trio.Nursery) -> None:
    router, client = await route_through(
        nursery,
        [("a", "m-v1", [], {"tpot_s": 0.02}), ("b", "m-v2", [], {})],
        [
            {"name": "assistant", "versions": [{"model": "m-v1", "weight": 1}, {"model": "m-v2", "weight": 0}]},
            {"name": "m-v1", "backends": ["a"]},
            {"name": "m-v2", "backends": ["b"]},
        ],
    )
    change = {"model": "assistant", "versions": [{"model": "m-v1", "weight": 0}, {"model": "m-v2", "weight": 1}]}
    async with client:
        body = chat("long one", model="assistant", stream=True, max_tokens=20, ignore_eos=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as s:
            lines = s.aiter_lines()
            first = await lines.__anext__()
            assert json.loads(first[6:])["model"] == "m-v1"
            r = await client.post("/admin/models", json=change)
            assert r.status_code == 200 and {v["version"]: v["weight"] for v in r.json()["data"]} == {"m-v1": 0, "m-v2": 1}
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        r = await client.post("/v1/chat/completions", json=chat("long one", model="assistant"))
        assert r.json()["model"] == "m-v2"
        listed = (await client.get("/admin/models")).json()["data"]
        assert [(v["route"], v["version"], v["requests"]) for v in listed] == [("assistant", "m-v1", 1), ("assistant", "m-v2", 1)]
        metrics = (await client.get("/metrics")).text  # per-version series, so a canary can be judged
        assert 'headrace_model_version_requests_total{route="assistant",version="m-v2"} 1.0' in metrics
        assert 'headrace_model_version_weight{route="assistant",version="m-v1"} 0.0' in metrics
        assert 'headrace_backend_cooling{backend="a"} 0.0' in metrics
        bad = [
            ({"model": "nope", "versions": []}, 404),
            ({"model": "m-v1", "versions": []}, 400),  # not a split
            ({"model": "assistant", "versions": [{"model": "m-v3", "weight": 1}]}, 400),
            ({"model": "assistant", "versions": [{"model": "m-v2", "weight": 0}]}, 400),  # would sum to 0
            ({"model": "assistant", "versions": [{"model": "m-v2", "weight": -1}]}, 400),
            ({"model": "assistant"}, 400),
        ]
        for payload, code in bad:
            r = await client.post("/admin/models", json=payload)
            assert r.status_code == code, (payload, r.text)
    assert requests_per_backend(router) == {"a": 1, "b": 1}


async def test_v1_models_lists_routes_and_aliases_before_what_backends_list(nursery: trio.Nursery) -> None:
    _, client = await route_through(
        nursery,
        [("a", "learned", [], {})],
        [{"name": "chat", "aliases": ["gpt-4o"], "upstream_model": "learned", "backends": ["a"]}],
    )
    async with client:
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["chat", "gpt-4o", "learned"]
        r = await client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "chat"
        r = await client.post("/v1/completions", json={"model": "learned", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "learned"  # not routed: as before


class Recording(FakeBackend):
    """A FakeBackend that remembers the model each request named."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[str | None] = []

    def stream(self, request: GenerateRequest) -> Any:
        self.asked.append(request.model)
        return super().stream(request)


async def test_a_named_group_serves_an_upstream_model_its_backend_does_not_list(nursery: trio.Nursery) -> None:
    """Before routes, a model missing from every backend's /v1/models was a 404."""
    fake = Recording("p", models=("listed",))
    config = decode_config({
        "backends": [{"kind": "mock", "name": "p"}],
        "models": [{"name": "private", "upstream_model": "unlisted", "backends": ["p"]}],
    })  # fmt: skip
    router = Router(config, [NamedBackend("p", fake)])
    url = await serve_router(nursery, router)
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/completions", json={"model": "private", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "private", r.text
        r = await client.post("/v1/completions", json={"model": "unlisted", "prompt": "hi"})
        assert r.status_code == 404  # only the route's name is public
    assert fake.asked == ["unlisted"]


# ------------------------------------------------------------ the dispatcher alone, on fake time


async def dispatcher(*fakes: FakeBackend, **kw: Any) -> Dispatcher:
    actors = [BackendActor(f.name, f) for f in fakes]
    for a in actors:
        await a.probe()
    return Dispatcher(actors, RoundRobin(), **kw)


async def collect(d: Dispatcher, **kw: Any) -> list[Event]:
    return [e async for e in d.stream(GenerateRequest(**kw))]


async def test_a_cool_down_lasts_the_429s_retry_after_on_the_routers_clock(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeBackend("a", fail_before=UpstreamRateLimited("slow down", retry_after=2.0))
    d = await dispatcher(a)
    for wait, started in ((0.0, 1), (1.9, 1), (0.2, 2)):
        await trio.sleep(wait)
        with pytest.raises(UpstreamRateLimited) as info:
            await collect(d)
        assert a.started == started and info.value.status == 429
    assert 0 < info.value.retry_after <= 2.0  # type: ignore[operator]


async def test_a_429_without_retry_after_cools_for_the_configured_default_and_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeBackend("a", fail_before=UpstreamRateLimited("slow down"))
    d = await dispatcher(a, cooldown=5.0)
    with pytest.raises(UpstreamRateLimited) as info:
        await collect(d)
    assert info.value.retry_after == 5.0 and d.statistics().cooling == ("a",)
    await trio.sleep(5.0)
    assert d.statistics().cooling == ()


async def test_each_group_has_its_own_policy_instance() -> None:
    config = decode_config({
        "backends": [{"kind": "mock", "name": "a"}, {"kind": "mock", "name": "b"}],
        "models": [{"name": "x", "backends": ["a"]}, {"name": "y", "backends": ["b"], "policy": "least_loaded"}],
    })  # fmt: skip
    router = Router(config, [NamedBackend("a", FakeBackend("a")), NamedBackend("b", FakeBackend("b"))])
    policies = router.dispatcher.routes.policies()
    assert len({id(p) for p, _ in policies}) == 3
    assert [(type(p).__name__, group) for p, group in policies] == [
        ("KVAware", None), ("KVAware", ("a",)), ("LeastLoaded", ("b",)),
    ]  # fmt: skip


# ------------------------------------------------------------ the split, as a pure function


def test_the_conversation_key_is_its_first_messages_up_to_the_first_user_message() -> None:
    def key(*turns: str) -> bytes:
        messages = chat("where is the moon", *turns)["messages"]
        return conversation_key(msgspec_request(messages=messages))

    assert key() == key("and the sun?") == key("and the sun?", "thanks")
    assert key() != conversation_key(msgspec_request(messages=chat("where is mars")["messages"]))
    assert conversation_key(GenerateRequest(prompt="p" * 1000)) == b"p" * 256


def msgspec_request(**fields: Any) -> GenerateRequest:
    import msgspec

    return msgspec.convert(fields, GenerateRequest)


def test_the_split_is_stable_across_processes() -> None:
    """blake2b, not Python's salted str hash: these values hold in every
    process, so router replicas agree (changing them would move every
    conversation to another version)."""
    versions = [("v1", 50.0), ("v2", 50.0)]
    picks = [pick_version("assistant", versions, f"k{i}".encode()) for i in range(12)]
    assert picks == [0, 0, 1, 0, 0, 1, 0, 1, 1, 1, 1, 0]


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 100.0), min_size=2, max_size=4).filter(lambda w: sum(w) > 1e-3),
    which=st.integers(0, 3),
    raised=st.floats(0.0, 100.0),
)
def test_raising_one_versions_weight_only_moves_conversations_onto_it(weights: list[float], which: int, raised: float) -> None:
    which %= len(weights)
    names = [f"v{i}" for i in range(len(weights))]
    before = list(zip(names, weights, strict=True))
    after = [(n, w + raised if i == which else w) for i, (n, w) in enumerate(before)]
    for i in range(200):
        key = f"conversation {i}".encode()
        old, new = pick_version("s", before, key), pick_version("s", after, key)
        assert new in (old, which)


@settings(max_examples=15, deadline=None)
@given(weights=st.lists(st.integers(1, 20), min_size=2, max_size=4))
def test_each_version_gets_its_share_of_conversations(weights: list[int]) -> None:
    versions = [(f"v{i}", float(w)) for i, w in enumerate(weights)]
    n = 4000
    counts = [0] * len(weights)
    for i in range(n):
        counts[pick_version("split", versions, f"c{i}".encode())] += 1
    total = sum(weights)
    for count, w in zip(counts, weights, strict=True):
        expected = n * w / total
        assert abs(count - expected) <= 5 * (expected * (1 - w / total)) ** 0.5 + 5, (counts, weights)


def test_a_route_table_plans_the_version_then_the_fallbacks_each_once() -> None:
    config = decode_config({
        "models": [
            {"name": "a", "versions": [{"model": "a1", "weight": 1}, {"model": "a2", "weight": 0}], "fallbacks": ["b"]},
            {"name": "a1", "fallbacks": ["b"]},
            {"name": "a2"},
            {"name": "b", "upstream_model": "bee"},
        ],
    })  # fmt: skip
    table = RouteTable(config.models, RoundRobin())
    plan = table.plan(GenerateRequest(model="a", prompt="hi"))
    assert [(t.name, t.upstream) for t in plan.targets] == [("a1", "a1"), ("b", "bee")]
    plan = table.plan(GenerateRequest(model="elsewhere"))
    assert [(t.name, t.upstream, t.backends) for t in plan.targets] == [("elsewhere", "elsewhere", None)]

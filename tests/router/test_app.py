"""The router's HTTP surface in-process (ASGI): ops routes, admin, auth,
routing errors, metrics, and a Hypothesis fuzz that never gets a 500."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.mock import MockBackend, MockConfig
from frontend.serving import ServeOptions, serve
from router.app import NamedBackend, Router
from router.config import decode_config
from tests.router.fakes import FakeBackend


async def start_router(nursery: trio.Nursery, backends: list[Any], **config: Any) -> tuple[Router, httpx.AsyncClient]:
    router = Router(decode_config(config), [NamedBackend(b.info().name, b) for b in backends])
    await nursery.start(router.run)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://router")
    return router, client


@pytest.fixture
async def mocks(nursery: trio.Nursery) -> AsyncIterator[tuple[Router, httpx.AsyncClient]]:
    backends = [MockBackend(MockConfig(name=f"mock-{i}", models=("mock", f"only-{i}"))) for i in range(2)]
    # Round robin: the first request lands on mock-0 (the default, kv_aware, would go by its prefix).
    router, client = await start_router(nursery, backends, routing={"policy": "round_robin"})
    async with client:
        yield router, client


def assert_openai_error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err  # type: ignore[no-any-return]


async def test_health_ready_and_models_union(mocks: tuple[Router, httpx.AsyncClient]) -> None:
    _, client = mocks
    assert (await client.get("/health")).json()["status"] == "ok"
    ready = await client.get("/ready")
    assert ready.status_code == 200 and ready.json()["backends_up"] == ["mock-0", "mock-1"]
    models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert models == ["mock", "only-0", "only-1"]


async def test_unknown_model_is_404_and_model_of_one_backend_routes_there(mocks: tuple[Router, httpx.AsyncClient]) -> None:
    router, client = mocks
    r = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and assert_openai_error(r)["code"] == "model_not_found"
    for _ in range(3):
        r = await client.post("/v1/completions", json={"model": "only-1", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    stats = {a.name: a.statistics().requests for a in router.actors}
    assert stats == {"mock-0": 0, "mock-1": 3}


async def test_an_empty_model_name_is_no_model(mocks: tuple[Router, httpx.AsyncClient]) -> None:
    """Found by the body fuzzer: ``"model": ""`` was answered as "model" but routed as a
    model no backend serves (503)."""
    _, client = mocks
    r = await client.post("/v1/completions", json={"model": "", "prompt": "", "max_tokens": 2})
    assert r.status_code == 200, r.text


async def test_no_backend_up_is_503_with_retry_after_and_not_ready(nursery: trio.Nursery) -> None:
    down = FakeBackend("down")
    down.healthy = False
    _, client = await start_router(nursery, [down], routing={"retry_after": 7})
    async with client:
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/health")).status_code == 200  # liveness
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert assert_openai_error(r)["code"] == "no_healthy_backend"  # refused by admission, at once


async def test_admin_drains_and_undrains_one_backend(mocks: tuple[Router, httpx.AsyncClient]) -> None:
    router, client = mocks
    r = await client.post("/admin/backends", json={"backend": "mock-0", "action": "drain"})
    assert r.status_code == 200 and r.json()["draining"] is True
    for _ in range(4):
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200
    listed = {b["name"]: b for b in (await client.get("/admin/backends")).json()["data"]}
    assert listed["mock-0"]["requests"] == 0 and listed["mock-1"]["requests"] == 4
    assert listed["mock-0"]["state"] == "up" and listed["mock-0"]["in_flight"] == 0
    await client.post("/admin/backends", json={"backend": "mock-0", "action": "undrain"})
    assert not router.actors[0].draining
    for body, status in [({"backend": "nope", "action": "drain"}, 404), ({"backend": "mock-0", "action": "x"}, 400), ({"b": 1}, 400)]:
        r = await client.post("/admin/backends", json=body)
        assert r.status_code == status
        assert_openai_error(r)


async def test_api_keys_map_to_tenants_and_probes_need_no_key(nursery: trio.Nursery) -> None:
    _, client = await start_router(nursery, [FakeBackend("a")], auth={"keys": {"sk-a": "team-a"}})
    async with client:
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and assert_openai_error(r)["code"] == "invalid_api_key"
        r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer sk-b"})
        assert r.status_code == 401
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"authorization": "Bearer sk-a"})
        assert r.status_code == 200
        assert (await client.get("/admin/backends")).status_code == 401
        assert (await client.get("/ready")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'headrace_requests_total{route="/v1/completions",status="200",tenant="team-a"} 1.0' in metrics
    assert 'headrace_requests_total{route="/v1/completions",status="401",tenant="anonymous"} 2.0' in metrics


async def test_tenant_reaches_the_backend_request(nursery: trio.Nursery) -> None:
    seen: list[str] = []

    class Recording(FakeBackend):
        def stream(self, request: Any) -> Any:
            seen.append(request.tenant)
            return super().stream(request)

    _, client = await start_router(nursery, [Recording("a")], auth={"keys": {"sk-a": "team-a"}})
    async with client:
        await client.post("/v1/generate", json={"prompt": "x"}, headers={"authorization": "Bearer sk-a"})
    assert seen == ["team-a"]


async def test_metrics_expose_backend_state_and_token_timings(mocks: tuple[Router, httpx.AsyncClient]) -> None:
    router, client = mocks
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    router.actors[1].drain()
    r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in [
        'headrace_backend_up{backend="mock-0"} 1.0',
        'headrace_backend_in_flight{backend="mock-0"} 0.0',
        'headrace_backend_draining{backend="mock-1"} 1.0',
        'headrace_backend_tokens_total{backend="mock-0"} 3.0',
        'headrace_time_to_first_token_seconds_count{backend="mock-0"} 1.0',
        'headrace_inter_token_latency_seconds_count{backend="mock-0"} 2.0',
        'headrace_queue_time_seconds_count{backend="mock-0"} 1.0',
        'headrace_requests_total{route="/v1/completions",status="200",tenant="default"} 1.0',
    ]:
        assert line in text, line


async def test_two_routers_in_one_process_have_separate_metrics(nursery: trio.Nursery) -> None:
    _, c1 = await start_router(nursery, [FakeBackend("a")])
    _, c2 = await start_router(nursery, [FakeBackend("a")])
    async with c1, c2:
        await c1.post("/v1/completions", json={"prompt": "x"})
        text = (await c2.get("/metrics")).text
    assert 'route="/v1/completions"' not in text


# ------------------------------------------------------------------ fuzz

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "top_k", "min_p", "echo",
    "suffix", "best_of", "prompt_token_ids", "return_token_ids", "priority", "user", "presence_penalty",
    "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
]  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from(["mock", "only-0", "nope", "user", "assistant", "system"]),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["role", "content", "include_usage", "x"]), inner, max_size=3),
    max_leaves=8,
)
valid_bits: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["mock", "only-0", "only-1"]),
    "prompt": st.one_of(st.text(max_size=10), st.lists(st.integers(0, 300), min_size=1, max_size=4)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=8)}), min_size=1, max_size=2),
    "max_tokens": st.integers(1, 4),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(0, 2**32),
    "temperature": st.floats(0, 2),
}
OPTIONAL = ["model", "max_tokens", "n", "stream", "stream_options", "seed", "temperature"]


@st.composite
def bodies(draw: st.DrawFn, path: str) -> Any:
    """Mostly a valid request with a few fields replaced by arbitrary JSON;
    sometimes arbitrary JSON altogether."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    body = {"messages" if path.endswith("chat/completions") else "prompt": draw(valid_bits["messages" if path.endswith("chat/completions") else "prompt"])}
    for field in draw(st.lists(st.sampled_from(OPTIONAL), max_size=4, unique=True)):
        body[field] = draw(valid_bits[field])
    if path == "/v1/generate":
        body.pop("n", None)
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=2, unique=True)):
        body[field] = draw(json_values)
    return body


def fuzz_router() -> Router:
    backends = [MockBackend(MockConfig(name=f"mock-{i}", models=("mock", f"only-{i}"), max_tokens=8)) for i in range(2)]
    return Router(decode_config({}), [NamedBackend(b.info().name, b) for b in backends])


async def post_checked(client: httpx.AsyncClient, path: str, body: Any) -> None:
    r = await client.post(path, content=json.dumps(body, allow_nan=False), headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert_openai_error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "error" not in r.text, r.text


PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/generate"])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), path=PATHS)
async def test_generated_bodies_never_get_a_5xx(data: st.DataObject, path: str) -> None:
    """Each example runs in its own trio.run, so it builds its own router."""
    body = data.draw(bodies(path))
    router = fuzz_router()
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
            await post_checked(client, path, body)
        nursery.cancel_scope.cancel()


@settings(max_examples=15, deadline=None)
@given(data=st.data(), path=PATHS)
async def test_generated_bodies_over_real_h2_never_get_a_5xx(data: st.DataObject, path: str) -> None:
    body = data.draw(bodies(path))
    router = fuzz_router()
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        url = await nursery.start(serve, router, ServeOptions())
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
            await post_checked(client, path, body)
        nursery.cancel_scope.cancel()

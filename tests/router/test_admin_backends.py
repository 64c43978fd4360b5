"""The admin API at runtime (issue 18), through the real router's admin
listener over 127.0.0.1 with real mock servers: drain with a stream in
flight (it completes; new requests go elsewhere), undrain, a backend added
at runtime takes traffic, removal drains first and waits for the streams,
``/admin/policies`` says what decides; none of it on the API listener."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from backends.mock import MockConfig
from backends.openai_http import OpenAIHTTPBackend
from router.app import NamedBackend, Router
from router.config import decode_config
from tests.backends.conftest import Served, serve_mock
from tests.router.test_breakdown import serve_both

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "mock", "prompt": "x", "max_tokens": 3}
SETTINGS: dict[str, Any] = {"server": {"port": 0}, "routing": {"policy": "round_robin"}, "health": {"interval": 0.2}}


async def fleet(nursery: trio.Nursery, names: tuple[str, ...] = ("a", "b"), settings: dict[str, Any] | None = None,
                ) -> tuple[Router, str, str, dict[str, Served]]:  # fmt: skip
    mocks = {n: await serve_mock(nursery, MockConfig(name=n, models=("mock",), tpot_s=0.02 if n == "a" else 0.0))
             for n in names}  # fmt: skip
    config = decode_config({**SETTINGS, **(settings or {})})
    router = Router(config, [NamedBackend(n, OpenAIHTTPBackend(m.url, name=n)) for n, m in mocks.items()])
    url, admin = await serve_both(nursery, router, config)
    return router, url, admin, mocks


def requests_by_backend(router: Router) -> dict[str, int]:
    return {a.name: a.statistics().requests for a in router.actors}


async def complete(url: str, n: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        for _ in range(n):
            r = await client.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text


async def test_a_drained_backend_finishes_its_stream_and_gets_no_new_ones(nursery: trio.Nursery) -> None:
    router, url, admin, _ = await fleet(nursery)
    done = trio.Event()
    streamed: list[str] = []

    async def long_stream() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client, client.stream(
            "POST", "/v1/completions", json={**BODY, "max_tokens": 40, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_text():
                streamed.append(chunk)
        done.set()

    nursery.start_soon(long_stream)  # round robin: the first request goes to a (20 ms a token)
    with trio.fail_after(5):
        while router.actors[0].in_flight == 0:
            await trio.sleep(0.005)
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        r = await client.post("/admin/backends/a/drain")
        assert r.status_code == 200 and r.json()["draining"] is True
        before = requests_by_backend(router)
        await complete(url, 4)
        assert requests_by_backend(router) == {"a": before["a"], "b": before["b"] + 4}
        assert router.actors[0].in_flight == 1  # the stream goes on
        with trio.fail_after(10):
            await done.wait()
        assert "[DONE]" in "".join(streamed)
        r = await client.post("/admin/backends", content=json.dumps({"action": "undrain", "backend": "a"}))
        assert r.status_code == 200 and r.json()["draining"] is False
    await complete(url, 4)
    assert requests_by_backend(router)["a"] == before["a"] + 2  # back in the rotation


async def test_a_backend_added_at_runtime_takes_traffic_and_leaves_when_removed(nursery: trio.Nursery) -> None:
    router, url, admin, _ = await fleet(nursery, ("b",))
    extra = await serve_mock(nursery, MockConfig(name="c", models=("mock",), tpot_s=0.02))
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        r = await client.post("/admin/backends", json={"action": "add", "url": extra.url, "name": "c"})
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "c" and r.json()["state"] == "up"  # probed before the answer
        names = [b["name"] for b in (await client.get("/admin/backends")).json()["data"]]
        assert names == ["b", "c"]
        await complete(url, 4)
        assert requests_by_backend(router) == {"b": 2, "c": 2}
        # Removal with a stream in flight on c: drained at once, gone when the stream ends.
        finished = trio.Event()

        async def on_c() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=20) as api, api.stream(
                "POST", "/v1/completions", json={**BODY, "max_tokens": 30, "stream": True}
            ) as s:
                assert "[DONE]" in (await s.aread()).decode()
            finished.set()

        await complete(url, 1)  # b's turn
        nursery.start_soon(on_c)  # then c's
        with trio.fail_after(5):
            while router.actor("c").in_flight == 0:
                await trio.sleep(0.005)
        r = await client.delete("/admin/backends/c")
        assert r.status_code == 202 and r.json()["state"] == "removing"
        await complete(url, 3)
        assert requests_by_backend(router)["b"] == 6
        with trio.fail_after(10):
            await finished.wait()
            while any(a.name == "c" for a in router.actors):
                await trio.sleep(0.005)
        names = [b["name"] for b in (await client.get("/admin/backends")).json()["data"]]
        assert names == ["b"]
        metrics = (await client.get("/metrics")).text
        assert 'headrace_backend_up{backend="c"}' not in metrics
        # The last backend stays; an unknown one is a 404.
        r = await client.delete("/admin/backends/b")
        assert r.status_code == 409 and r.json()["error"]["code"] == "backend_conflict"
        assert (await client.delete("/admin/backends/nope")).status_code == 404
    await complete(url, 2)


async def test_an_idle_backend_is_removed_at_once_and_can_be_added_again(nursery: trio.Nursery) -> None:
    router, url, admin, mocks = await fleet(nursery)
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        r = await client.post("/admin/backends", json={"action": "remove", "backend": "b"})
        assert r.status_code == 200 and r.json() == {"backend": "b", "state": "removed"}
        assert [a.name for a in router.actors] == ["a"]
        r = await client.post("/admin/backends", json={"action": "add", "url": mocks["b"].url, "name": "b"})
        assert r.status_code == 201
    await complete(url, 2)
    assert requests_by_backend(router) == {"a": 1, "b": 1}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"action": "add", "name": "x"}, 400, "url"),
        ({"action": "add", "url": "http://127.0.0.1:9", "name": "a"}, 409, "name"),
        ({"action": "add", "url": "http://127.0.0.1:9", "options": {"no_such_option": 1}}, 400, None),
        ({"action": "add", "url": "http://127.0.0.1:9", "weight": -1}, 400, None),
        ({"action": "explode", "backend": "a"}, 400, None),
        ({"action": "drain"}, 400, "backend"),
        ({"action": "drain", "backend": "zz"}, 404, "backend"),
    ],
)
async def test_bad_admin_requests_are_openai_shaped_errors(nursery: trio.Nursery, body: dict[str, Any], status: int, param: str | None) -> None:
    router, _, admin, _ = await fleet(nursery)
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        r = await client.post("/admin/backends", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    assert [a.name for a in router.actors] == ["a", "b"]


async def test_admin_policies_says_what_decides_per_extension_point_and_model_group(nursery: trio.Nursery) -> None:
    settings = {
        "models": [{"name": "mock", "backends": ["a"], "policy": "least_loaded"}, {"name": "other", "upstream_model": "mock"}],
        "breaker": {"policy": "standard", "options": {"consecutive_failures": 7}},
        "priority": {"policy": "fair_queue", "options": {"aging": 4}},
    }
    _, url, admin, _ = await fleet(nursery, settings=settings)
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        data = (await client.get("/admin/policies")).json()
    assert data["routing"]["default"]["policy"] == "round_robin"
    groups = {g["model"]: g for g in data["routing"]["groups"]}
    assert groups["mock"]["policy"] == "least_loaded" and groups["mock"]["backends"] == ["a"]
    assert groups["other"]["policy"] == "round_robin" and groups["other"]["backends"] is None
    assert data["breaker"] == {"enabled": True, "policy": "standard", "options": {"consecutive_failures": 7}}
    assert data["priority"] == {"policy": "fair_queue", "options": {"aging": 4}}
    assert data["admission"]["enabled"] is True and data["admission"]["policy"] == "erlang"
    assert data["ratelimit"]["policy"] == "memory" and data["tracing"]["export"] is False
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:  # never on the API listener
        for method, path in (("GET", "/admin/policies"), ("GET", "/admin/backends"), ("DELETE", "/admin/backends/a"),
                             ("POST", "/admin/backends/a/drain"), ("GET", "/admin/memory")):  # fmt: skip
            r = await client.request(method, path)
            assert r.status_code == 404, (method, path)


async def test_admin_memory_reports_the_process_s_memory(nursery: trio.Nursery) -> None:
    """``/admin/memory``: the router's resident size and, on glibc, the C heap
    in use and free; the heap in use follows what the process allocates."""
    router, url, admin, _ = await fleet(nursery)
    await complete(url, 2)
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        before = (await client.get("/admin/memory")).json()
        held = [bytes(4096) + i.to_bytes(4, "little") for i in range(4096)]  # 16 MiB on the C heap
        during = (await client.get("/admin/memory")).json()
        del held
    assert set(before) == {"resident_bytes", "heap_in_use_bytes", "heap_free_bytes", "python_blocks", "trims", "trimmed_bytes"}
    assert before["resident_bytes"] > 20 << 20 and before["python_blocks"] > 10_000
    assert before["trims"] == router.heap_trimmer.trims
    if before["heap_in_use_bytes"] is not None:  # glibc
        assert during["heap_in_use_bytes"] - before["heap_in_use_bytes"] > 15 << 20
        assert before["heap_free_bytes"] >= 0

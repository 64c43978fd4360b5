"""/metrics and /admin/* live on their own listener, bound to 127.0.0.1 by
default, and admin calls need the admin key when one is configured: the main
listener, the one clients reach, answers neither (metrics name tenants,
admin calls drain backends)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from router.app import NamedBackend, Router
from router.config import ConfigError, decode_config
from router.server import admin_options_for, admin_port, options_for
from tests.hardening.harness import REPO, start_mocks, start_router
from tests.router.fakes import FakeBackend

ADMIN_KEY = "sk-admin-7d1e"
API_KEY = "sk-team-a"
pytestmark = pytest.mark.timeout(120)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_the_main_listener_serves_no_metrics_and_no_admin(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``headrace serve``: /metrics and /admin/* are 404 on the main URL and
    answer on the admin URL (127.0.0.1, a port of its own), which in turn
    serves no API; /health and /ready answer on both."""
    urls, _ = await start_mocks(nursery, n=1)
    router = await start_router(nursery, tmp_path, urls)
    assert router.admin_url.startswith("http://127.0.0.1:") and router.admin_url != router.url
    async with httpx.AsyncClient(base_url=router.url, timeout=5) as main, httpx.AsyncClient(base_url=router.admin_url, timeout=5) as admin:
        for path in ("/metrics", "/admin/backends", "/admin/routing", "/admin/models"):
            assert (await main.get(path)).status_code == 404, path
        assert (await main.post("/admin/backends", json={"backend": "backend-0", "action": "drain"})).status_code == 404
        assert (await main.post("/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 2})).status_code == 200
        metrics = await admin.get("/metrics")
        assert metrics.status_code == 200 and 'route="/v1/completions"' in metrics.text
        assert (await admin.get("/admin/backends")).json()["data"][0]["name"] == "backend-0"
        assert (await admin.post("/v1/completions", json={"model": "mock", "prompt": "x"})).status_code == 404
        for path in ("/health", "/ready"):
            assert (await main.get(path)).status_code == 200
            assert (await admin.get(path)).status_code == 200


def _router(**auth: object) -> Router:
    return Router(decode_config({"auth": auth}), [NamedBackend("a", FakeBackend("a"))])


async def test_admin_calls_need_the_admin_key_and_an_api_key_is_not_one(nursery: trio.Nursery) -> None:
    router = _router(api_keys=[{"sha256": _digest(API_KEY), "tenant": "team-a"}], admin_sha256=_digest(ADMIN_KEY))
    await nursery.start(router.run)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.admin), base_url="http://admin") as admin:
        drain = {"backend": "a", "action": "drain"}
        for headers in ({}, {"authorization": f"Bearer {API_KEY}"}, {"authorization": "Bearer sk-admin-7d1f"}, {"authorization": ADMIN_KEY}):
            r = await admin.post("/admin/backends", json=drain, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        assert not router.actors[0].draining
        r = await admin.post("/admin/backends", json=drain, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200 and router.actors[0].draining
        assert (await admin.get("/metrics")).status_code == 200  # scrapers need no key on the admin listener
        assert (await admin.get("/ready")).status_code == 503  # no key needed; not ready: its one backend drains
    # The all-in-one in-process app takes the admin key too, and no API key, for /admin/*.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as inline:
        assert (await inline.get("/admin/backends", headers={"authorization": f"Bearer {API_KEY}"})).status_code == 401
        assert (await inline.get("/admin/backends", headers={"authorization": f"Bearer {ADMIN_KEY}"})).status_code == 200
    assert router.admin_key == bytes.fromhex(_digest(ADMIN_KEY))  # held as the digest only


async def test_without_an_admin_key_admin_calls_take_none_on_the_admin_listener(nursery: trio.Nursery) -> None:
    """No ``admin_sha256``: the loopback-only admin listener is the guard;
    the public app still knows no /admin/* (an API key gets a 404)."""
    router = _router(api_keys=[{"sha256": _digest(API_KEY), "tenant": "team-a"}])
    await nursery.start(router.run)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.admin), base_url="http://admin") as admin:
        assert (await admin.get("/admin/backends")).status_code == 200
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.public), base_url="http://main") as main:
        assert (await main.get("/admin/backends")).status_code == 401  # no key: nothing is told
        assert (await main.get("/admin/backends", headers={"authorization": f"Bearer {API_KEY}"})).status_code == 404
        assert (await main.get("/metrics", headers={"authorization": f"Bearer {API_KEY}"})).status_code == 404
        assert (await main.get("/ready")).status_code == 200


def test_the_admin_listener_defaults_to_loopback_and_the_next_port() -> None:
    for port, expected in ((8000, 8001), (0, 0)):
        config = decode_config({"server": {"port": port}})
        assert admin_port(config) == expected
        options = admin_options_for(config)
        assert (options.host, options.port, options.certfile) == ("127.0.0.1", expected, None)
    assert admin_port(decode_config({"server": {"port": 8000, "admin_port": 9100}})) == 9100
    assert options_for(decode_config({})).port == 8000


@pytest.mark.parametrize(
    ("server", "auth", "error"),
    [
        ({"admin_host": "0.0.0.0"}, {}, "server.admin_host '0.0.0.0' is not a loopback address: set auth.admin_sha256"),
        ({"port": 8000, "admin_port": 8000}, {}, "server.admin_port: the admin listener needs a port of its own"),
        ({"port": 65535}, {}, "server.admin_port: the main port + 1 is 65536"),
    ],
)
def test_an_unsafe_or_impossible_admin_listener_is_a_config_error(server: dict[str, object], auth: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace("+", r"\+")):
        admin_options_for(decode_config({"server": server, "auth": auth}))


def test_a_public_admin_listener_with_an_admin_key_is_allowed_and_serves_tls_like_the_main_one() -> None:
    config = decode_config({
        "server": {"admin_host": "0.0.0.0", "certfile": "c.pem", "keyfile": "k.pem"},
        "auth": {"admin_sha256": _digest(ADMIN_KEY)},
    })  # fmt: skip
    options = admin_options_for(config)
    assert (options.host, options.certfile, options.keyfile) == ("0.0.0.0", "c.pem", "k.pem")


def test_headrace_serve_refuses_a_public_admin_listener_without_a_key() -> None:
    """Exit status 2 and one line naming the field, before anything starts."""
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--workers", "1", "--backend", "http://127.0.0.1:9",
         "--set", 'server.admin_host="0.0.0.0"'],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "server.admin_host '0.0.0.0' is not a loopback address" in done.stderr

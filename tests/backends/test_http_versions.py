"""Issue 12, bug 0: HTTP/1.1-only backends (vLLM's, SGLang's and llama.cpp's
default servers, most hosted providers) were unreachable: every cleartext
backend was spoken to over HTTP/2 prior knowledge. ``http = "auto"`` tries
prior knowledge once and falls back to HTTP/1.1, remembering the answer;
``"1.1"`` and ``"2"`` force one."""

from __future__ import annotations

import pytest
import trio

from backends.base import GenerateRequest
from backends.errors import BackendUnavailable
from backends.mock import MockBackend, MockConfig
from backends.mock_server import build_app
from backends.openai_http import OpenAIHTTPBackend
from conformance import check_http
from router.app import Router
from router.config import ConfigError, decode_config
from router.factory import build_backends
from tests.backends.conftest import collect, collect_until_error, ids_of
from tests.conformance.serving import serving
from tests.conformance.test_router import FAST, routing
from tests.h1_server import serving_http1


def _app() -> object:
    return build_app(MockBackend(MockConfig(tpot_s=0.001)))


async def test_auto_falls_back_to_http1_and_remembers() -> None:
    async with serving_http1(_app()) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url)
        try:
            assert client.protocol is None
            assert (await client.health()).ok
            assert client.protocol == "1.1"
            events = await collect(client, GenerateRequest(prompt="hi", max_tokens=5))
            assert len(ids_of(events)) == 5 and events[-1].finish_reason == "length"
        finally:
            await client.aclose()


async def test_auto_keeps_http2_where_the_server_speaks_it() -> None:
    async with serving(_app()) as url:
        client = OpenAIHTTPBackend(url)
        try:
            assert (await client.health()).ok and client.protocol == "2"
            events = await collect(client, GenerateRequest(prompt="hi", max_tokens=3))
            assert len(ids_of(events)) == 3
        finally:
            await client.aclose()


async def test_auto_decides_nothing_while_nothing_listens() -> None:
    async with serving_http1(_app()) as url:  # type: ignore[arg-type]
        pass  # closed again: the port now refuses
    client = OpenAIHTTPBackend(url, connect_timeout=1)
    try:
        assert not (await client.health()).ok and client.protocol is None
        _, exc = await collect_until_error(client, GenerateRequest(prompt="hi", max_tokens=3))
        assert isinstance(exc, BackendUnavailable)
    finally:
        await client.aclose()


@pytest.mark.parametrize("http,ok", [("1.1", True), ("2", False)])
async def test_forced_versions_against_an_http1_only_server(http: str, ok: bool) -> None:
    async with serving_http1(_app()) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http=http)  # type: ignore[arg-type]
        try:
            with trio.fail_after(5):
                assert (await client.health()).ok is ok
        finally:
            await client.aclose()


async def test_http1_probes_have_their_own_pool_so_busy_streams_never_starve_them() -> None:
    """One request connection, held by a slow stream: the health probe still
    answers at once (it used to queue behind the stream and time out, so a
    slow client made a healthy HTTP/1.1 backend look dead)."""
    async with serving_http1(build_app(MockBackend(MockConfig(tpot_s=0.2)))) as url:  # type: ignore[arg-type]
        client = OpenAIHTTPBackend(url, http="1.1", max_connections=1)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, client, GenerateRequest(prompt="hi", max_tokens=20, ignore_eos=True))
                await trio.sleep(0.3)  # the stream holds the only request connection
                with trio.fail_after(1.0):
                    assert (await client.health()).ok
                nursery.cancel_scope.cancel()
        finally:
            await client.aclose()


def test_every_adapter_option_is_settable_in_config_and_checked() -> None:
    config = decode_config({"backends": [{
        "url": "http://127.0.0.1:9", "model": "m",
        "options": {"http": "1.1", "stall_timeout": 7, "first_token_timeout": 3, "connect_timeout": 1,
                    "health_timeout": 2, "max_connections": 4, "token_ids": False, "api_key": "k", "verify": False},
    }]})  # fmt: skip
    backend = build_backends(config)[0].backend
    assert isinstance(backend, OpenAIHTTPBackend)
    assert (backend.http, backend.stall_timeout, backend.first_token_timeout) == ("1.1", 7, 3)
    assert backend.model == "m" and backend.token_ids is False
    for bad, said in [({"htp": "1.1"}, "htp"), ({"http": "3"}, "http"), ({"stall_timeout": -1}, "stall_timeout")]:
        config = decode_config({"backends": [{"url": "http://127.0.0.1:9", "options": bad}]})
        with pytest.raises(ConfigError, match=said):
            build_backends(config)


def test_api_key_env_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"url": "http://127.0.0.1:9", "options": {"api_key_env": "HEADRACE_TEST_KEY"}}
    with pytest.raises(ConfigError, match="HEADRACE_TEST_KEY"):
        build_backends(decode_config({"backends": [spec]}))
    monkeypatch.setenv("HEADRACE_TEST_KEY", "sk-1")
    assert isinstance(build_backends(decode_config({"backends": [spec]}))[0].backend, OpenAIHTTPBackend)


@pytest.mark.parametrize("http", ["auto", "1.1"])
async def test_a_router_over_http1_only_backends_passes_the_http_suite(http: str) -> None:
    async with serving_http1(_app()) as m1, serving_http1(_app()) as m2:  # type: ignore[arg-type]
        specs = [{"url": u, "options": {"http": http}} for u in (m1, m2)]
        config = decode_config({"backends": specs})
        async with routing(Router(config, build_backends(config))) as url:
            report = await check_http(url, http="2", **FAST)  # type: ignore[arg-type]
    assert report.ok, report.format_table()

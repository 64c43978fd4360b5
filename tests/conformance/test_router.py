"""The router honours the same contract as the backends behind it: the
conformance suite passes against a router in front of mocks, in-process and
over real HTTP/2 to `headrace mock` apps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from backends.mock import MockBackend, MockConfig
from backends.mock_server import build_app
from conformance import check_http
from frontend.serving import ServeOptions
from router.app import NamedBackend, Router
from router.config import decode_config
from router.factory import build_backends
from router.server import run_router

from .serving import serving

FAST = {"check_timeout": 30.0, "grace": 5.0}


def _mock() -> MockBackend:
    return MockBackend(MockConfig(tpot_s=0.002))


@asynccontextmanager
async def routing(router: Router) -> AsyncIterator[str]:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(run_router, router, ServeOptions(graceful_timeout=0.1), shutdown=shutdown))
        try:
            yield url
        finally:
            shutdown.set()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_router_over_in_process_mocks_passes_the_http_suite(http: str) -> None:
    router = Router(decode_config({}), [NamedBackend("a", _mock()), NamedBackend("b", _mock())])
    async with routing(router) as url:
        report = await check_http(url, http=http, **FAST)
    assert report.ok, report.format_table()
    assert report.capabilities["token_ids"] is True


async def test_a_router_over_two_mock_servers_passes_the_http_suite() -> None:
    async with serving(build_app(_mock())) as m1, serving(build_app(_mock())) as m2:
        config = decode_config({"backends": [{"url": m1, "kind": "openai"}, {"url": m2, "kind": "openai"}]})
        async with routing(Router(config, build_backends(config))) as url:
            report = await check_http(url, http="2", **FAST)
    assert report.ok, report.format_table()

"""The built-in engine passes the conformance suite, in-process and over
HTTP, and so does a router in front of it (tiny random model)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig
from backends.engine.server import run_server
from backends.serving import ServeOptions
from conformance import check_backend, check_http
from router.app import Router
from router.config import decode_config
from router.factory import build_backends
from tests.engine import tiny

from .test_router import routing

FAST = {"check_timeout": 60.0, "grace": 5.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_gguf(tiny.hf_model(), tmp_path_factory.mktemp("conf") / "tiny.gguf")


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_kv_blocks=256, block_size=4, max_model_len=256, max_num_seqs=16)


@asynccontextmanager
async def engine_server(model: Path) -> AsyncIterator[str]:
    engine, tok, name = build_engine(_config(model))
    backend = EngineBackend(engine, tok, model_name=name)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(run_server, backend, ServeOptions(graceful_timeout=0.1), shutdown))
        try:
            yield url
        finally:
            shutdown.set()


async def test_the_engine_backend_passes_the_in_process_suite(tiny_model: Path) -> None:
    async with trio.open_nursery() as nursery:

        async def make() -> EngineBackend:
            engine, tok, name = build_engine(_config(tiny_model))
            backend = EngineBackend(engine, tok, model_name=name)
            await nursery.start(backend.run)
            return backend

        report = await check_backend(make, **FAST)
        nursery.cancel_scope.cancel()
    assert report.ok, report.format_table()


async def test_the_engine_server_passes_the_http_suite(tiny_model: Path) -> None:
    async with engine_server(tiny_model) as url:
        report = await check_http(url, http="2", **FAST)
    assert report.ok, report.format_table()
    assert report.capabilities["token_ids"] is True


async def test_a_router_in_front_of_the_engine_passes_the_http_suite(tiny_model: Path) -> None:
    async with engine_server(tiny_model) as engine_url:
        config = decode_config({"backends": [{"url": engine_url, "kind": "engine"}]})
        async with routing(Router(config, build_backends(config))) as url:
            report = await check_http(url, http="2", **FAST)
    assert report.ok, report.format_table()

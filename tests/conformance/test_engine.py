"""The built-in engine passes the conformance suite, in-process and over
HTTP, and so does a router in front of it (tiny random model)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig, SamplingDefaults
from backends.engine.server import run_server
from conformance import check_backend, check_http
from frontend.serving import ServeOptions
from router.app import Router
from router.config import decode_config
from router.factory import build_backends
from tests.engine import tiny

from .test_router import routing

FAST = {"check_timeout": 60.0, "grace": 5.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_gguf(tiny.hf_model(), tmp_path_factory.mktemp("conf") / "tiny.gguf")


def _config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(model), num_kv_blocks=256, block_size=4, max_model_len=256, max_num_seqs=16, **kw)


@asynccontextmanager
async def engine_server(model: Path, **kw: Any) -> AsyncIterator[str]:
    engine, tok, name = build_engine(_config(model, **kw))
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
    assert report.outcome("tokens.resume.contract") == "pass"  # batch-invariant: exact_resume


async def test_a_router_in_front_of_the_engine_passes_the_http_suite(tiny_model: Path) -> None:
    async with engine_server(tiny_model) as engine_url:
        config = decode_config({"backends": [{"url": engine_url, "kind": "engine"}]})
        async with routing(Router(config, build_backends(config))) as url:
            report = await check_http(url, http="2", **FAST)
    assert report.ok, report.format_table()


async def test_a_router_leaves_unset_sampling_to_the_engines_defaults(tiny_model: Path) -> None:
    """The engine samples greedily by default here; through the router a request
    without temperature still gets that default (the router forwards it unset),
    and one with temperature 1 keeps its own."""
    greedy = SamplingDefaults(temperature=0.0)
    async with engine_server(tiny_model, sampling_defaults=greedy) as engine_url:
        config = decode_config({"backends": [{"url": engine_url, "kind": "engine"}]})
        async with routing(Router(config, build_backends(config))) as url, httpx.AsyncClient(base_url=url) as client:

            async def text(**kw: Any) -> str:
                body = {"prompt": "the water", "max_tokens": 12, "ignore_eos": True, **kw}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return str(r.json()["choices"][0]["text"])

            unset = {await text(seed=s) for s in range(3)}
            assert unset == {await text(temperature=0)}
            assert len({await text(temperature=1.0, seed=s) for s in range(3)}) > 1

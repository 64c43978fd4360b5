"""A live engine server (tiny model, real HTTP on 127.0.0.1) exports exactly
the families frontend/metric_names.py declares for the engine, with their
labels; its per-call SLIs are labelled by route and model."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import trio

from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig
from backends.engine.server import run_server
from frontend import metric_names as N
from frontend.serving import ServeOptions
from tests.router.test_metric_names import check_exposition


async def test_a_live_engine_exports_exactly_the_declared_families_and_labels(tiny_gguf: Path) -> None:
    config = EngineConfig(model=str(tiny_gguf), num_kv_blocks=64, block_size=4, max_model_len=128)
    engine, tok, name = build_engine(config)
    backend = EngineBackend(engine, tok, model_name=name)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(run_server, backend, ServeOptions("127.0.0.1", 0), shutdown))
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": name, "prompt": "the", "max_tokens": 4, "ignore_eos": True, "stream": True}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert (await client.post("/v1/completions", json={**body, "model": "nope"})).status_code == 404
            text = (await client.get("/metrics")).text
        shutdown.set()
    found = check_exposition(text, "engine")
    always = {f.name for f in N.exported_by("engine", conditional=False)}
    assert always <= set(found), sorted(always - set(found))
    gpu_present = found[N.GPU_COLLECTOR_UP.name][0].value == 1.0
    conditional = {f.name for f in N.exported_by("engine") if f.when}
    # no speculation here; GPU families only with a device
    expected_conditional = {f for f in conditional if f.startswith("headrace_gpu_")} if gpu_present else set()
    assert set(found) - always == expected_conditional
    counts = {(s.labels["route"], s.labels["model"]): s.value for s in found[N.ENGINE_TTFT.name] if s.name.endswith("_count")}
    assert counts == {("/v1/completions", name): 1.0}
    itl = [s.value for s in found[N.ENGINE_ITL.name] if s.name.endswith("_count")]
    assert itl and itl[0] >= 3.0  # four tokens: three gaps at least

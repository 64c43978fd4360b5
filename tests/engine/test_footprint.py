"""The engine's footprint report (backends/engine/footprint.py): weights are
the model's parameters, buffers and packed layouts and the KV cache the one
reserved, as the runner's memory() counts them (so /v1/models' footprint and
memory agree),
the resident set is the process's; /v1/models carries it for each model."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from backends.engine.backend import build_engine, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.footprint import measure, rss_bytes
from backends.engine.server import build_app


def test_the_footprint_counts_weights_kv_cache_and_the_resident_set(tiny_gguf: Path) -> None:
    engine, _, _ = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=64, block_size=4, max_model_len=128))
    runner = engine.runner
    fp = measure(runner, 1.25)
    params = {t.data_ptr(): t.numel() * t.element_size() for t in [*runner.model.parameters(), *runner.model.buffers()]}
    memory = runner.memory()  # one count: the footprint's weights are the runner's, packed layouts included
    assert fp.weights_bytes == memory.weights + memory.packed >= sum(params.values()) > 0
    assert fp.kv_cache_bytes == memory.kv_reserved
    assert fp.kv_cache_bytes == runner.kv.numel() * runner.kv.element_size() == 2 * 64 * 4 * runner.args.n_layers * runner.args.n_kv_heads * runner.args.head_dim * 4
    assert 0 < fp.rss_bytes <= rss_bytes() * 2 and fp.device == "cpu" and fp.cuda_allocated_bytes is None
    assert fp.line().startswith("in 1.25 s: weights ") and "KV cache 0.1 MiB" in fp.line()
    assert torch.cuda.is_available() or "CUDA" not in fp.line()


async def test_v1_models_reports_the_footprint(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=64, block_size=4, max_model_len=128))
    fp = measure(engine.runner, 0.5)
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        transport = httpx.ASGITransport(app=build_app(backend, fp))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            data = (await client.get("/v1/models")).json()["data"]
    assert data[0]["footprint"] == {"load_seconds": 0.5, "weights_bytes": fp.weights_bytes, "kv_cache_bytes": fp.kv_cache_bytes,
                                    "rss_bytes": fp.rss_bytes, "device": "cpu", "cuda_allocated_bytes": None}  # fmt: skip

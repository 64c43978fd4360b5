"""The trace reaches the engine (issue 18): a client's ``traceparent``
through the real router to ``headrace engine`` (tiny model) over
127.0.0.1; the engine's request line names the client's trace, and its
parent span is the router's attempt span, which the router exports."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig
from backends.engine.server import run_server
from backends.openai_http import OpenAIHTTPBackend
from frontend.serving import ServeOptions
from router.app import NamedBackend, Router
from router.config import decode_config
from router.tracing import Tracer
from tests.router.test_integration import serve_router

pytestmark = pytest.mark.timeout(120)
TRACE = "0af7651916cd43dd8448eb211c80319c"


async def test_the_engines_request_line_carries_the_trace_and_the_attempts_span(
    nursery: trio.Nursery, tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="headrace.engine.requests")
    engine, tok, name = build_engine(EngineConfig(model=str(tiny_gguf), num_kv_blocks=64, block_size=4, max_model_len=128))
    backend = EngineBackend(engine, tok, model_name=name)
    engine_url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0), trio.Event())
    exporter = InMemorySpanExporter()
    router = Router(decode_config({}), [NamedBackend("engine-0", OpenAIHTTPBackend(engine_url, name="engine-0", token_ids=True))],
                    tracer=Tracer(processor=SimpleSpanProcessor(exporter)))  # fmt: skip
    url = await serve_router(nursery, router)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 3, "stream": True},
                              headers={"traceparent": f"00-{TRACE}-b7ad6b7169203331-01"})  # fmt: skip
        assert r.status_code == 200 and "[DONE]" in r.text
    with trio.fail_after(10):
        while not [s for s in exporter.get_finished_spans() if s.name == "headrace.request"]:
            await trio.sleep(0.005)
    (attempt,) = [s for s in exporter.get_finished_spans() if s.name == "backend.attempt"]
    lines = [rec for rec in caplog.records if rec.name == "headrace.engine.requests" and rec.fields["route"] == "/v1/completions"]  # type: ignore[attr-defined]
    (line,) = lines
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["trace_id"] == TRACE and fields["status"] == 200
    assert fields["parent_span_id"] == f"{attempt.context.span_id:016x}"
    assert TRACE in line.getMessage()

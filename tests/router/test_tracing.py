"""W3C trace context through the real router to real backend servers over
127.0.0.1 (issue 18): the client's ``traceparent`` is continued (a malformed
one starts a new trace, never an error), each backend attempt is sent a
``traceparent`` naming a span of its own, the mock's request line names the
trace and that span, and the spans (request, admission, queue, attempts,
migration) reach OpenTelemetry: the SDK's in-memory exporter for their
structure, a loopback OTLP/HTTP receiver for the real export."""

from __future__ import annotations

import http.server
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.mock import MockBackend, MockConfig, parse_fault
from backends.openai_http import OpenAIHTTPBackend
from frontend.context import parse_traceparent
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from router.app import NamedBackend, Router
from router.config import decode_config
from router.tracing import Tracer, sampled_by_ratio
from tests.backends.conftest import serve_mock
from tests.router.test_integration import serve_router

pytestmark = pytest.mark.timeout(60)

TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
BODY = {"model": "mock", "prompt": "the mill", "max_tokens": 6, "stream": True}


@pytest.mark.parametrize(
    ("header", "valid"),
    [
        (f"00-{TRACE}-{CALLER_SPAN}-01", True),
        (f"00-{TRACE}-{CALLER_SPAN}-00", True),
        (f"01-{TRACE}-{CALLER_SPAN}-01-future-field", True),  # a later version's extra field is ignored
        (f"00-{TRACE}-{CALLER_SPAN}-01-extra", False),  # version 00 has nothing after the flags
        (f"ff-{TRACE}-{CALLER_SPAN}-01", False),
        (f"00-{TRACE.upper()}-{CALLER_SPAN}-01", False),
        (f"00-{'0' * 32}-{CALLER_SPAN}-01", False),
        (f"00-{TRACE}-{'0' * 16}-01", False),
        (f"00-{TRACE[:-1]}-{CALLER_SPAN}-01", False),
        ("garbage", False),
        ("", False),
    ],
)
def test_traceparent_is_validated_as_the_w3c_spec_says(header: str, valid: bool) -> None:
    parsed = parse_traceparent(header)
    assert (parsed is not None) is valid
    if valid:
        assert parsed is not None and parsed[:2] == (TRACE, CALLER_SPAN)


def test_new_traces_are_sampled_by_trace_id_as_opentelemetry_does() -> None:
    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

    sampler = TraceIdRatioBased(0.25)
    for i in range(200):
        trace_id = f"{(i * 0x9E3779B97F4A7C15 * 2654435761) % (1 << 128):032x}"
        theirs = sampler.should_sample(None, int(trace_id, 16), "x").decision is Decision.RECORD_AND_SAMPLE
        assert sampled_by_ratio(trace_id, 0.25) is theirs


class Capturing:
    """An OpenAI mock server app that records every generation request's ``traceparent``."""

    def __init__(self, **config: Any) -> None:
        self.app = OpenAIServer(MockBackend(MockConfig(models=("mock",), **config)))
        self.seen: list[str | None] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.seen.append(headers.get("traceparent"))
        await self.app(scope, receive, send)


def memory_tracer() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracer(processor=SimpleSpanProcessor(exporter)), exporter


async def finished_spans(exported: InMemorySpanExporter, roots: int = 1) -> list[Any]:
    """The spans once ``roots`` requests have ended at the router (its
    ``finished`` hook runs after the last byte, so after the client has it)."""
    with trio.fail_after(5):
        while sum(s.name == "headrace.request" for s in exported.get_finished_spans()) < roots:
            await trio.sleep(0.005)
    return list(exported.get_finished_spans())


async def post(url: str, headers: dict[str, str] | None = None, body: dict[str, Any] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        r = await client.post("/v1/completions", json=body or BODY, headers=headers or {})
        await r.aread()
        return r


async def test_the_callers_trace_reaches_the_backend_with_the_attempts_span_as_parent(nursery: trio.Nursery) -> None:
    upstream = Capturing()
    url = await nursery.start(serve, upstream, ServeOptions(graceful_timeout=0.1))
    tracer, exported = memory_tracer()
    router = Router(decode_config({}), [NamedBackend("b", OpenAIHTTPBackend(url, name="b"))], tracer=tracer)
    base = await serve_router(nursery, router)
    r = await post(base, {"traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"})
    assert r.status_code == 200 and "[DONE]" in r.text
    (sent,) = upstream.seen
    parsed = parse_traceparent(sent)
    assert parsed is not None
    trace_id, parent, sampled = parsed
    assert trace_id == TRACE and sampled
    assert parent != CALLER_SPAN  # a span of the router's own, not the client's
    spans = {s.name: s for s in await finished_spans(exported)}
    assert set(spans) >= {"headrace.request", "admission", "queue", "backend.attempt"}
    root, attempt = spans["headrace.request"], spans["backend.attempt"]
    assert {s.context.trace_id for s in spans.values()} == {int(TRACE, 16)}
    assert root.parent is not None and root.parent.span_id == int(CALLER_SPAN, 16) and root.parent.is_remote
    assert attempt.context.span_id == int(parent, 16)  # the backend's parent is the attempt span
    assert attempt.parent is not None and attempt.parent.span_id == root.context.span_id
    for name in ("admission", "queue"):
        assert spans[name].parent is not None and spans[name].parent.span_id == root.context.span_id
    assert attempt.attributes is not None and attempt.attributes["headrace.backend"] == "b"
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 200
    assert root.start_time is not None and attempt.start_time is not None and root.start_time <= attempt.start_time


@pytest.mark.parametrize("header", [None, "00-zz-not-a-trace-01", f"00-{'0' * 32}-{CALLER_SPAN}-01"])
async def test_a_missing_or_malformed_traceparent_starts_a_new_trace_never_an_error(nursery: trio.Nursery, header: str | None) -> None:
    upstream = Capturing()
    url = await nursery.start(serve, upstream, ServeOptions(graceful_timeout=0.1))
    router = Router(decode_config({}), [NamedBackend("b", OpenAIHTTPBackend(url, name="b"))])
    base = await serve_router(nursery, router)
    r = await post(base, {"traceparent": header} if header is not None else {})
    assert r.status_code == 200
    (sent,) = upstream.seen
    parsed = parse_traceparent(sent)
    assert parsed is not None and parsed[0] not in (TRACE, "0" * 32)
    assert not parsed[2]  # tracing is off: a new trace is not sampled


async def test_each_attempt_gets_its_own_span_and_the_mock_logs_the_trace(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """The first backend answers 503, the second serves: two attempt spans
    under the request, and the second mock's request line (fast path)
    names the trace and the second attempt's span."""
    caplog.set_level(logging.DEBUG, logger="headrace.mock.requests")
    bad = await serve_mock(nursery, MockConfig(name="bad", models=("mock",)), [parse_fault("status=503")])
    good = await serve_mock(nursery, MockConfig(name="good", models=("mock",)))
    tracer, exported = memory_tracer()
    config = decode_config({"routing": {"policy": "round_robin"}, "breaker": {"enabled": False}, "retry": {"backoff_base": 0}})
    backends = [NamedBackend("bad", OpenAIHTTPBackend(bad.url, name="bad")), NamedBackend("good", OpenAIHTTPBackend(good.url, name="good"))]
    router = Router(config, backends, tracer=tracer)
    base = await serve_router(nursery, router)
    r = await post(base, {"traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"})
    assert r.status_code == 200
    attempts = [s for s in await finished_spans(exported) if s.name == "backend.attempt"]
    assert [s.attributes["headrace.backend"] for s in attempts if s.attributes] == ["bad", "good"]
    assert attempts[0].status.is_ok is False and attempts[1].status.is_ok
    assert attempts[0].status.description == "backend_unavailable"  # the 503's code
    assert attempts[0].context.span_id != attempts[1].context.span_id
    lines = [rec for rec in caplog.records if rec.name == "headrace.mock.requests"]
    traced = [rec.fields for rec in lines if rec.fields["trace_id"] == TRACE]  # type: ignore[attr-defined]
    assert {f["parent_span_id"] for f in traced} >= {f"{attempts[1].context.span_id:016x}"}


async def test_a_migration_is_a_span_holding_its_continuation_attempt(nursery: trio.Nursery) -> None:
    bad = await serve_mock(nursery, MockConfig(name="bad", models=("mock",)), [parse_fault("cut-after=2")])
    good = await serve_mock(nursery, MockConfig(name="good", models=("mock",)))
    tracer, exported = memory_tracer()
    config = decode_config({"routing": {"policy": "round_robin"}, "breaker": {"enabled": False}})
    backends = [NamedBackend("bad", OpenAIHTTPBackend(bad.url, name="bad")), NamedBackend("good", OpenAIHTTPBackend(good.url, name="good"))]
    router = Router(config, backends, tracer=tracer)
    base = await serve_router(nursery, router)
    r = await post(base, {"traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"}, {**BODY, "max_tokens": 12})
    assert r.status_code == 200 and "[DONE]" in r.text
    spans = await finished_spans(exported)
    (migration,) = [s for s in spans if s.name == "migration"]
    root = next(s for s in spans if s.name == "headrace.request")
    attempts = [s for s in spans if s.name == "backend.attempt"]
    assert len(attempts) == 2
    first, second = attempts
    assert first.parent is not None and first.parent.span_id == root.context.span_id
    assert second.parent is not None and second.parent.span_id == migration.context.span_id
    assert migration.parent is not None and migration.parent.span_id == root.context.span_id
    assert migration.attributes is not None and migration.attributes["headrace.from"] == "bad"
    assert migration.attributes["headrace.to"] == "good"
    assert root.attributes is not None and root.attributes["headrace.migrations"] == 1


class _Receiver(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # http.server calls it by this name
        length = int(self.headers.get("content-length", 0))
        type(self).bodies.append(self.rfile.read(length))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[bytes]]]:
    _Receiver.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", _Receiver.bodies
    finally:
        server.shutdown()
        thread.join(5)


async def test_spans_are_exported_over_otlp_http_to_a_collector(otlp_receiver: tuple[str, list[bytes]]) -> None:
    """``[tracing] otlp_endpoint``: the router's batch processor posts the
    spans as OTLP protobuf; flushed at the router's exit."""
    endpoint, bodies = otlp_receiver
    config = decode_config({"tracing": {"otlp_endpoint": endpoint, "sample_ratio": 1.0, "service_name": "edge-7"}})
    async with trio.open_nursery() as nursery:
        upstream = Capturing()
        url = await nursery.start(serve, upstream, ServeOptions(graceful_timeout=0.1))
        router = Router(config, [NamedBackend("b", OpenAIHTTPBackend(url, name="b"))])
        base = await serve_router(nursery, router)
        r = await post(base)  # a new trace, sampled at ratio 1
        assert r.status_code == 200
        trace_id = parse_traceparent(upstream.seen[0])
        assert trace_id is not None
        assert router.tracer is not None
        with trio.fail_after(5):
            while router.tracer.exported < 4:
                await trio.sleep(0.005)
        await trio.to_thread.run_sync(router.tracer.processor.force_flush)
        nursery.cancel_scope.cancel()
    spans = []
    for body in bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
            assert service == "edge-7"
            for scope in resource.scope_spans:
                spans += list(scope.spans)
    assert {s.name for s in spans} >= {"headrace.request", "admission", "queue", "backend.attempt"}
    assert {s.trace_id.hex() for s in spans} == {trace_id[0]}
    attempt = next(s for s in spans if s.name == "backend.attempt")
    assert attempt.span_id.hex() == trace_id[1]


def test_no_opentelemetry_import_when_tracing_is_off() -> None:
    """The default config builds a router and traces requests' ids without
    importing OpenTelemetry (a process of its own: this one imported it)."""
    code = (
        "import sys, trio\n"
        "from backends.mock import MockBackend, MockConfig\n"
        "from router.app import NamedBackend, Router\n"
        "from router.config import decode_config\n"
        "import httpx\n"
        "async def main():\n"
        "    router = Router(decode_config({}), [NamedBackend('m', MockBackend(MockConfig(models=('mock',))))])\n"
        "    async with trio.open_nursery() as n:\n"
        "        await n.start(router.run)\n"
        "        t = httpx.ASGITransport(app=router)\n"
        "        async with httpx.AsyncClient(transport=t, base_url='http://r') as c:\n"
        "            r = await c.post('/v1/completions', json={'model': 'mock', 'prompt': 'x', 'max_tokens': 2},\n"
        f"                             headers={{'traceparent': '00-{TRACE}-{CALLER_SPAN}-01'}})\n"
        "            assert r.status_code == 200, r.text\n"
        "        n.cancel_scope.cancel()\n"
        "trio.run(main)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().replace("'", '"')) == []


async def test_sampling_new_traces_by_ratio_and_callers_by_their_flag(nursery: trio.Nursery) -> None:
    """At ratio 0 a new trace records nothing (and the backend is told it is
    not sampled) while a caller's sampled trace is recorded; with
    respect_parent off, the caller's flag no longer decides."""
    upstream = Capturing()
    url = await nursery.start(serve, upstream, ServeOptions(graceful_timeout=0.1))
    exporter = InMemorySpanExporter()
    tracer = Tracer(processor=SimpleSpanProcessor(exporter), sample_ratio=0.0)
    router = Router(decode_config({}), [NamedBackend("b", OpenAIHTTPBackend(url, name="b"))], tracer=tracer)
    base = await serve_router(nursery, router)
    assert (await post(base)).status_code == 200
    assert (await post(base, {"traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"})).status_code == 200
    spans = await finished_spans(exporter)
    assert {s.context.trace_id for s in spans} == {int(TRACE, 16)}  # only the caller's sampled trace
    flags = [parse_traceparent(tp) for tp in upstream.seen]
    assert [f[2] for f in flags if f is not None] == [False, True]
    tracer.respect_parent = False
    assert (await post(base, {"traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"})).status_code == 200
    last = parse_traceparent(upstream.seen[-1])
    assert last is not None and last[0] == TRACE and not last[2]

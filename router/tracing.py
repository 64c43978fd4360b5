"""Request tracing: W3C ``traceparent`` in and out, spans, OTLP export.

The trace of a request is decided once, where its context is made
(:func:`frontend.context.apply_trace`: the caller's valid ``traceparent``
is continued, anything else starts a new trace) and kept on the
:class:`~frontend.context.RequestContext`. The router's spans::

    headrace.request          SERVER  arrival -> last byte      (parent: the caller's span)
      admission               INTERNAL  the rate-limit stage      (router/pipeline.py)
      queue                   INTERNAL  admission and the wait for a slot
      backend.attempt         CLIENT  one per attempt; its span id is the
                                      ``traceparent`` parent the backend gets
      migration               INTERNAL  from a break to its continuation's end
        backend.attempt       CLIENT  the continuation

Span ids are the router's own (:func:`~frontend.context.new_span_id`), made
whether or not anything is exported: every backend attempt carries a
``traceparent`` of its own, so a backend's logs (the engine's, the mock's,
vLLM's) name the trace and the attempt. Spans are recorded as plain
:class:`Span` records on the request's record (router/logs.py) only when a
:class:`Tracer` is configured and the trace is sampled; at the end of the
request they are handed to OpenTelemetry's SDK (a ``BatchSpanProcessor``
over the OTLP/HTTP exporter, or any processor a test gives) as its
``ReadableSpan``. Off (the default: no ``[tracing] otlp_endpoint``), nothing
of OpenTelemetry is imported and a request pays for two span ids and a
string per attempt.

Sampling: a trace the caller sampled (flag 01) is sampled, one it did not is
not (parent-based, unless ``respect_parent = false``); a new trace is sampled
with probability ``sample_ratio``, decided on its trace id as OpenTelemetry's
``TraceIdRatioBased`` decides (the low 64 bits below ratio x 2^64), so every
router of a fleet decides the same for the same trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import trio

__all__ = ["Span", "Tracer", "child_traceparent", "sampled_by_ratio"]

log = logging.getLogger(__name__)

AttributeValue = str | int | float | bool


class Span:
    """One finished (or open: ``end`` None) span, on trio's clock."""

    __slots__ = ("attributes", "end", "error", "kind", "name", "parent_id", "span_id", "start")

    def __init__(self, name: str, span_id: str, parent_id: str | None, start: float, kind: str = "internal") -> None:
        self.name, self.span_id, self.parent_id, self.start, self.kind = name, span_id, parent_id, start, kind
        self.end: float | None = None
        self.error: str | None = None  # an error code: the span's status is ERROR
        self.attributes: dict[str, AttributeValue] = {}

    def finish(self, end: float, error: str | None = None, **attributes: AttributeValue) -> None:
        self.end, self.error = end, error
        self.attributes.update(attributes)


def child_traceparent(traceparent: str, span_id: str, sampled: bool | None = None) -> str:
    """``traceparent`` (one this process formatted: version 00) with
    ``span_id`` as the parent: what the next hop is sent."""
    flags = traceparent[53:55] if sampled is None else ("01" if sampled else "00")
    return f"00-{traceparent[3:35]}-{span_id}-{flags}"


def sampled_by_ratio(trace_id: str, ratio: float) -> bool:
    """OpenTelemetry's ``TraceIdRatioBased`` decision for ``trace_id``."""
    return int(trace_id[16:], 16) < round(ratio * (1 << 64))


class Tracer:
    """Exports finished requests' spans through an OpenTelemetry span
    processor. ``processor`` (tests: a ``SimpleSpanProcessor`` over the
    SDK's in-memory exporter) or ``endpoint`` (an OTLP/HTTP collector,
    e.g. ``http://collector:4318/v1/traces``) batched in the SDK's thread."""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        processor: Any = None,
        sample_ratio: float = 1.0,
        respect_parent: bool = True,
        service_name: str = "headrace-router",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        if processor is None:
            if endpoint is None:
                raise ValueError("a Tracer needs an OTLP endpoint or a span processor")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, headers=dict(headers or {})))
        self.processor = processor
        self.sample_ratio = sample_ratio
        self.respect_parent = respect_parent
        self._resource = Resource.create({"service.name": service_name})
        self._scope = InstrumentationScope("headrace.router")
        self.exported = 0

    def sample(self, trace_id: str, parent_sampled: bool | None) -> bool:
        """Record this trace? ``parent_sampled``: the caller's flag (None: a new trace)."""
        if parent_sampled is not None and self.respect_parent:
            return parent_sampled
        return sampled_by_ratio(trace_id, self.sample_ratio)

    def export(self, trace_id: str, remote_parent: str | None, spans: list[Span]) -> None:
        """Hand the request's finished spans to the processor (open ones end now)."""
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
        now = trio.current_time()
        wall = time.time_ns()
        trace = int(trace_id, 16)
        flags = TraceFlags(TraceFlags.SAMPLED)

        def ns(t: float) -> int:
            return wall - int((now - t) * 1e9)

        def context(span_id: str, remote: bool = False) -> SpanContext:
            return SpanContext(trace, int(span_id, 16), is_remote=remote, trace_flags=flags)

        for span in spans:
            parent = span.parent_id or remote_parent
            readable = ReadableSpan(
                span.name,
                context=context(span.span_id),
                parent=context(parent, remote=parent == remote_parent) if parent else None,
                resource=self._resource,
                attributes=span.attributes,
                kind=kinds[span.kind],
                status=Status(StatusCode.ERROR, span.error) if span.error else Status(StatusCode.UNSET),
                start_time=ns(span.start),
                end_time=ns(span.end if span.end is not None else now),
                instrumentation_scope=self._scope,
            )
            self.processor.on_end(readable)
            self.exported += 1

    def shutdown(self) -> None:
        """Flush what is batched (at the router's exit)."""
        try:
            self.processor.shutdown()
        except Exception:
            log.exception("shutting the span exporter down failed")

"""One record per client request, and what becomes of it at the end: a
structured log line, the latency breakdown, the trace's spans.

::

    frontend: RequestContext (trace, arrival, read_at)
      Pipeline.admit ──> RequestRecord, on the context and in the Journal (by span id)
        stages: admission / queue spans, the rejection's code
        Dispatcher.stream(sub) ── journal.get(sub.traceparent) ──> the same record
          each attempt: record.attempt(backend) -> its span id (the backend's traceparent parent)
          first event, usage, the attempt's end, migrations
      pipeline exit: done_at (the last byte is out)
    OpenAIServer.finished(context, route, status) ──> RequestLog.finish
        phases ──> histograms per phase and backend, the /admin/breakdown window
        spans  ──> Tracer.export (sampled traces, when tracing is on)
        one JSON line on the ``headrace.requests`` logger (when enabled)

The phases of a request (seconds, trio's clock), which add up to its
duration; each is absent when the request never reached it::

    ingress   arrival (headers) -> body read            the client's upload
    queue     body read -> first backend dispatch       rate limits, admission, the queue, routing
    connect   first dispatch -> the answering attempt's  attempts that failed before the first
              dispatch                                   token (refused, 429, 5xx) and their backoff
    prefill   that dispatch -> first event              connection, the backend's queue and prefill
    decode    first event -> last backend event         generation (and any migration's gap)
    egress    last event -> last byte handed out        relay of the tail to the client

The log line holds no secret: never a header, an API key (only its
12-hex-digit key id) or a cookie; prompt and output text only with
``[logging] log_prompts = true``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from backends.base import GenerateRequest, Usage
from backends.errors import HeadraceError
from frontend.context import RequestContext, new_span_id
from router.breakdown import PHASES, Breakdown
from router.tracing import AttributeValue, Span, Tracer

__all__ = ["Attempt", "Journal", "JsonFormatter", "RequestLog", "RequestRecord", "phases_of"]

request_log = logging.getLogger("headrace.requests")
_encoder = msgspec.json.Encoder()


class Attempt:
    """One backend attempt of a request: its span id (the parent its
    backend is sent) and, when the trace is recorded, its span."""

    __slots__ = ("backend", "span", "span_id", "start")

    def __init__(self, backend: str, span_id: str, start: float, span: Span | None) -> None:
        self.backend, self.span_id, self.start, self.span = backend, span_id, start, span


class RequestRecord:
    """What one client request met, filled in as it goes (all on trio's clock)."""

    __slots__ = (
        "admitted_at", "answer_at", "attempts", "backend", "cached_tokens", "completion_tokens", "context",
        "dispatched_at", "done_at", "error_code", "first_at", "last_at", "migrations", "model", "output",
        "prompt", "prompt_tokens", "spans", "stream",
    )  # fmt: skip

    def __init__(self, context: RequestContext, *, spans: bool = False) -> None:
        self.context = context
        self.spans: list[Span] | None = [] if spans else None
        self.model: str | None = None
        self.stream = False
        self.admitted_at: float | None = None
        self.dispatched_at: float | None = None  # the first attempt's dispatch
        self.answer_at: float | None = None  # the dispatch of the attempt whose event came first
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.done_at: float | None = None
        self.backend: str | None = None  # the last backend tried (the one that answered, when one did)
        self.attempts = self.migrations = 0
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.error_code: str | None = None
        self.prompt: str | None = None  # only with log_prompts
        self.output: list[str] | None = None  # only with log_prompts

    # ------------------------------------------------------------ spans

    def span(self, name: str, start: float, *, parent: str | None = None, kind: str = "internal") -> Span | None:
        """A new child span (of ``parent``, default the request's), when recording."""
        if self.spans is None:
            return None
        span = Span(name, new_span_id(), parent or self.context.span_id, start, kind)
        self.spans.append(span)
        return span

    # ------------------------------------------------------------ the dispatcher's

    def attempt(self, backend: str, now: float, parent: str | None = None) -> Attempt:
        self.attempts += 1
        self.backend = backend
        if self.dispatched_at is None:
            self.dispatched_at = now
        span = self.span("backend.attempt", now, parent=parent, kind="client")
        if span is not None:
            span.attributes.update({"headrace.backend": backend, "headrace.attempt": self.attempts})
        return Attempt(backend, span.span_id if span is not None else new_span_id(), now, span)

    def first_event(self, attempt: Attempt, now: float) -> None:
        if self.first_at is None:
            self.first_at, self.answer_at = now, attempt.start

    def usage(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens

    def attempt_done(self, attempt: Attempt, now: float, last_at: float | None, error: str | None) -> None:
        if last_at is not None and (self.last_at is None or last_at > self.last_at):
            self.last_at = last_at
        if attempt.span is not None:
            attempt.span.finish(now, error)

    def failed(self, exc: HeadraceError) -> None:
        self.error_code = exc.code or exc.type

    def capture(self, request: GenerateRequest) -> None:
        """The prompt's text (``log_prompts``)."""
        if request.prompt is not None:
            self.prompt = request.prompt
        elif request.messages:
            self.prompt = "\n".join(f"{m.role}: {m.content}" for m in request.messages)
        self.output = []


class Journal:
    """The records of requests in flight, by the router's span id (unique
    per request, unlike a client's x-request-id), for the dispatcher, which
    sees each choice's GenerateRequest and not the context."""

    def __init__(self, *, tracer: Tracer | None = None, log_prompts: bool = False) -> None:
        self.tracer, self.log_prompts = tracer, log_prompts
        self._open: dict[str, RequestRecord] = {}

    def open(self, context: RequestContext) -> RequestRecord | None:
        if not context.span_id:
            return None  # no trace: a job, run without HTTP
        recording = False
        if self.tracer is not None and context.trace_id is not None:
            parent = context.sampled if context.parent_span_id is not None else None
            recording = context.sampled = self.tracer.sample(context.trace_id, parent)
        record = RequestRecord(context, spans=recording)
        context.record = record
        self._open[context.span_id] = record
        return record

    def close(self, record: RequestRecord, now: float) -> None:
        record.done_at = now
        self._open.pop(record.context.span_id, None)

    def get(self, request: GenerateRequest) -> RequestRecord | None:
        tp = request.traceparent
        return self._open.get(tp[36:52]) if tp else None

    def __len__(self) -> int:
        return len(self._open)


def failure_code(exc: BaseException | None) -> str:
    """How an attempt ended without finishing, for its span's status: an
    error's code, ``cancelled`` (the client left, or a deadline)."""
    if isinstance(exc, HeadraceError):
        return exc.code or exc.type
    if exc is None or isinstance(exc, (trio.Cancelled, GeneratorExit)):
        return "cancelled"
    return type(exc).__name__


def phases_of(r: RequestRecord) -> dict[str, float]:
    """The request's phases that it reached (module docstring), in seconds."""
    c, out = r.context, {}
    done = r.done_at
    if c.read_at:
        out["ingress"] = c.read_at - c.arrival
        end_of_queue = r.dispatched_at if r.dispatched_at is not None else done
        if end_of_queue is not None:
            out["queue"] = max(0.0, end_of_queue - c.read_at)
    if r.dispatched_at is not None and r.answer_at is not None and r.first_at is not None:
        out["connect"] = r.answer_at - r.dispatched_at
        out["prefill"] = r.first_at - r.answer_at
        if r.last_at is not None:
            out["decode"] = r.last_at - r.first_at
            if done is not None:
                out["egress"] = max(0.0, done - r.last_at)
    return out


class RequestLog:
    """The end of every API request: ``finished`` hook of the API app."""

    def __init__(
        self,
        *,
        breakdown: Breakdown,
        observe_phases: Callable[[str, dict[str, float]], None] | None = None,
        tracer: Tracer | None = None,
        lines: bool = False,
    ) -> None:
        self.breakdown, self.observe_phases, self.tracer, self.lines = breakdown, observe_phases, tracer, lines

    def finish(self, context: RequestContext, route: str, status: int) -> None:
        try:
            self._finish(context, route, status)
        except Exception:  # observability never fails a request
            logging.getLogger(__name__).exception("recording request %s failed", context.request_id)

    def _finish(self, context: RequestContext, route: str, status: int) -> None:
        now = trio.current_time()
        record: RequestRecord | None = context.record
        if record is not None and record.error_code is None and status == 499:
            record.error_code = "client_disconnected"
        phases = phases_of(record) if record is not None else {}
        if record is not None:
            backend = record.backend or "none"
            if self.observe_phases is not None:
                self.observe_phases(backend, phases)
            self.breakdown.add(backend, now, phases, status >= 400 or record.error_code is not None)
            if record.spans is not None and self.tracer is not None and context.trace_id is not None:
                self._export(record, route, status, now)
        if self.lines and request_log.isEnabledFor(logging.INFO):
            request_log.info("request", extra={"fields": line_fields(context, record, route, status, now, phases)})
        context.record = None  # no context <-> record cycle left for the garbage collector

    def _export(self, record: RequestRecord, route: str, status: int, now: float) -> None:
        c = record.context
        assert record.spans is not None and self.tracer is not None and c.trace_id is not None
        root = Span("headrace.request", c.span_id, c.parent_span_id, c.arrival, "server")
        attributes: dict[str, AttributeValue] = {
            "http.route": route, "http.response.status_code": status, "headrace.tenant": c.tenant,
            "headrace.request_id": c.request_id, "headrace.attempts": record.attempts, "headrace.migrations": record.migrations,
        }  # fmt: skip
        if record.backend:
            attributes["headrace.backend"] = record.backend
        if record.model:
            attributes["gen_ai.request.model"] = record.model
        root.finish(now, record.error_code, **attributes)
        try:
            self.tracer.export(c.trace_id, c.parent_span_id, [root, *record.spans])
        except Exception:
            logging.getLogger(__name__).exception("exporting the spans of request %s failed", c.request_id)


def line_fields(
    c: RequestContext, r: RequestRecord | None, route: str, status: int, now: float, phases: dict[str, float]
) -> dict[str, Any]:
    """The request's log line, as fields (never a header, a key or text
    unless ``log_prompts`` captured it)."""
    fields: dict[str, Any] = {
        "request_id": c.request_id, "trace_id": c.trace_id, "span_id": c.span_id, "route": route,
        "status": status, "tenant": c.tenant, "key_id": c.key_id, "priority": c.priority,
        "duration_ms": round((now - c.arrival) * 1000, 3),
    }  # fmt: skip
    if r is None:
        return fields
    first = r.first_at
    fields.update({
        "model": r.model, "stream": r.stream, "backend": r.backend, "error_code": r.error_code,
        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
        "attempts": r.attempts, "migrations": r.migrations,
        "ttft_ms": round((first - c.arrival) * 1000, 3) if first is not None else None,
        "phases_ms": {p: round(phases[p] * 1000, 3) for p in PHASES if p in phases},
    })  # fmt: skip
    if r.prompt is not None:
        fields["prompt"] = r.prompt
    if r.output is not None:
        fields["output"] = "".join(r.output)
    return fields


class JsonFormatter(logging.Formatter):
    """Every log record as one JSON object per line: ``ts`` (UTC, ISO
    8601), ``level``, ``logger``, ``msg``, the record's ``fields`` (the
    request line's) and ``exc`` (a traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            obj.update(fields)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(obj).decode()

"""The router's request pipeline: the gate every client request passes once,
after decoding and before its fan-out into choices (:mod:`frontend.context`).

::

    RequestContext + Call ──> RateLimits ──> Queue ──> fan out
                              (429 rate_limited) (admit / wait; 503 queue_full,
                                                  queue_timeout, shed, no_healthy_backend)

A stage is anything with ``admit(context, call)`` returning an async context
manager: entered in order, exited in reverse once the answer's last byte is
out, so a stage that holds a slot holds it for the whole call. A stage
refuses by raising a :class:`~backends.errors.HeadraceError` (429, 503...),
counted here by its ``code``. The router builds two stages
(router/admission.py): :class:`~router.admission.RateLimits`, the tenant's
and key's limits, always; :class:`~router.admission.Queue`, admission and
the fair queue per model group, unless ``[admission] enabled = false``. The
policies that decide stay sans-I/O in ``policies/``; stages own the clocks
and the waiting. With no stages the pipeline is a counted pass-through.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import trio

from backends.errors import HeadraceError
from frontend.call import Call
from frontend.context import Gate, RequestContext
from router.logs import Journal, RequestRecord

__all__ = ["Pipeline", "PipelineStatistics"]


class PipelineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    admitted: int  # client requests let through (each counted once, whatever its n)
    in_flight: int  # admitted and not yet finished
    rejected: dict[str, int]  # refused, by error code (or type when it has none)
    # Seconds from a refused request's arrival (its headers) to its refusal,
    # over the last REJECTION_SAMPLES refusals: the router's own part of a
    # rejection's latency (a queue_timeout, which waited, is not counted).
    rejection_p50: float | None = None
    rejection_p99: float | None = None


REJECTION_SAMPLES = 1024


# The span each stage's admission is traced as (router/tracing.py).
STAGE_SPANS = {"RateLimits": "admission", "Queue": "queue"}


class Pipeline:
    """The stages in order; a :class:`~frontend.context.Gate` itself.
    With a ``journal`` (router/logs.py), each request gets its record
    here, open until the answer's last byte, and a span per stage."""

    def __init__(self, stages: Sequence[Gate] = (), *, journal: Journal | None = None) -> None:
        self.stages = list(stages)
        self.journal = journal
        self._admitted = 0
        self._in_flight = 0
        self._rejected: dict[str, int] = {}
        self._rejections: deque[float] = deque(maxlen=REJECTION_SAMPLES)

    def admit(self, context: RequestContext, call: Call) -> _Admission:
        return _Admission(self, context, call)

    def _refused(self, exc: HeadraceError, context: RequestContext, record: RequestRecord | None) -> None:
        reason = exc.code or exc.type
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        if reason != "queue_timeout":
            self._rejections.append(trio.current_time() - context.arrival)
        if record is not None:
            record.failed(exc)

    async def _enter_recorded(self, stack: AsyncExitStack, context: RequestContext, call: Call, record: RequestRecord) -> None:
        """The stages, with the request's record: what it asked for, a span
        per stage when its trace is recorded."""
        record.model, record.stream = call.model, bool(call.wire.stream)
        if self.journal is not None and self.journal.log_prompts and call.subs:
            record.capture(call.subs[0])
        for stage in self.stages:
            name = STAGE_SPANS.get(type(stage).__name__)
            span = record.span(name, trio.current_time()) if name is not None else None
            try:
                await stack.enter_async_context(stage.admit(context, call))
            except HeadraceError as exc:
                if span is not None:
                    span.finish(trio.current_time(), exc.code or exc.type)
                raise
            if span is not None:
                span.finish(trio.current_time())
        record.admitted_at = trio.current_time()

    def statistics(self) -> PipelineStatistics:
        ordered = sorted(self._rejections)
        return PipelineStatistics(
            admitted=self._admitted,
            in_flight=self._in_flight,
            rejected=dict(self._rejected),
            rejection_p50=_quantile(ordered, 0.5),
            rejection_p99=_quantile(ordered, 0.99),
        )


class _Admission:
    """One request's way through the pipeline: its record opened, the stages
    entered in order (a refusal counted), and on the way out, however the
    call ended, the stages left in reverse and the record closed. A class,
    not an ``@asynccontextmanager`` (one async generator less a request)."""

    __slots__ = ("_call", "_context", "_pipeline", "_record", "_stack")

    def __init__(self, pipeline: Pipeline, context: RequestContext, call: Call) -> None:
        self._pipeline, self._context, self._call = pipeline, context, call
        self._record: RequestRecord | None = None
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> None:
        p, context, call, stack = self._pipeline, self._context, self._call, self._stack
        record = self._record = p.journal.open(context) if p.journal is not None else None
        try:
            try:
                if record is None:
                    for stage in p.stages:
                        await stack.enter_async_context(stage.admit(context, call))
                else:
                    await p._enter_recorded(stack, context, call, record)
            except HeadraceError as exc:
                p._refused(exc, context, record)
                raise
        except BaseException as exc:
            try:
                await stack.__aexit__(type(exc), exc, exc.__traceback__)  # the stages entered, left
            finally:
                self._close_record()
            raise
        p._admitted += 1
        p._in_flight += 1

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self._pipeline._in_flight -= 1
        try:
            return await self._stack.__aexit__(*exc_info)
        finally:
            self._close_record()

    def _close_record(self) -> None:
        journal, record = self._pipeline.journal, self._record
        if record is not None and journal is not None:
            journal.close(record, trio.current_time())


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted samples (None: no samples)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

"""The router's per-request cost of its request record (issue 18): the
trace ids, the journal, the phases, one histogram observation per phase,
the breakdown window, and optionally the JSON request line, for one
request with one attempt, without sockets::

    python -m bench.record_cost [--requests N]

prints microseconds per request with the request line off and on (formatted
by the JSON formatter, written to /dev/null)."""

from __future__ import annotations

import argparse
import logging
import os
import time

import msgspec
import trio

from backends.base import GenerateRequest, Usage
from frontend.context import RequestContext, apply_trace
from router.breakdown import Breakdown
from router.logs import Journal, JsonFormatter, RequestLog
from router.metrics import RouterMetrics
from router.tracing import child_traceparent

HEADERS = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


async def per_request(lines: bool, n: int) -> float:
    """Microseconds per request of the record path (what a request adds)."""
    metrics = RouterMetrics()
    journal = Journal()
    log = RequestLog(breakdown=Breakdown(), observe_phases=metrics.phase_times, lines=lines)
    sub = GenerateRequest(prompt="x")
    clock = trio.current_time
    start = time.perf_counter()
    for _ in range(n):
        context = RequestContext(request_id="r", arrival=clock())
        apply_trace(context, HEADERS)
        context.read_at = clock()
        record = journal.open(context)
        assert record is not None
        record.admitted_at = clock()
        request = msgspec.structs.replace(sub, traceparent=context.traceparent)
        found = journal.get(request)
        assert found is not None and request.traceparent is not None
        attempt = found.attempt("b", clock())
        msgspec.structs.replace(request, traceparent=child_traceparent(request.traceparent, attempt.span_id))
        found.first_event(attempt, clock())
        found.usage(Usage(3, 5))
        found.attempt_done(attempt, clock(), clock(), None)
        journal.close(record, clock())
        log.finish(context, "/v1/completions", 200)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    logger = logging.getLogger("headrace.requests")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 (lives as long as the process)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    off = trio.run(per_request, False, args.requests)
    on = trio.run(per_request, True, args.requests)
    print(f"request record, line off: {off:.1f} us/request; JSON line on: {on:.1f} us/request ({args.requests} requests)")


if __name__ == "__main__":
    main()

"""Load generator and benchmarks for headrace and any OpenAI-compatible server.

``headrace bench`` offers open-loop Poisson load and reports latency
percentiles; ``headrace bench engine`` measures engine throughput at fixed
concurrency; ``bench.roofline`` and ``bench.transformers_baseline`` give the
yardsticks the engine numbers are quoted against.
"""

from __future__ import annotations

from bench.client import RequestResult, RequestSpec, StreamTimer, build_body, send_request
from bench.loadgen import LoadConfig, RunResult, run_open_loop, run_rate
from bench.schedule import make_prompt, poisson_schedule
from bench.stats import Summary, percentile, percentiles, summarize
from frontend.sse import SSEEvent, SSEParser

__all__ = [
    "LoadConfig",
    "RequestResult",
    "RequestSpec",
    "RunResult",
    "SSEEvent",
    "SSEParser",
    "StreamTimer",
    "Summary",
    "build_body",
    "make_prompt",
    "percentile",
    "percentiles",
    "poisson_schedule",
    "run_open_loop",
    "run_rate",
    "send_request",
    "summarize",
]

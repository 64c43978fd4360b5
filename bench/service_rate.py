"""The service rate of one live backend (``headrace plan --measure URL``):
``concurrency`` closed-loop clients, each sending the next request as soon
as its last one ended, for ``duration`` seconds, with the planner's prompt
and output lengths. What a replica gives at that concurrency::

    throughput   completions per second (requests that ended within the run)
    service time mean end-to-end seconds of a request, so a stream (a slot)
    serves at 1 / service time; Little: throughput ~ concurrency / service time

The requests go through the benchmark client (bench/client.py), so they are
timed and failed exactly as ``headrace bench`` does.
"""

from __future__ import annotations

import msgspec
import trio

from backends.errors import BadRequest
from bench.client import RequestResult, RequestSpec, send_request
from bench.connect import FALLBACK_MODEL, discover, make_client
from bench.schedule import make_prompt
from bench.stats import percentile

__all__ = ["Measurement", "measure_service"]


class Measurement(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    model: str
    concurrency: int
    duration: float  # seconds the clients ran
    completed: int
    errors: int
    throughput: float  # completions per second, the replica's service rate at this concurrency
    service_time: float  # mean seconds per request (end to end)
    p50: float | None
    p99: float | None
    output_tokens: float  # mean generated per request

    @property
    def per_stream(self) -> float:
        """Completions per second one slot (stream) gives: 1 / service time."""
        return 1.0 / self.service_time


async def measure_service(
    url: str,
    *,
    prompt_tokens: int,
    output_tokens: int,
    concurrency: int = 8,
    duration: float = 20.0,
    model: str | None = None,
    api_key: str | None = None,
    http: str = "auto",
    request_timeout: float = 300.0,
) -> Measurement:
    """Run the closed loop against ``url`` and summarise it."""
    if concurrency < 1 or duration <= 0 or prompt_tokens < 1 or output_tokens < 1:
        raise BadRequest("concurrency, duration, prompt and output tokens must be positive", param="measure")
    target = await discover(url, "auto" if http == "auto" else "2" if http == "2" else "1.1", api_key)
    name = model or (target.models[0] if target.models else FALLBACK_MODEL)
    spec = RequestSpec(model=name, max_tokens=output_tokens, ignore_eos=True, timeout=request_timeout)
    results: list[RequestResult] = []
    start = trio.current_time()
    end = start + duration
    async with make_client(url, target.http, max_connections=concurrency, api_key=api_key, timeout=request_timeout) as client:

        async def loop(worker: int) -> None:
            i = 0
            while trio.current_time() < end:
                prompt = make_prompt(worker, i, prompt_tokens)
                now = trio.current_time()
                results.append(await send_request(client, spec, prompt, index=worker * 1_000_000 + i, start=now, run_start=start))
                i += 1

        async with trio.open_nursery() as nursery:
            for w in range(concurrency):
                nursery.start_soon(loop, w)
    wall = trio.current_time() - start
    ok = [r for r in results if r.ok and r.e2e is not None]
    if not ok:
        errors = sorted({r.error or "" for r in results})
        raise BadRequest(f"no request to {url} succeeded while measuring ({', '.join(errors) or 'none sent'})", param="measure")
    times = [r.e2e for r in ok if r.e2e is not None]
    return Measurement(
        url=url, model=name, concurrency=concurrency, duration=wall, completed=len(ok), errors=len(results) - len(ok),
        throughput=len(ok) / wall, service_time=sum(times) / len(times), p50=percentile(times, 50), p99=percentile(times, 99),
        output_tokens=sum(r.output_tokens for r in ok) / len(ok),
    )  # fmt: skip

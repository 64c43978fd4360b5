"""The open-loop load generator.

Requests arrive on a Poisson schedule fixed before the run and are launched
on time into a nursery whether or not earlier ones have finished: latency
under load then includes the queueing a real client population causes, which
a closed loop (wait for an answer, send the next) hides. The only brake is
``max_outstanding``; an arrival that finds that many requests in flight is not
delayed but *dropped* and counted as an error of kind ``dropped``, so an
overloaded target shows up in the error table, never as a quietly lower rate.

::

    schedule ── sleep_until(t_i) ──> outstanding < cap ? start_soon(send_i) : drop
                                            │
                               send_i ──> RequestResult (timed from t_i)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import msgspec
import trio

from backends.errors import BadRequest
from backends.h2client import H2Pool
from bench.client import RequestResult, RequestSpec, send_request
from bench.connect import make_client, make_pool
from bench.progress import ProgressBar, run_progress
from bench.schedule import make_prompt, poisson_schedule

__all__ = ["LoadConfig", "RunResult", "Sender", "run_open_loop", "run_rate"]

# send(index, prompt, planned_start, run_start) -> result; never raises for faults.
Sender = Callable[[int, str, float, float], Awaitable[RequestResult]]


class LoadConfig(msgspec.Struct, frozen=True, kw_only=True):
    rate: float  # offered requests per second
    duration: float  # seconds of arrivals
    seed: int = 0
    prompt_tokens: int = 32
    max_outstanding: int = 512


class RunResult(msgspec.Struct, kw_only=True):
    config: LoadConfig
    wall: float  # first planned start to last completion, seconds
    results: list[RequestResult]


class _State:
    def __init__(self, total: int, results: list[RequestResult]) -> None:
        self.total = total
        self.launched = 0
        self.outstanding = 0
        self.errors = 0
        self.results = results

    def record(self, result: RequestResult) -> None:
        self.results.append(result)
        self.errors += result.error is not None


def _status(state: _State, start: float, duration: float) -> Callable[[float], tuple[float, str]]:
    def status(now: float) -> tuple[float, str]:
        elapsed = now - start
        fraction = min(1.0, elapsed / duration) if state.launched < state.total else 1.0
        text = (f"{elapsed:5.1f}s sent {state.launched}/{state.total} "
                f"done {len(state.results)} in-flight {state.outstanding} err {state.errors}")
        return fraction, text
    return status


async def _one(send: Sender, state: _State, config: LoadConfig, index: int,
               planned: float, run_start: float) -> None:
    try:
        prompt = make_prompt(config.seed, index, config.prompt_tokens)
        state.record(await send(index, prompt, planned, run_start))
    finally:
        state.outstanding -= 1


async def _launch(send: Sender, state: _State, config: LoadConfig, schedule: list[float],
                  run_start: float) -> None:
    async with trio.open_nursery() as nursery:
        for index, offset in enumerate(schedule):
            planned = run_start + offset
            await trio.sleep_until(planned)
            state.launched += 1
            if state.outstanding >= config.max_outstanding:
                state.record(RequestResult(index=index, scheduled=offset, error="dropped",
                                           detail=f"{state.outstanding} requests in flight"))
                continue
            state.outstanding += 1
            nursery.start_soon(_one, send, state, config, index, planned, run_start)


async def run_open_loop(config: LoadConfig, send: Sender, *,
                        progress: ProgressBar | None = None,
                        results: list[RequestResult] | None = None) -> RunResult:
    """Offer ``config.rate`` req/s for ``config.duration`` s; wait for every answer.

    Each result is appended to ``results`` (when given) as it completes, so a
    caller interrupted mid-run (Ctrl-C) still holds what finished."""
    if config.max_outstanding < 1:
        raise BadRequest("max_outstanding must be >= 1", param="max_outstanding")
    schedule = poisson_schedule(config.rate, config.duration, config.seed)
    state = _State(len(schedule), results if results is not None else [])
    run_start = trio.current_time()
    async with trio.open_nursery() as outer:
        if progress is not None:
            outer.start_soon(run_progress, progress, _status(state, run_start, config.duration))
        await _launch(send, state, config, schedule, run_start)
        outer.cancel_scope.cancel()
    wall = trio.current_time() - run_start
    if progress is not None:
        progress.close(f"{wall:5.1f}s sent {state.launched} done {len(state.results)} "
                       f"err {state.errors}")
    state.results.sort(key=lambda r: r.index)
    return RunResult(config=config, wall=wall, results=state.results)


async def run_rate(url: str, http: str, spec: RequestSpec, config: LoadConfig, *,
                   api_key: str | None = None, label: str = "bench",
                   results: list[RequestResult] | None = None,
                   lean: bool = False) -> RunResult:
    """:func:`run_open_loop` against a real server at ``url``; ``lean`` (HTTP/2
    only): with the lean client, ~4x less client CPU a request than httpx."""
    limit = config.max_outstanding
    client: httpx.AsyncClient | H2Pool
    if lean and http == "2":
        client = make_pool(url, max_connections=8, api_key=api_key, timeout=spec.timeout)
    else:
        client = make_client(url, "2" if http == "2" else "1.1", max_connections=limit,
                             api_key=api_key, timeout=spec.timeout)
    async with client:
        async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
            return await send_request(client, spec, prompt, index=index, start=planned,
                                      run_start=run_start)

        return await run_open_loop(config, send, progress=ProgressBar(label), results=results)

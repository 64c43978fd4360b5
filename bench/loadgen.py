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

import gc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager

import httpx
import msgspec
import trio

from backends.errors import BadRequest
from backends.h2client import H2Pool
from bench.client import RequestResult, RequestSpec, send_request
from bench.connect import make_client, make_pool
from bench.progress import ProgressBar, run_progress
from bench.schedule import make_prompt, poisson_schedule

__all__ = ["LoadConfig", "RunResult", "Sender", "no_full_collections", "run_open_loop", "run_rate"]

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


# The oldest generation's threshold while a run is timed: never reached.
_NEVER = 1 << 30
_timed_runs = 0  # runs under no_full_collections now (they may overlap)
_oldest = 0  # the oldest generation's threshold before the first of them


@contextmanager
def no_full_collections() -> Iterator[None]:
    """No full cyclic collection in this process while a run is timed.

    A full collection walks every tracked object of the load generator (its
    imports, its pools, the results so far) and stops its event loop: 11-13 ms
    once every run or so at 700 req/s with the lean client. The arrivals
    planned during the pause go out together when it ends, late (their lag
    counts, as it must), and as a burst: a target that serves a request in a
    millisecond then queues the thirty that follow (10 s runs through the
    router at 700 req/s: the slowest 1% of a run came in two or three
    clusters, one of them the 30 ms after the client's full collection,
    with up to 30 of the 70 requests). So: collect once before the run, and
    let only the young generations be collected during it (what a request
    leaves in a cycle dies young: the httpx client leaves ~40 objects a
    request, the lean client none); the oldest generation's threshold comes
    back after the run."""
    global _timed_runs, _oldest
    if _timed_runs == 0:
        gc.collect()
        young, middle, _oldest = gc.get_threshold()
        gc.set_threshold(young, middle, _NEVER)
    _timed_runs += 1
    try:
        yield
    finally:
        _timed_runs -= 1
        if _timed_runs == 0:
            young, middle, _ = gc.get_threshold()
            gc.set_threshold(young, middle, _oldest)


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
    with no_full_collections():
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
                   lean: bool = False, connections: int = 1) -> RunResult:
    """:func:`run_open_loop` against a real server at ``url``; ``lean`` (HTTP/2
    only): with the lean client, ~4x less client CPU a request than httpx,
    its requests taken in turn by ``connections`` connections (one multiplexes
    them all, so that a server with several worker processes on one port sees
    them all in one worker: a population of clients comes on many)."""
    if connections < 1 or (connections > 1 and not (lean and http == "2")):
        raise BadRequest("connections must be >= 1, and more than one only for the lean HTTP/2 client",
                         param="connections")
    limit = config.max_outstanding
    clients: list[httpx.AsyncClient | H2Pool]
    if lean and http == "2":
        clients = [make_pool(url, max_connections=8, api_key=api_key, timeout=spec.timeout)
                   for _ in range(connections)]
    else:
        clients = [make_client(url, "2" if http == "2" else "1.1", max_connections=limit,
                               api_key=api_key, timeout=spec.timeout)]
    async with AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)

        async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
            return await send_request(clients[index % len(clients)], spec, prompt, index=index,
                                      start=planned, run_start=run_start)

        return await run_open_loop(config, send, progress=ProgressBar(label), results=results)

"""The open loop launches on schedule whatever the target does (fake time)."""

from __future__ import annotations

import gc

import pytest
import trio

from bench.client import RequestResult
from bench.loadgen import LoadConfig, run_open_loop
from bench.schedule import poisson_schedule


def _slow_sender(service: float, launched: list[float]):  # type: ignore[no-untyped-def]
    async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        launched.append(trio.current_time() - run_start)
        await trio.sleep(service)
        return RequestResult(index=index, scheduled=planned - run_start,
                             e2e=trio.current_time() - planned, output_tokens=1)
    return send


async def test_arrivals_launch_on_schedule_even_when_no_answer_has_come_back(
        autojump_clock: trio.testing.MockClock) -> None:
    config = LoadConfig(rate=20.0, duration=2.0, seed=4)
    launched: list[float] = []
    run = await run_open_loop(config, _slow_sender(100.0, launched))
    schedule = poisson_schedule(20.0, 2.0, seed=4)
    assert launched == pytest.approx(schedule)  # a closed loop would have sent one
    assert len(run.results) == len(schedule) and all(r.ok for r in run.results)
    assert [r.index for r in run.results] == list(range(len(schedule)))
    assert run.wall == pytest.approx(schedule[-1] + 100.0)


async def test_arrivals_beyond_the_outstanding_cap_are_dropped_and_counted(
        autojump_clock: trio.testing.MockClock) -> None:
    config = LoadConfig(rate=50.0, duration=1.0, seed=1, max_outstanding=5)
    launched: list[float] = []
    run = await run_open_loop(config, _slow_sender(10.0, launched))
    n = len(poisson_schedule(50.0, 1.0, seed=1))
    dropped = [r for r in run.results if r.error == "dropped"]
    assert len(launched) == 5 and len(dropped) == n - 5
    assert len(run.results) == n


async def test_latency_counts_from_the_planned_time_so_queueing_shows(
        autojump_clock: trio.testing.MockClock) -> None:
    limiter = trio.CapacityLimiter(1)  # a target that serves one request at a time

    async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        async with limiter:
            await trio.sleep(0.5)
        return RequestResult(index=index, scheduled=planned - run_start,
                             e2e=trio.current_time() - planned)

    run = await run_open_loop(LoadConfig(rate=10.0, duration=1.0, seed=2), send)
    e2e = [r.e2e for r in run.results if r.e2e is not None]
    assert len(e2e) == len(run.results)
    assert e2e[0] == pytest.approx(0.5)
    assert max(e2e) > 0.5 * len(e2e) - 1.0  # the last waited behind all the others


@pytest.fixture
def gc_threshold():  # type: ignore[no-untyped-def]
    """A known threshold to compare with (a run that failed to restore it
    would leave the next test comparing with its own leftover)."""
    saved = gc.get_threshold()
    gc.set_threshold(500, 7, 9)
    yield (500, 7, 9)
    gc.set_threshold(*saved)


async def test_no_full_collection_while_a_run_is_timed_and_the_threshold_comes_back(
        autojump_clock: trio.testing.MockClock, gc_threshold: tuple[int, int, int]) -> None:
    seen: list[tuple[int, int, int]] = []

    async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        seen.append(gc.get_threshold())
        await trio.sleep(0.1)
        return RequestResult(index=index, scheduled=planned - run_start, e2e=0.1)

    await run_open_loop(LoadConfig(rate=20.0, duration=1.0, seed=3), send)
    assert seen and all(t == (500, 7, 1 << 30) for t in seen)
    assert gc.get_threshold() == gc_threshold

    async def fail(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        raise RuntimeError("a sender bug")

    with pytest.raises(BaseExceptionGroup) as info:
        await run_open_loop(LoadConfig(rate=20.0, duration=1.0, seed=3), fail)
    assert info.group_contains(RuntimeError, match="a sender bug")
    assert gc.get_threshold() == gc_threshold  # and after a run that failed


def test_overlapping_timed_runs_restore_the_threshold_only_when_the_last_ends(
        gc_threshold: tuple[int, int, int]) -> None:
    from bench.loadgen import no_full_collections

    first, second = no_full_collections(), no_full_collections()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not nested: the first ends first
    assert gc.get_threshold() == (500, 7, 1 << 30)
    second.__exit__(None, None, None)
    assert gc.get_threshold() == gc_threshold

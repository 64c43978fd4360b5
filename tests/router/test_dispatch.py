"""The dispatcher routes through the policy, retries before the first token,
refuses with 503 when nothing is eligible, and records timings."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from functools import partial

import pytest
import trio
import trio.testing

from backends.base import Event, GenerateRequest, Usage
from backends.errors import BackendProtocolError, BackendUnavailable, BadRequest, StreamBroken
from policies.routing import LeastLoaded, RoundRobin
from router.actors import BackendActor, closing_stream
from router.dispatch import Dispatcher, route_request
from router.migration import Settings as MigrationSettings
from tests.router.fakes import FakeBackend


class ListRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []
        self.prefixes: list[tuple[str, str]] = []  # each resume gap's (backend, prefix label)

    def queue_time(self, backend: str, seconds: float) -> None:
        self.calls.append(("queue", backend, seconds))

    def time_to_first_token(self, backend: str, seconds: float) -> None:
        self.calls.append(("ttft", backend, seconds))

    def inter_token_latencies(self, backend: str, seconds: Sequence[float]) -> None:
        self.calls.extend(("itl", backend, s) for s in seconds)

    def resume_gap(self, backend: str, seconds: float, prefix: str) -> None:
        self.calls.append(("resume", backend, seconds))
        self.prefixes.append((backend, prefix))


async def actors_for(*fakes: FakeBackend) -> list[BackendActor]:
    actors = [BackendActor(f.name, f) for f in fakes]
    for a in actors:
        await a.probe()
    return actors


async def collect(d: Dispatcher, **kw: object) -> list[Event]:
    return [e async for e in d.stream(GenerateRequest(**kw))]  # type: ignore[arg-type]


async def test_round_robin_spreads_requests_over_backends() -> None:
    a, b = FakeBackend("a"), FakeBackend("b")
    d = Dispatcher(await actors_for(a, b), RoundRobin())
    for _ in range(4):
        events = await collect(d, max_tokens=2)
        assert [e.text for e in events] == [" t0", " t1"]
    assert (a.started, b.started) == (2, 2)


async def test_failure_before_first_token_is_retried_on_another_backend() -> None:
    bad = FakeBackend("a", fail_before=BackendUnavailable("refused"))
    good = FakeBackend("b")
    d = Dispatcher(await actors_for(bad, good), RoundRobin())
    events = await collect(d, max_tokens=3)
    assert "".join(e.text for e in events) == " t0 t1 t2"
    assert (bad.started, good.started) == (1, 1)
    assert d.statistics().retries == 1


async def test_attempts_are_bounded_and_the_last_error_is_raised() -> None:
    fakes = [FakeBackend(n, fail_before=BackendProtocolError(f"{n} garbled")) for n in "abc"]
    d = Dispatcher(await actors_for(*fakes), RoundRobin(), max_attempts=2)
    with pytest.raises(BackendProtocolError, match="b garbled"):
        await collect(d)
    assert [f.started for f in fakes] == [1, 1, 0]


async def test_client_errors_are_not_retried() -> None:
    a, b = FakeBackend("a", fail_before=BadRequest("bad prompt")), FakeBackend("b")
    d = Dispatcher(await actors_for(a, b), RoundRobin())
    with pytest.raises(BadRequest):
        await collect(d)
    assert b.started == 0


async def test_failure_after_first_token_migrates_to_another_backend() -> None:
    a, b = FakeBackend("a", break_after=2), FakeBackend("b")
    d = Dispatcher(await actors_for(a, b), RoundRobin())
    events = [e async for e in d.stream(GenerateRequest(max_tokens=5))]
    assert [t for e in events for t in e.token_ids] == [0, 1, 2, 3, 4]
    assert "".join(e.text for e in events) == " t0 t1 t2 t3 t4"
    assert b.started == 1 and events[-1].finish_reason == "length"
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 5
    assert events[-1].usage.prompt_tokens == 3  # the original prompt, once
    assert d.statistics().migration.migrations == {"broken:resumed": 1}


async def test_with_migration_off_a_failure_after_first_token_is_passed_on() -> None:
    a, b = FakeBackend("a", break_after=2), FakeBackend("b")
    d = Dispatcher(await actors_for(a, b), RoundRobin(), migration=MigrationSettings(enabled=False))
    got = []
    with pytest.raises(StreamBroken):
        async for event in d.stream(GenerateRequest(max_tokens=5)):
            got += event.token_ids
    assert got == [0, 1] and b.started == 0


async def test_no_eligible_backend_is_unavailable_with_retry_after() -> None:
    a = FakeBackend("a", models=("m",))
    actors = await actors_for(a)
    d = Dispatcher(actors, RoundRobin(), retry_after=3.0)
    with pytest.raises(BackendUnavailable) as info:
        await collect(d, model="other")
    assert info.value.retry_after == 3.0 and info.value.status == 503
    actors[0].drain()
    with pytest.raises(BackendUnavailable):
        await collect(d, model="m")
    assert not d.ready()
    assert d.statistics().unavailable == 2


async def test_draining_backend_gets_no_new_requests() -> None:
    a, b = FakeBackend("a"), FakeBackend("b")
    actors = await actors_for(a, b)
    d = Dispatcher(actors, RoundRobin())
    actors[0].drain()
    for _ in range(3):
        await collect(d)
    assert (a.started, b.started) == (0, 3)


async def test_model_routes_only_to_backends_serving_it_and_info_is_the_union() -> None:
    a, b = FakeBackend("a", models=("x",)), FakeBackend("b", models=("y", "x"))
    d = Dispatcher(await actors_for(a, b), RoundRobin())
    for _ in range(3):
        await collect(d, model="y")
    assert (a.started, b.started) == (0, 3)
    assert d.info().models == ("x", "y")


async def test_least_loaded_sends_new_requests_to_the_idle_backend() -> None:
    a, b = FakeBackend("a", delay=1.0), FakeBackend("b", delay=1.0)
    d = Dispatcher(await actors_for(a, b), LeastLoaded())
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(collect, d)
            await trio.testing.wait_all_tasks_blocked()
        assert (a.in_flight, b.in_flight) == (2, 2)
        nursery.cancel_scope.cancel()


async def test_timings_are_recorded_per_backend(autojump_clock: trio.testing.MockClock) -> None:
    rec = ListRecorder()
    d = Dispatcher(await actors_for(FakeBackend("a", delay=0.25)), RoundRobin(), recorder=rec)
    await collect(d, max_tokens=3)
    assert rec.calls == [("queue", "a", 0.0), ("ttft", "a", 0.25), ("itl", "a", 0.25), ("itl", "a", 0.25)]


async def test_a_long_streams_gaps_are_recorded_a_batch_at_a_time_while_it_runs_and_the_rest_when_it_ends() -> None:
    """Observed GAP_BATCH at a time, not per token (per-token histogram
    updates were ~4% of the router's CPU), and never more than that late;
    the stall watch gets the same gaps; a broken attempt's gaps count too."""
    from frontend.sli import GAP_BATCH

    rec = ListRecorder()
    d = Dispatcher(await actors_for(FakeBackend("a")), RoundRobin(), recorder=rec)
    tokens = 2 * GAP_BATCH + 5
    itl = lambda: [c for c in rec.calls if c[0] == "itl"]  # noqa: E731
    seen: list[int] = []
    async with closing_stream(d.stream(GenerateRequest(max_tokens=tokens))) as events:
        async for _ in events:
            seen.append(len(itl()))
    assert len(itl()) == tokens - 1  # every gap, once: between the tokens
    # while it ran: at most GAP_BATCH gaps behind the client (the k-th event has k-1 gaps before it)
    assert all(0 <= k - 1 - n < GAP_BATCH for k, n in enumerate(seen, start=1)), seen
    assert seen[GAP_BATCH] == GAP_BATCH  # a batch observed before the stream ended
    assert len(d.stall._gaps["a"]) == tokens - 1

    broken = ListRecorder()
    d = Dispatcher(await actors_for(FakeBackend("b", break_after=5)), RoundRobin(), recorder=broken,
                   migration=MigrationSettings(enabled=False))
    with pytest.raises(StreamBroken):
        await collect(d, max_tokens=20)
    assert [c[:2] for c in broken.calls if c[0] == "itl"] == [("itl", "b")] * 4  # 5 events, 4 gaps


def test_route_request_carries_what_policies_may_use() -> None:
    r = route_request(GenerateRequest(request_id="r1", model="m", prompt="x" * 1000, tenant="t", priority=2))
    assert (r.request_id, r.model, r.tenant, r.priority, len(r.prefix)) == ("r1", "m", "t", 2, 256)
    r = route_request(GenerateRequest(prompt_token_ids=[5, 6]))
    assert r.prompt_token_ids == (5, 6)


async def test_requests_with_one_affinity_key_stay_on_one_backend_while_its_load_is_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Round robin would spread a batch's items; with the batch id as their
    affinity key they go where the first went, until that backend holds more
    than 1.25 x the mean in flight (+1), then overflow to the policy's pick."""
    a, b, c = FakeBackend("a", delay=1.0), FakeBackend("b", delay=1.0), FakeBackend("c", delay=1.0)
    d = Dispatcher(await actors_for(a, b, c), RoundRobin())
    for _ in range(4):  # one at a time: the home is never loaded
        await collect(d, model="m", affinity="batch-1")
    home = next(f for f in (a, b, c) if f.started)
    assert home.started == 4 and sum(f.started for f in (a, b, c)) == 4
    await collect(d, model="m")  # no key: the policy's turn as usual
    await collect(d, model="m", affinity="batch-2")  # a new key: a home of its own, by the policy
    assert sum(f.started for f in (a, b, c)) == 6
    # 12 at once with one key: the home takes its bounded share, the rest
    # overflow to the policy's picks, and the home stays the key's.
    before = {f.name: f.started for f in (a, b, c)}
    async with trio.open_nursery() as nursery:
        for _ in range(12):
            nursery.start_soon(partial(collect, d, model="m", affinity="batch-3"))
            await trio.sleep(0.01)
    got = {f.name: f.started - before[f.name] for f in (a, b, c)}
    home3 = d._affinity["batch-3"]
    assert sum(got.values()) == 12 and got[home3] == max(got.values()) and 5 <= got[home3] < 12, got
    await collect(d, model="m", affinity="batch-3")
    assert d._affinity["batch-3"] == home3


async def test_the_model_list_is_cached_until_a_backends_info_changes() -> None:
    """info() is asked on every request (the model check): the same object
    while nothing changed, a new one once a probe's refresh replaced a
    backend's info."""
    from backends.base import BackendInfo

    d = Dispatcher(await actors_for(FakeBackend("a", models=("x",)), FakeBackend("b", models=("y",))), RoundRobin())
    first = d.info()
    assert first.models == ("x", "y") and d.info() is first
    actor = d.actors["b"]
    assert actor.info is not None
    actor.info = BackendInfo(name="b", models=("y", "z"), token_ids=actor.info.token_ids)  # what _refresh_info does
    assert d.info().models == ("x", "y", "z")


class _Reads(FakeBackend):
    """Tokens in upstream reads 10 ms apart, 3 a read: each read's events but
    its last marked ``more_ready``, as the HTTP adapter marks them."""

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        n = request.max_tokens or 6
        for i in range(n):
            if i % 3 == 0:
                await trio.sleep(0.010)
            last = i == n - 1
            yield Event(token_ids=[i], text=f" t{i}", more_ready=i % 3 != 2 and not last,
                        finish_reason="length" if last else None, usage=Usage(3, n) if last else None)


async def test_the_events_of_one_read_are_timed_by_one_clock_read(autojump_clock: trio.testing.MockClock) -> None:
    """The gaps inside one upstream read are 0 (one clock read for the
    read's events); between reads, the backend's own 10 ms."""
    reads = 0

    def clock() -> float:  # 1 us later at each read, as a real clock moves
        nonlocal reads
        reads += 1
        return trio.current_time() + reads * 1e-6

    recorder = ListRecorder()
    d = Dispatcher(await actors_for(_Reads("a")), RoundRobin(), recorder=recorder, clock=clock)
    events = await collect(d, prompt="x", max_tokens=6)
    assert len(events) == 6
    gaps = [round(s, 4) for kind, _, s in recorder.calls if kind == "itl"]
    assert gaps == [0.0, 0.0, 0.010, 0.0, 0.0]
    assert [s for kind, _, s in recorder.calls if kind == "itl"][:2] == [0.0, 0.0]  # not 1 us: one reading

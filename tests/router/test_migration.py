"""Stream migration in the dispatcher, in-process: a stream that breaks after
its first token continues on another backend, and the client's events are
exactly the uninterrupted run's (the deterministic mock is the reference);
the limit, no backend left and a replay that diverges end the answer with
:class:`MigrationFailed`, never a truncated success; the stall watchdog
(under trio's MockClock) migrates a frozen stream. Through real HTTP: see
test_migration_http.py."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import hypothesis.strategies as st
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings

from backends.base import BackendInfo, Event, GenerateRequest, Usage
from backends.errors import (
    BackendProtocolError,
    BackendUnavailable,
    HeadraceError,
    MigrationFailed,
    StreamBroken,
)
from backends.fakes import FlakyBackend, StallingBackend, WrappedBackend
from backends.mock import MockBackend, MockConfig
from policies.routing import RoundRobin
from router.actors import BackendActor
from router.dispatch import Dispatcher
from router.migration import Progress, Replay, Settings, StallWatch, prefix_label, resume_request
from tests.router.fakes import FakeBackend
from tests.router.test_breakers import Prefer
from tests.router.test_dispatch import ListRecorder, actors_for


def mock(**kw: Any) -> MockBackend:
    return MockBackend(MockConfig(**kw))


async def actors(*backends: Any, names: Sequence[str] | None = None) -> list[BackendActor]:
    out = [BackendActor(n, b) for n, b in zip(names or "abcdefgh", backends, strict=False)]
    for a in out:
        await a.probe()
    return out


async def run(d: Dispatcher, request: GenerateRequest) -> list[Event]:
    return [e async for e in d.stream(request)]


async def reference(request: GenerateRequest, **kw: Any) -> list[Event]:
    return [e async for e in mock(**kw).stream(request)]


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events)


def ids(events: list[Event]) -> list[int]:
    return [t for e in events for t in e.token_ids]


REQUEST = GenerateRequest(prompt="the river runs", max_tokens=12, seed=7)


@pytest.mark.parametrize("k", [1, 5, 11])
async def test_a_stream_broken_after_k_tokens_is_resumed_exactly(k: int) -> None:
    want = await reference(REQUEST)
    broken = FlakyBackend(mock(), fail_first=1, after_events=k)
    d = Dispatcher(await actors(broken, mock()), Prefer("a", "b"))
    got = await run(d, REQUEST)
    assert text(got) == text(want) and ids(got) == ids(want)
    assert got[-1].finish_reason == want[-1].finish_reason == "length"
    assert got[-1].usage == want[-1].usage  # the original prompt once, every token once
    assert sum(e.prompt_token_ids is not None for e in got) == 1  # said once, on the first event
    assert d.statistics().migration.migrations == {"broken:resumed": 1}


@pytest.mark.parametrize("warm", [True, False])
async def test_the_resume_gap_is_labelled_by_what_the_new_backend_held(warm: bool) -> None:
    """``prefix``: held when the backend that continued served >= 90% of the
    original prompt from its cache (its usage says so), missed when not."""
    request = GenerateRequest(prompt="a long shared system prompt, " * 12, max_tokens=8, seed=3)
    cache = {"block_size": 16, "cache_blocks": 256, "max_context": 4096}
    good = mock(**cache)
    if warm:  # it has served this prompt before
        await reference_on(good, request)
    recorder = ListRecorder()
    d = Dispatcher(await actors(FlakyBackend(mock(**cache), fail_first=1, after_events=3), good),
                   Prefer("a", "b"), recorder=recorder)
    await run(d, request)
    assert recorder.prefixes == [("b", "held" if warm else "missed")]
    assert prefix_label(None, 100) == "unknown" and prefix_label(90, 100) == "held" and prefix_label(89, 100) == "missed"


async def reference_on(backend: MockBackend, request: GenerateRequest) -> list[Event]:
    return [e async for e in backend.stream(request)]


async def test_a_seedless_request_resumes_with_the_seed_the_first_backend_drew() -> None:
    request = GenerateRequest(prompt="quiet towns", max_tokens=10, temperature=1.0)
    broken = FlakyBackend(mock(), fail_first=1, after_events=4)
    d = Dispatcher(await actors(broken, mock()), Prefer("a", "b"))
    got = await run(d, request)
    seed = got[0].seed
    assert seed is not None
    want = await reference(msgspec_replace(request, seed=seed))
    assert text(got) == text(want)


def msgspec_replace(request: GenerateRequest, **kw: Any) -> GenerateRequest:
    import msgspec

    return msgspec.structs.replace(request, **kw)


async def test_each_break_migrates_again_up_to_the_limit_then_the_terminal_error() -> None:
    # Every backend breaks after 2 more tokens: 1 + 3 migrations, then the error.
    flaky = [FlakyBackend(mock(), fail_every=1, after_events=2) for _ in range(6)]
    d = Dispatcher(await actors(*flaky), RoundRobin(), migration=Settings(max_migrations=3))
    got: list[Event] = []
    with pytest.raises(MigrationFailed) as info:
        async for event in d.stream(REQUEST):
            got.append(event)
    assert info.value.code == "migration_limit" and info.value.status == 502
    assert sum(f.requests for f in flaky) == 4  # the first attempt and three migrations
    want = await reference(REQUEST)
    assert text(want).startswith(text(got)) and len(ids(got)) == 8  # exact as far as it went
    assert all(e.finish_reason is None for e in got)  # never a normal end
    stats = d.statistics()
    # Each break is counted once: three were resumed, the fourth was not.
    assert stats.migration.migrations == {"broken:resumed": 3, "broken:failed": 1}
    assert stats.failed == 1


async def test_with_no_other_backend_the_client_gets_a_503_migration_error() -> None:
    d = Dispatcher(await actors(FlakyBackend(mock(), fail_first=1, after_events=3)), RoundRobin())
    with pytest.raises(MigrationFailed) as info:
        await run(d, REQUEST)
    assert info.value.code == "no_backend_to_resume" and info.value.status == 503
    assert info.value.retry_after is not None


async def test_a_stream_that_ends_without_its_final_event_is_resumed() -> None:
    class NoFinal(WrappedBackend):
        async def _stream(self, number: int, request: GenerateRequest) -> AsyncIterator[Event]:  # type: ignore[override]
            async for event in self.inner.stream(request):
                if event.finish_reason is not None:
                    return  # ends cleanly, but without the final event
                yield event

    want = await reference(REQUEST)
    d = Dispatcher(await actors(NoFinal(mock()), mock()), Prefer("a", "b"))
    got = await run(d, REQUEST)
    # The final event's token was never relayed: the resume regenerates it.
    assert text(got) == text(want) and got[-1].usage == want[-1].usage
    assert d.statistics().migration.migrations == {"no_final:resumed": 1}


async def test_a_malformed_chunk_mid_stream_is_a_protocol_migration() -> None:
    broken = FlakyBackend(mock(), fail_first=1, after_events=3, error=BackendProtocolError)
    d = Dispatcher(await actors(broken, mock()), Prefer("a", "b"))
    assert text(await run(d, REQUEST)) == text(await reference(REQUEST))
    assert d.statistics().migration.migrations == {"protocol:resumed": 1}


async def test_a_frozen_stream_trips_the_watchdog_and_completes(autojump_clock: trio.testing.MockClock) -> None:
    frozen = StallingBackend(mock(), after_events=4, stall_first=1, stall_every=0)
    d = Dispatcher(await actors(frozen, mock()), Prefer("a", "b"), migration=Settings(stall_timeout=2.0))
    start = trio.current_time()
    got = await run(d, REQUEST)
    assert text(got) == text(await reference(REQUEST))
    assert 2.0 <= trio.current_time() - start < 3.0  # the watchdog's 2 s, not a backend's minute
    assert frozen.stalled == 0  # the frozen stream was cancelled
    assert d.statistics().migration.migrations == {"stall:resumed": 1}


async def test_the_default_watchdog_uses_the_backends_measured_latency(autojump_clock: trio.testing.MockClock) -> None:
    s = Settings(stall_samples=8)
    watch = StallWatch(s, every=4)
    assert watch.timeout("a") == s.stall_initial  # nothing measured yet
    for _ in range(16):
        watch.add("a", 0.2)
    assert watch.timeout("a") == pytest.approx(max(2 * 0.2, s.stall_floor))
    for _ in range(16):
        watch.add("a", 3.0)
    assert watch.timeout("a") == pytest.approx(6.0)
    assert watch.timeout("b") == s.stall_initial
    assert watch.timeout("a", Settings(stall_timeout=0.5)) == 0.5  # a fixed timeout wins


def test_the_measured_watchdog_starts_at_stall_samples_however_rarely_the_p99_is_recomputed() -> None:
    s = Settings(stall_samples=8)
    watch = StallWatch(s, every=1000)
    watch.extend("a", [0.2] * 7)
    assert watch.timeout("a") == s.stall_initial  # under stall_samples
    watch.extend("a", [0.9])
    assert watch.timeout("a") == pytest.approx(max(2 * 0.9, s.stall_floor))  # the 8th sample: measured at once
    watch.extend("a", [5.0] * 100)
    assert watch.timeout("a") == pytest.approx(max(2 * 0.9, s.stall_floor))  # then only every 1000


async def test_a_per_model_stall_timeout_overrides_the_routers() -> None:
    from router.config import decode_config
    from router.routes import RouteTable

    config = decode_config({"models": [{"name": "m", "stall_timeout": 0.25, "max_migrations": 1}], "migration": {"max_migrations": 5}})
    table = RouteTable(config.models, RoundRobin(), migration=Settings(max_migrations=5))
    target = table.plan(GenerateRequest(model="m")).targets[0]
    assert target.migration is not None
    assert (target.migration.stall_timeout, target.migration.max_migrations) == (0.25, 1)


class NoIds(WrappedBackend):
    """A backend that reports no token ids (an ordinary OpenAI server)."""

    def info(self) -> BackendInfo:
        import msgspec

        return msgspec.structs.replace(self.inner.info(), token_ids=False, exact_resume=False)

    async def _stream(self, number: int, request: GenerateRequest) -> AsyncIterator[Event]:  # type: ignore[override]
        assert request.resumed_tokens == 0 and request.prompt_token_ids is None  # replayed, never resumed by ids
        async for event in self.inner.stream(request):
            yield Event(text=event.text, finish_reason=event.finish_reason, usage=event.usage, seed=event.seed)


async def test_without_token_ids_the_original_request_is_replayed_and_verified() -> None:
    want = await reference(REQUEST)
    broken = FlakyBackend(NoIds(mock()), fail_first=1, after_events=5)
    d = Dispatcher(await actors(broken, NoIds(mock())), Prefer("a", "b"))
    got = await run(d, REQUEST)
    assert text(got) == text(want)
    assert d.statistics().migration.migrations == {"broken:replayed": 1}


async def test_a_replay_that_differs_ends_with_replay_diverged() -> None:
    class Different(NoIds):
        async def _stream(self, number: int, request: GenerateRequest) -> AsyncIterator[Event]:  # type: ignore[override]
            other = msgspec_replace(request, seed=(request.seed or 0) + 1)
            async for event in self.inner.stream(other):
                yield Event(text=event.text, finish_reason=event.finish_reason, usage=event.usage)

    broken = FlakyBackend(NoIds(mock()), fail_first=1, after_events=5)
    d = Dispatcher(await actors(broken, Different(mock())), Prefer("a", "b"))
    got: list[Event] = []
    with pytest.raises(MigrationFailed) as info:
        async for event in d.stream(REQUEST):
            got.append(event)
    assert info.value.code == "replay_diverged"
    assert len(got) == 5 and all(e.finish_reason is None for e in got)
    stats = d.statistics().migration
    assert stats.divergences == 1 and stats.migrations == {"broken:failed": 1}


async def test_the_resumed_request_follows_the_resume_contract() -> None:
    seen: list[GenerateRequest] = []

    class Spy(WrappedBackend):
        async def _stream(self, number: int, request: GenerateRequest) -> AsyncIterator[Event]:  # type: ignore[override]
            seen.append(request)
            async for event in self.inner.stream(request):
                yield event

    request = GenerateRequest(messages=None, prompt="a stone bridge", max_tokens=9, min_tokens=6, seed=3, stop=["zzz"])
    d = Dispatcher(await actors(FlakyBackend(mock(), fail_first=1, after_events=4), Spy(mock())), Prefer("a", "b"))
    got = await run(d, request)
    (resumed,) = seen
    prompt = got[0].prompt_token_ids
    assert prompt is not None
    assert resumed.prompt_token_ids == prompt + ids(got)[:4]
    assert (resumed.resumed_tokens, resumed.max_tokens, resumed.min_tokens) == (4, 5, 2)
    assert (resumed.seed, resumed.stop, resumed.prompt, resumed.messages) == (3, ["zzz"], None, None)


async def test_an_unexpected_client_error_on_resume_tries_the_next_backend() -> None:
    from backends.errors import BadRequest

    refuses = FakeBackend("b", fail_before=BadRequest("resumed_tokens: not supported"))
    d = Dispatcher(await actors_for(FakeBackend("a", break_after=2), refuses, FakeBackend("c")), Prefer("a", "b", "c"))
    events = await run(d, GenerateRequest(max_tokens=5))
    assert ids(events) == [0, 1, 2, 3, 4] and refuses.started == 1


# ---------------------------------------------------------------- Replay, unit


@settings(max_examples=200, deadline=None)
@given(
    full=st.text(alphabet="ab é", min_size=1, max_size=40),
    cut=st.integers(min_value=0, max_value=40),
    pieces=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=40),
)
def test_replay_relays_exactly_what_the_client_lacks(full: str, cut: int, pieces: list[int]) -> None:
    sent = full[: min(cut, len(full))]
    progress = Progress()
    progress.add(Event(text=sent))
    replay = Replay(progress)
    out, i = [], 0
    chunks = []
    for n in pieces:
        if i >= len(full):
            break
        chunks.append(full[i : i + n])
        i += n
    if i < len(full):
        chunks.append(full[i:])
    for j, chunk in enumerate(chunks):
        last = j == len(chunks) - 1
        event = replay.feed(Event(text=chunk, finish_reason="stop" if last else None, usage=Usage(1, 1) if last else None))
        if event is not None:
            out.append(event)
    assert sent + "".join(e.text for e in out) == full
    assert out and out[-1].finish_reason == "stop"


@settings(max_examples=100, deadline=None)
@given(full=st.text(alphabet="abc", min_size=2, max_size=30), data=st.data())
def test_replay_raises_on_any_difference(full: str, data: st.DataObject) -> None:
    cut = data.draw(st.integers(min_value=1, max_value=len(full)))
    sent = full[:cut]
    at = data.draw(st.integers(min_value=0, max_value=cut - 1))
    other = sent[:at] + ("x" if sent[at] != "x" else "y") + full[at + 1 :]
    progress = Progress()
    progress.add(Event(text=sent))
    replay = Replay(progress)
    with pytest.raises(MigrationFailed):
        for ch in other:
            replay.feed(Event(text=ch))
        replay.feed(Event(text="", finish_reason="stop"))


def test_replay_checks_token_ids_when_both_runs_have_them() -> None:
    progress = Progress()
    progress.add(Event(token_ids=[5, 6], text="ab"))
    replay = Replay(progress)
    with pytest.raises(MigrationFailed):
        replay.feed(Event(token_ids=[5, 7], text="ab"))
    replay = Replay(progress)
    assert replay.feed(Event(token_ids=[5, 6], text="ab")) is None
    event = replay.feed(Event(token_ids=[8], text="c", finish_reason="length"))
    assert event is not None and event.token_ids == [8] and event.text == "c"


def test_resume_request_reduces_the_limits_and_keeps_the_seed() -> None:
    progress = Progress()
    progress.add(Event(token_ids=[9, 9, 9], text="x", prompt_token_ids=[1, 2], seed=42))
    r = resume_request(GenerateRequest(prompt="p", max_tokens=10, min_tokens=2), progress)
    assert (r.prompt_token_ids, r.resumed_tokens, r.max_tokens, r.min_tokens, r.seed, r.prompt) == ([1, 2, 9, 9, 9], 3, 7, 0, 42, None)
    assert r.priority == 1  # one step ahead of new requests of its class


async def test_a_client_that_leaves_mid_migration_cancels_the_continuation() -> None:
    slow = FlakyBackend(mock(tpot_s=10.0), fail_every=0)  # never fails: a slow continuation
    d = Dispatcher(await actors(FlakyBackend(mock(), fail_first=1, after_events=2), slow), Prefer("a", "b"))
    with trio.move_on_after(0.5):
        await run(d, REQUEST)
    await trio.lowlevel.checkpoint()
    assert slow.in_flight == 0  # the continuation was cancelled with the client


async def test_a_first_token_limit_moves_a_silent_backend_on_before_any_token(autojump_clock: trio.testing.MockClock) -> None:
    silent = StallingBackend(mock(), after_events=0, stall_first=1, stall_every=0)
    d = Dispatcher(await actors(silent, mock()), Prefer("a", "b"), migration=Settings(first_token_timeout=3.0))
    start = trio.current_time()
    got = await run(d, REQUEST)
    assert text(got) == text(await reference(REQUEST))
    assert 3.0 <= trio.current_time() - start < 4.0
    stats = d.statistics()
    assert stats.retries == 1 and stats.migration.migrations == {}  # a retry, not a migration


async def test_text_continuation_is_opt_in_for_completions_and_counted_inexact() -> None:
    """Without token ids and with replay off: off by default, the terminal error;
    opted in, the completion continues from prompt + the text sent."""
    request = GenerateRequest(prompt="the river runs", max_tokens=12, seed=7)
    seen: list[GenerateRequest] = []

    class Spy(NoIds):
        async def _stream(self, number: int, request: GenerateRequest) -> AsyncIterator[Event]:  # type: ignore[override]
            seen.append(request)
            async for event in super()._stream(number, request):
                yield event

    off = Dispatcher(await actors(FlakyBackend(NoIds(mock()), fail_first=1, after_events=4), Spy(mock())), Prefer("a", "b"),
                     migration=Settings(replay=False))  # fmt: skip
    with pytest.raises(MigrationFailed) as info:
        await run(off, request)
    assert info.value.code == "no_backend_to_resume" and not seen
    on = Dispatcher(await actors(FlakyBackend(NoIds(mock()), fail_first=1, after_events=4), Spy(mock())), Prefer("a", "b"),
                    migration=Settings(replay=False, text_continuation=True))  # fmt: skip
    got = await run(on, request)
    (continued,) = seen
    sent = text(got[:4])
    assert continued.prompt == "the river runs" + sent and continued.max_tokens == 8 and continued.seed == 7
    assert text(got).startswith(sent) and got[-1].finish_reason is not None
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 12  # 4 sent + 8 continued
    stats = on.statistics().migration
    assert stats.migrations == {"broken:continued": 1} and stats.inexact == 1


async def test_a_diverged_replay_falls_back_to_text_continuation_when_opted_in() -> None:
    class Different(NoIds):
        async def _stream(self, number: int, request: GenerateRequest) -> AsyncIterator[Event]:  # type: ignore[override]
            other = msgspec_replace(request, seed=(request.seed or 0) + 1)
            async for event in self.inner.stream(other):
                yield Event(text=event.text, finish_reason=event.finish_reason, usage=event.usage)

    d = Dispatcher(await actors(FlakyBackend(NoIds(mock()), fail_first=1, after_events=5), Different(mock())), Prefer("a", "b"),
                   migration=Settings(text_continuation=True))  # fmt: skip
    got = await run(d, REQUEST)
    assert got[-1].finish_reason is not None
    stats = d.statistics().migration
    assert stats.divergences == 1 and stats.migrations == {"broken:continued": 1}


async def test_chat_never_continues_from_text() -> None:
    from backends.base import ChatMessage

    request = GenerateRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=10, seed=1)
    d = Dispatcher(await actors(FlakyBackend(NoIds(mock()), fail_first=1, after_events=3), NoIds(mock())), Prefer("a", "b"),
                   migration=Settings(replay=False, text_continuation=True))  # fmt: skip
    with pytest.raises(MigrationFailed) as info:
        await run(d, request)
    assert info.value.code == "no_backend_to_resume"


@pytest.mark.parametrize("recovered", [True, False])
async def test_a_backend_that_failed_the_stream_earlier_is_used_again_once_it_answers(
    autojump_clock: trio.testing.MockClock, recovered: bool
) -> None:
    """A breaks the stream, B continues it and breaks too: A is the only one
    left. Once A has answered since (a probe: it restarted), the stream goes
    back to A; until then it is not asked again (no backend to resume on)."""
    from backends.fakes import SlowBackend

    a = FlakyBackend(mock(), fail_first=1, after_events=2)
    b = FlakyBackend(SlowBackend(mock(), tpot_s=1.0), fail_first=1, after_events=3)
    fleet = await actors(a, b)
    d = Dispatcher(fleet, Prefer("a", "b"))

    async def probe_a_after_it_failed() -> None:
        while fleet[0].statistics().failures == 0:
            await trio.sleep(0.1)
        if recovered:
            await fleet[0].probe()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_a_after_it_failed)
        if recovered:
            got = await run(d, REQUEST)
            assert text(got) == text(await reference(REQUEST))
            assert d.statistics().migration.migrations == {"broken:resumed": 2}
        else:
            with pytest.raises(MigrationFailed) as info:
                await run(d, REQUEST)
            assert info.value.code == "no_backend_to_resume"


async def test_the_prefill_lane_serves_higher_priority_first_then_arrival_order(autojump_clock: trio.testing.MockClock) -> None:
    from backends.mock import PrefillLane

    lane = PrefillLane()
    order: list[str] = []

    async def use(name: str, priority: int, hold: float) -> None:
        async with lane.turn(priority):
            order.append(name)
            await trio.sleep(hold)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(use, "first", 0, 1.0)  # takes the free lane
        await trio.sleep(0.1)
        for name, priority in (("new-a", 0), ("resumed", 1), ("new-b", 0), ("batch", -1), ("resumed-2", 1)):
            nursery.start_soon(use, name, priority, 0.5)
            await trio.sleep(0.01)
    assert order == ["first", "resumed", "resumed-2", "new-a", "new-b", "batch"]


async def test_a_waiter_cancelled_once_handed_the_lane_passes_it_on(autojump_clock: trio.testing.MockClock) -> None:
    from backends.mock import PrefillLane

    lane = PrefillLane()
    got: list[str] = []

    async def holder() -> None:
        async with lane.turn():
            await trio.sleep(1.0)

    async def waiter(name: str, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            async with lane.turn():
                got.append(name)

    doomed = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.sleep(0.1)
        nursery.start_soon(waiter, "doomed", doomed)
        await trio.sleep(0.1)
        nursery.start_soon(waiter, "next")
        await trio.sleep(0.1)
        doomed.cancel()  # cancelled while waiting: leaves the queue
    assert got == ["next"]
    async with trio.open_nursery() as nursery:  # and the lane is free again
        nursery.start_soon(waiter, "later")
    assert got == ["next", "later"]


@pytest.mark.parametrize(("after_events", "fail_every"), [(0, 0), (3, 0), (3, 1)], ids=["retried", "migrated", "migrated-again"])
async def test_a_failed_attempts_error_is_freed_without_the_cyclic_collector(after_events: int, fail_every: int) -> None:
    """The error of a failed attempt (before the first token: retried;
    after: migrated, once or on every continuation) is kept while the
    request goes on, and its traceback holds the frames that kept it: a
    reference cycle, with the attempt's whole state in it, that waited for
    the oldest generation's collection (chaos: 64 of them a kill). Freed
    here by reference counting alone, with the collector off."""
    made: list[weakref.ref[BaseException]] = []

    def error(message: str) -> HeadraceError:
        exc = StreamBroken(message) if after_events else BackendUnavailable(message)
        made.append(weakref.ref(exc))
        return exc

    flaky = [FlakyBackend(mock(), fail_first=1, fail_every=fail_every, after_events=after_events, error=error)
             for _ in range(3 if fail_every else 1)]  # fmt: skip
    d = Dispatcher(await actors(*flaky, mock()), Prefer(*"abcd"), migration=Settings(max_migrations=5))
    gc.collect()
    gc.disable()
    try:
        got = await run(d, REQUEST)
        assert text(got) == text(await reference(REQUEST))
        assert len(made) == (3 if fail_every else 1)
        assert all(ref() is None for ref in made)
    finally:
        gc.enable()


@given(pieces=st.lists(st.text(alphabet="ab é", max_size=4), max_size=12), reads=st.sets(st.integers(0, 12)))
def test_the_text_so_far_is_every_events_text_in_order_however_often_it_is_read(pieces: list[str], reads: set[int]) -> None:
    progress = Progress()
    for n, piece in enumerate(pieces):
        if n in reads:
            assert progress.text == "".join(pieces[:n])
        progress.add(Event(text=piece))
    assert progress.text == "".join(pieces) and progress.text_events == sum(1 for p in pieces if p)

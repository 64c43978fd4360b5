"""Where a broken stream resumes: among the route's other backends, those
where its continuation would wait least for its first token (the prefill
queued there by this router, its own uncached tokens, the streams in
flight), so that a dead backend's streams, which all break at once, spread
by the work queued rather than in turn; the routing policy picks among the
ones tied. In-process, with the deterministic mock as the reference."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
import trio
import trio.testing

from backends.base import Backend, Event, GenerateRequest
from backends.fakes import FlakyBackend, WrappedBackend
from policies.base import BackendView, RouteRequest
from router.dispatch import Dispatcher
from router.migration import (
    RESUME_PRIORITY_BOOST,
    RESUME_SHORT_PREFILL_TOKENS,
    resume_placement,
    short_prefill_first,
)
from tests.router.test_breakers import Prefer
from tests.router.test_migration import actors, mock, reference, run, text


def names(views: Sequence[BackendView]) -> list[str]:
    return [v.name for v in views]


def test_a_continuation_may_go_only_where_the_queued_prefill_and_load_are_least() -> None:
    idle = BackendView(name="idle")
    queued = BackendView(name="queued", pending_prefill_tokens=2000)
    busy = BackendView(name="busy", in_flight=50)  # 50 x 2 ms = 500 uncached tokens' worth
    assert names(resume_placement([queued, idle, busy], 1100)) == ["idle"]
    assert names(resume_placement([queued, busy], 1100)) == ["busy"]
    assert names(resume_placement([idle, BackendView(name="idle-too")], 1100)) == ["idle", "idle-too"]  # the policy breaks ties
    assert resume_placement([], 1100) == []


def test_the_policys_queued_prefill_stands_for_the_views_whole_prompts() -> None:
    """Streams whose prompts ``a`` held (16 tokens each to compute, by the
    policy's count) make it less busy than their whole prompts say (the
    views' ``pending_prefill_tokens``): a continuation it holds goes there."""
    a = BackendView(name="a", pending_prefill_tokens=10 * 1040)
    b = BackendView(name="b", pending_prefill_tokens=1040)
    assert names(resume_placement([a, b], 1100, {"a": 1088, "b": 1024})) == ["b"]  # by whole prompts
    assert names(resume_placement([a, b], 1100, {"a": 1088, "b": 1024}, {"a": 160, "b": 1040})) == ["a"]
    assert names(resume_placement([a, b], 1100, {"a": 1088, "b": 1024}, {})) == ["a"]  # nothing queued anywhere


def test_a_backend_that_holds_the_prefix_is_cheaper_by_the_tokens_it_holds() -> None:
    holds = BackendView(name="holds", pending_prefill_tokens=600)
    cold = BackendView(name="cold")
    # It holds 1000 of the 1100 tokens: 600 queued + 100 to compute, against 1100 to compute.
    assert names(resume_placement([cold, holds], 1100, {"holds": 1000})) == ["holds"]
    assert names(resume_placement([cold, holds], 1100, {"holds": 400})) == ["cold"]
    assert names(resume_placement([cold, holds], 1100)) == ["cold"]  # no estimate: the queues decide


class NewToAResumedToFirst:
    """New requests go to ``a`` (a ``backlog`` prompt to ``d``); a resumed
    one (a priority step up) to the first candidate it is shown: alone,
    every continuation would herd onto one backend."""

    name = "herd"

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        listed = [c.name for c in candidates]
        if request.priority > 0:
            return listed[0]
        want = "d" if request.prefix.startswith("backlog") else "a"
        return want if want in listed else None


async def test_a_dead_backends_streams_resume_by_queued_prefill_not_in_turn(autojump_clock: trio.testing.MockClock) -> None:
    """Six streams on ``a`` break together after 3 tokens. ``d`` has two
    long prompts queued before their first token; ``b`` and ``c`` are idle.
    The continuations go to ``b`` and ``c`` by turns (each one's prompt counts
    as queued there before the next is placed) and none to ``d``; every
    answer is the uninterrupted one."""
    request = GenerateRequest(prompt="the river runs", max_tokens=12, seed=7)
    want = text(await reference(request))
    broken = FlakyBackend(mock(tpot_s=0.01), fail_first=6, after_events=3)
    b, c = mock(ttft_s=0.05, tpot_s=0.01), mock(ttft_s=0.05, tpot_s=0.01)
    d = mock(ttft_s=30.0, tpot_s=0.01)  # its two backlog streams stay queued throughout
    group = await actors(broken, b, c, d, names="abcd")
    dispatcher = Dispatcher(group, NewToAResumedToFirst())
    got: list[str] = []

    async def one(r: GenerateRequest) -> None:
        got.append(text(await run(dispatcher, r)))

    backlog = GenerateRequest(prompt="backlog " + "x" * 1000, max_tokens=2, seed=1)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(one, backlog)
        await trio.sleep(0.001)
        assert group[3].view().pending_prefill_tokens > 400
        for _ in range(6):
            nursery.start_soon(one, request)
    assert got.count(want) == 6
    served = {a.name: a.statistics().requests for a in group}
    assert served == {"a": 6, "b": 3, "c": 3, "d": 2}  # d: only its backlog
    assert dispatcher.statistics().migration.migrations == {"broken:resumed": 6}


def test_a_continuation_that_fits_one_prefill_step_goes_one_more_step_ahead() -> None:
    request = GenerateRequest(prompt_token_ids=list(range(1100)), priority=3)
    assert short_prefill_first(request, RESUME_SHORT_PREFILL_TOKENS).priority == 4
    assert short_prefill_first(request, 0).priority == 4
    assert short_prefill_first(request, RESUME_SHORT_PREFILL_TOKENS + 1) is request


class Priorities(WrappedBackend):
    """Records the priority of every request it is sent."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.priorities: list[int] = []

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.priorities.append(request.priority)
        async for event in super().stream(request):
            yield event


class HoldsOn(Prefer):
    """Prefers ``order``; estimates that ``holds`` caches all but ``uncached`` tokens of any request."""

    def __init__(self, *order: str, holds: str, uncached: int) -> None:
        super().__init__(*order)
        self.holds, self.uncached = holds, uncached

    def cached_tokens(self, views: Sequence[BackendView], request: RouteRequest, now: float) -> dict[str, int]:
        return {self.holds: max(0, request.prompt_tokens - self.uncached)}


async def test_a_resumed_stream_whose_backend_holds_its_prompt_goes_ahead_of_one_that_must_prefill() -> None:
    """A stream with a 1050-token prompt breaks on ``a`` and resumes on
    ``b``: with the policy's estimate that ``b`` holds all but 40 tokens, the
    continuation goes two steps up (the resume boost, then the short
    prefill); with 600 uncached, or no estimate, one. Every answer is the
    uninterrupted one."""
    request = GenerateRequest(prompt="the river runs " * 70, max_tokens=12, seed=7)
    want = text(await reference(request))
    for uncached, boost in ((40, RESUME_PRIORITY_BOOST + 1), (600, RESUME_PRIORITY_BOOST), (None, RESUME_PRIORITY_BOOST)):
        b = Priorities(mock())
        group = await actors(FlakyBackend(mock(), fail_first=1, after_events=3), b, names="ab")
        policy = Prefer("a", "b") if uncached is None else HoldsOn("a", "b", holds="b", uncached=uncached)
        assert text(await run(Dispatcher(group, policy), request)) == want
        assert b.priorities == [request.priority + boost], uncached


class Arrivals(WrappedBackend):
    """Records when each request arrives and when its first event leaves (trio's clock), by priority."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.arrived: list[tuple[float, int]] = []
        self.first: list[tuple[float, int]] = []

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.arrived.append((trio.current_time(), request.priority))
        first = True
        async for event in super().stream(request):
            if first:
                self.first.append((trio.current_time(), request.priority))
                first = False
            yield event


async def test_a_continuation_that_must_prefill_its_whole_prompt_waits_for_the_short_ones_of_its_break(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Four streams break on ``a`` together: one whose prompt nobody else
    holds (started first), three that ``b`` holds. An engine cannot preempt a
    prefill chunk it has started: the long continuation reaches ``b`` only
    once the three short ones have their first token (each a few tokens of
    prefill there, not behind a 512-token chunk of 1 ms a token), and every
    answer is the uninterrupted one."""
    from tests.router.test_migration_standby import Estimating, Recording

    cache = {"block_size": 16, "cache_blocks": 1024, "max_context": 4096, "tpot_s": 0.01}
    lane = {"prefill_s_per_token": 0.001, "prefill_chunk_tokens": 512}
    shared = [GenerateRequest(prompt_token_ids=list(range(100, 1100)), max_tokens=12, seed=s, temperature=1.0) for s in (1, 2, 3)]
    cold = GenerateRequest(prompt_token_ids=list(range(5000, 6000)), max_tokens=12, seed=4, temperature=1.0)
    wants = {id(r): text(await reference(r)) for r in (*shared, cold)}
    b = Recording(mock(**cache, **lane))
    await reference(shared[0])
    async for _ in b.mock.stream(shared[0]):  # b holds the shared prompt
        pass
    arrivals = Arrivals(b)
    group = await actors(FlakyBackend(mock(**cache), fail_first=4, after_events=5), arrivals, names="ab")
    dispatcher = Dispatcher(group, Estimating("a", "b", replicas={"b": b}))
    got: dict[int, str] = {}

    async def one(r: GenerateRequest) -> None:
        got[id(r)] = text(await run(dispatcher, r))

    async with trio.open_nursery() as nursery:
        for r in (cold, *shared):
            nursery.start_soon(one, r)
    assert got == wants
    long_arrived = next(t for t, p in arrivals.arrived if p == RESUME_PRIORITY_BOOST)
    short_firsts = [t for t, p in arrivals.first if p == RESUME_PRIORITY_BOOST + 1]
    assert len(short_firsts) == 3 and max(short_firsts) <= long_arrived
    assert max(short_firsts) - min(t for t, _ in arrivals.arrived) < 0.2  # not behind a 0.5 s chunk
    assert dispatcher.statistics().migration.migrations == {"broken:resumed": 4}


def test_entries_that_name_one_server_count_as_one_for_the_short_resumes() -> None:
    """Two backend entries on one URL share its prefill: a long continuation
    placed through one waits for the short ones placed through the other."""
    from router.actors import BackendActor
    from router.dispatch import _server

    class OnServer(WrappedBackend):
        base_url = "http://10.0.0.7:8000"

    shared, cold = BackendActor("m", OnServer(mock())), BackendActor("m-cold", OnServer(mock()))
    assert _server(shared) == _server(cold) == "http://10.0.0.7:8000"
    assert _server(BackendActor("local", mock())) == "local"  # no URL: its name


class KnowsNothing(Prefer):
    """Prefers ``order``; an estimate with nothing in it (what kv_aware
    returns for a request without block hashes: no prefix keys)."""

    def cached_tokens(self, views: Sequence[BackendView], request: RouteRequest, now: float) -> dict[str, int]:
        return {}


async def test_a_continuation_the_policy_knows_nothing_about_is_not_held_back(autojump_clock: trio.testing.MockClock) -> None:
    """Without block hashes an empty estimate is no evidence that nobody
    holds the prompt: the continuation of a 1000-token prompt goes at once
    (the long-continuation wait would show as 10 ms of virtual time)."""
    request = GenerateRequest(prompt_token_ids=list(range(100, 1100)), max_tokens=8, seed=2, temperature=1.0)
    b = Arrivals(mock(tpot_s=0.01))
    group = await actors(FlakyBackend(mock(tpot_s=0.01), fail_first=1, after_events=3), b, names="ab")
    start = trio.current_time()
    assert text(await run(Dispatcher(group, KnowsNothing("a", "b")), request)) == text(await reference(request))
    assert [t - start for t, _ in b.arrived] == [pytest.approx(0.03)]  # the break, 30 ms in: no wait (0.04 with it)

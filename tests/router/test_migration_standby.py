"""Warm standby (``[migration] standby_tokens``): every N tokens a stream
relays, its prompt and output so far are prefilled on one other backend of
its route that holds its prompt, so that a resume there recomputes at most
about N tokens of the output instead of all of it. In-process, with the
deterministic mock (its prefix-cache model says what a backend served from
its cache) as the reference; the chaos bench measures the resume gap."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from backends.base import Event, GenerateRequest, chain_hashes
from backends.fakes import FlakyBackend, WrappedBackend
from backends.mock import MockBackend
from policies.base import BackendView, RouteRequest
from router.config import ConfigError, decode_config
from router.dispatch import Dispatcher
from router.migration import Progress, Settings, Standby, standby_request
from router.routes import RouteTable
from tests.router.test_breakers import Prefer
from tests.router.test_migration import actors, mock, reference, reference_on, run, text
from tests.router.test_migration_placement import HoldsOn

CACHE = {"block_size": 16, "cache_blocks": 512, "max_context": 4096}


class Recording(WrappedBackend):
    """Records every request it is sent and, with the mock's cache model on,
    the tokens of it the mock held when it came (what it serves from its
    cache: a resumed request's usage reports the original prompt's only)."""

    def __init__(self, inner: MockBackend) -> None:
        super().__init__(inner)
        self.mock = inner
        self.sent: list[GenerateRequest] = []
        self.held: list[int] = []

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.sent.append(request)
        self.held.append(holds(self.mock, request.prompt_token_ids or []))
        async for event in super().stream(request):
            yield event


def holds(mock: MockBackend, ids: list[int]) -> int:
    cache = mock.cache
    return (
        cache.match(chain_hashes(ids, cache.block_size), len(ids))
        if cache is not None and ids
        else 0
    )


def prompt_and_output(events: list[Event]) -> tuple[list[int], list[int]]:
    prompt = next(e.prompt_token_ids for e in events if e.prompt_token_ids is not None)
    return prompt, [t for e in events for t in e.token_ids]


async def served(dispatcher_for: Any, request: GenerateRequest) -> tuple[list[Event], Dispatcher]:
    """Run ``request`` through the dispatcher ``dispatcher_for(spawn)``
    makes, and wait for the syncs it spawned."""
    async with trio.open_nursery() as nursery:
        d = dispatcher_for(nursery.start_soon)
        events = await run(d, request)
    return events, d


async def test_every_n_tokens_the_prompt_and_output_so_far_are_prefilled_on_a_standby_that_holds_the_prompt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 20-token stream on ``a`` with ``standby_tokens = 8``: ``b`` (which
    holds the prompt, by the policy's estimate) is sent prompt + the first 8
    output ids, then prompt + the first 16, each to generate one token, a
    priority step below the stream and with the resume contract; ``c``
    (which does not hold it) nothing. The client's answer is the
    uninterrupted one."""
    request = GenerateRequest(
        prompt="the river runs " * 8, max_tokens=20, seed=5, stop=["zzz"], logprobs=2
    )
    want = await reference(request, tpot_s=0.01)
    prompt, out = prompt_and_output(want)
    b, c = Recording(mock(tpot_s=0.01)), Recording(mock(tpot_s=0.01))
    group = await actors(mock(tpot_s=0.01), b, c, names="abc")
    got, d = await served(
        lambda spawn: Dispatcher(
            group,
            HoldsOn("a", "c", "b", holds="b", uncached=0),
            migration=Settings(standby_tokens=8),
            spawn=spawn,
        ),
        request,
    )
    assert text(got) == text(want)
    syncs = [(r.prompt_token_ids, r.resumed_tokens, r.max_tokens, r.min_tokens, r.priority, r.stop, r.logprobs)
             for r in b.sent]  # fmt: skip
    assert syncs == [
        (prompt + out[:8], 8, 1, 0, -1, [], None),
        (prompt + out[:16], 16, 1, 0, -1, [], None),
    ]
    assert c.sent == []
    stats = d.statistics().migration
    assert stats.standby_syncs == {"synced": 2}
    assert (
        stats.standby_tokens == 2 * len(prompt) + 24
    )  # the plain mock caches nothing: every sync prefilled all


@pytest.mark.parametrize("case", ["off", "nobody_holds", "no_estimate", "no_spawn"])
async def test_no_standby_when_off_when_no_other_backend_holds_the_prompt_or_nothing_can_tell(
    case: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A standby that had to prefill the whole prompt would double its cost:
    none where no other backend holds it by the policy's estimate, or the
    policy makes none; none when off, or without a way to run it beside."""
    request = GenerateRequest(prompt="the river runs " * 8, max_tokens=20, seed=5)
    b = Recording(mock(tpot_s=0.01))
    group = await actors(mock(tpot_s=0.01), b, names="ab")
    policy = {
        "nobody_holds": HoldsOn("a", "b", holds="x", uncached=0),
        "no_estimate": Prefer("a", "b"),
    }.get(case, HoldsOn("a", "b", holds="b", uncached=0))
    settings = Settings(standby_tokens=0 if case == "off" else 8)
    got, d = await served(
        lambda spawn: Dispatcher(
            group, policy, migration=settings, spawn=None if case == "no_spawn" else spawn
        ),
        request,
    )
    assert text(got) == text(await reference(request))
    assert b.sent == []
    skipped = {"skipped": 2} if case in ("nobody_holds", "no_estimate") else {}
    assert d.statistics().migration.standby_syncs == skipped


@pytest.mark.parametrize("standby_tokens", [0, 8])
async def test_a_broken_stream_resumes_on_its_standby_from_its_cache(
    standby_tokens: int, autojump_clock: trio.testing.MockClock
) -> None:
    """``a`` breaks after 30 tokens; ``b`` and ``c`` both hold the 160-token
    prompt (they served it before); the standby syncs (at 8, 16 and 24
    tokens) go to ``b``. The continuation goes to ``b`` (it holds the most:
    resume placement) and serves the prompt and 16 output tokens from its
    cache (the 184 tokens of the last sync, in full 16-token blocks), where
    without the standby it holds the prompt's blocks only. Either way the
    answer is the uninterrupted one."""
    request = GenerateRequest(
        prompt_token_ids=list(range(100, 260)), max_tokens=40, seed=9, temperature=1.0
    )
    want = await reference(request, tpot_s=0.01, **CACHE)
    prompt, _ = prompt_and_output(want)
    b, c = Recording(mock(tpot_s=0.01, **CACHE)), Recording(mock(tpot_s=0.01, **CACHE))
    for replica in (b, c):
        await reference_on(replica.mock, request)
    broken = FlakyBackend(mock(tpot_s=0.01, **CACHE), fail_first=1, after_events=30)
    group = await actors(broken, b, c, names="abc")
    policy = Estimating("a", "b", "c", replicas={"b": b, "c": c})
    got, d = await served(
        lambda spawn: Dispatcher(
            group, policy, migration=Settings(standby_tokens=standby_tokens), spawn=spawn
        ),
        request,
    )
    assert text(got) == text(want)
    resumed = [
        (r, h) for r, h in zip(b.sent + c.sent, b.held + c.held, strict=True) if r.max_tokens != 1
    ]
    assert len(resumed) == 1
    continuation, held = resumed[0]
    assert continuation.resumed_tokens == 30
    if standby_tokens:
        assert [r.resumed_tokens for r in b.sent if r.max_tokens == 1] == [8, 16, 24]
        assert continuation in b.sent
        assert held == len(prompt) + 16  # 176 of its 190 tokens: 14 to compute, not 30
    else:
        assert held == len(prompt)  # 160: the prompt's 10 full blocks, none of the output
    assert d.statistics().migration.migrations == {"broken:resumed": 1}


class Estimating(Prefer):
    """Prefers ``order``; estimates what each replica holds by asking its
    mock's prefix cache (what a cache-aware policy learns from KV events)."""

    def __init__(self, *order: str, replicas: dict[str, Recording]) -> None:
        super().__init__(*order)
        self.replicas = replicas

    def cached_tokens(
        self, views: Sequence[BackendView], request: RouteRequest, now: float
    ) -> dict[str, int]:
        ids = request.prompt_token_ids or []
        out = {}
        for v in views:
            replica = self.replicas.get(v.name)
            if replica is not None:
                out[v.name] = holds(replica.mock, ids)
        return out


def test_the_standby_is_due_every_n_tokens_while_the_stream_is_resumable() -> None:
    request = GenerateRequest(prompt="p", max_tokens=50, priority=2, request_id="r1")
    standby = Standby(request, 4)
    progress = Progress()
    progress.add(Event(text="ab", token_ids=[1, 2], prompt_token_ids=[7, 8]))
    assert not standby.due(progress)
    progress.add(Event(text="cd", token_ids=[3, 4]))
    assert standby.due(progress)
    standby.started(progress)
    assert not standby.due(progress) and standby.next_at == 8
    standby.busy = False
    progress.add(Event(text="efgh", token_ids=[5, 6, 7, 8]))
    assert standby.due(progress)
    sync = standby_request(request, progress)
    assert (
        sync.prompt_token_ids,
        sync.resumed_tokens,
        sync.max_tokens,
        sync.priority,
        sync.request_id,
    ) == ([7, 8, 1, 2, 3, 4, 5, 6, 7, 8], 8, 1, 1, "r1-standby")
    progress.add(Event(finish_reason="stop"))
    assert not standby.due(progress)  # the stream is over: nothing to resume
    textual = Progress()
    textual.add(Event(text="abcdefgh"))  # no token ids: nothing to resume by ids
    assert not Standby(request, 4).due(textual)


def test_standby_tokens_in_config_and_per_model() -> None:
    from policies.routing import RoundRobin
    from router.app import migration_settings

    config = decode_config(
        {
            "migration": {"standby_tokens": 32},
            "models": [{"name": "chat", "standby_tokens": 0}, {"name": "code"}],
        }
    )
    base = migration_settings(config.migration)
    assert base.standby_tokens == 32
    table = RouteTable(config.models, RoundRobin(), migration=base)
    chat = table.plan(GenerateRequest(model="chat")).targets[0].migration
    code = table.plan(GenerateRequest(model="code")).targets[0].migration
    assert chat is not None and chat.standby_tokens == 0  # the model's own
    assert code is None  # the router's, base
    with pytest.raises((ConfigError, msgspec.ValidationError)):
        decode_config({"migration": {"standby_tokens": -1}})


class Sent(WrappedBackend):
    """Records every request it is sent."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.sent: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.sent.append(request)
        async for event in super().stream(request):
            yield event


async def test_the_engine_answers_a_standby_sync_and_then_holds_its_prompt_and_output(tmp_path: Path) -> None:
    """The real EngineBackend and LLMEngine (the fake runner, no model): the
    syncs a stream on engine ``a`` sends engine ``b`` are answered (synced,
    none failed: the resume contract with one token to generate and no stop
    strings is a request the engine takes), and ``b``'s KV events then hold
    the blocks of the prompt and the output up to the last sync."""
    from backends.engine.backend import open_engine_backend
    from router.prefix_keys import load_tokenizer
    from tests.router.test_prefix_keys import BLOCK, fake_engine_backend, write_tokenizer_gguf

    tok = load_tokenizer(str(write_tokenizer_gguf(tmp_path / "tok.gguf")))
    request = GenerateRequest(model="tiny", prompt="the water then went in the well, and the winter " * 4,
                              max_tokens=24, temperature=0.0, ignore_eos=True, stop=["zzz"])  # fmt: skip
    async with (open_engine_backend(fake_engine_backend(tok).engine, tok, model_name="tiny") as a,
                open_engine_backend(fake_engine_backend(tok).engine, tok, model_name="tiny") as b):  # fmt: skip
        standby = Sent(b)
        group = await actors(a, standby, names="ab")
        got, d = await served(lambda spawn: Dispatcher(group, HoldsOn("a", "b", holds="b", uncached=0),
                                                       migration=Settings(standby_tokens=6), spawn=spawn), request)
        assert [e.finish_reason for e in got if e.finish_reason] == ["length"]
        syncs = d.statistics().migration.standby_syncs
        assert syncs.get("synced", 0) >= 1 and "failed" not in syncs
        assert syncs["synced"] == len(standby.sent)
        last = standby.sent[-1].prompt_token_ids
        prompt, out = prompt_and_output(got)
        assert last is not None and last[len(prompt):] == out[: len(last) - len(prompt)] and len(last) > len(prompt)
        stored: set[int] = set()
        with trio.move_on_after(1.0):
            async for event in b.kv_events(-1):
                if event.kind == "stored":
                    stored.update(event.block_hashes)
        held = chain_hashes(last, BLOCK)[: (len(last) - 1) // BLOCK]
        assert len(held) * BLOCK > len(prompt) and set(held) <= stored

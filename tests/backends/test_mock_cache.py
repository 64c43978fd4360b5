"""The mock's prefix-cache cost model (``backends.mock_cache``): cached
prompts come back sooner and say so in ``usage``, the LRU stays within its
bound and reports what it evicts, concurrent prefills take turns, and the KV
event stream has the engine's shape and ``since=`` resume over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from functools import partial

import httpx
import msgspec
import pytest
import trio

from backends.base import GenerateRequest, KVEvent, chain_hashes
from backends.mock import MockBackend, MockConfig, encode_text
from backends.mock_cache import PrefixCache
from backends.mock_http import serve_lean
from backends.mock_server import build_app, main
from frontend.serving import ServeOptions

# ttft 10 ms fixed, 1 ms per uncached token, blocks of 16 bytes.
CACHED = MockConfig(ttft_s=0.010, block_size=16, cache_blocks=64, prefill_s_per_token=0.001,
                    max_context=8192)
SHARED = "s" * 512  # 32 full blocks


async def _ttft(backend: MockBackend, prompt: str) -> tuple[float, int]:
    """Time to the first event, and the usage's cached tokens."""
    start, first = trio.current_time(), None
    async with aclosing(backend.stream(GenerateRequest(prompt=prompt, max_tokens=2))) as events:
        async for event in events:
            first = trio.current_time() - start if first is None else first
            if event.usage is not None:
                assert first is not None
                return first, event.usage.cached_tokens
    raise AssertionError("no usage")


async def test_a_second_request_sharing_a_long_prefix_is_served_from_the_cache_and_sooner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(CACHED)
    first = await _ttft(backend, SHARED + "first question")
    second = await _ttft(backend, SHARED + "another question, longer")
    assert first == (pytest.approx(0.010 + 0.526), 0)
    assert second == (pytest.approx(0.010 + (536 - 512) * 0.001), 512)
    stats = backend.statistics().cache
    assert stats is not None and (stats.query_tokens, stats.hit_tokens) == (526 + 536, 512)


async def test_the_last_token_is_always_computed_even_when_every_block_is_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MockBackend(CACHED)
    await _ttft(backend, SHARED)
    assert await _ttft(backend, SHARED) == (pytest.approx(0.010 + 16 * 0.001), 496)


async def test_concurrent_prefills_take_turns_in_the_replicas_one_lane(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three cold 100-token prompts at once: first tokens at 110, 210, 310 ms."""
    backend = MockBackend(CACHED)
    ttfts: list[float] = []

    async def one(i: int) -> None:
        ttfts.append((await _ttft(backend, f"{i}" * 100))[0])

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
    assert sorted(ttfts) == pytest.approx([0.110, 0.210, 0.310])


async def _ttft_at(backend: MockBackend, prompt: str, *, at: float, priority: int = 0) -> float:
    """The first token's time after the request, sent ``at`` s from now."""
    await trio.sleep(at)
    start = trio.current_time()
    request = GenerateRequest(prompt_token_ids=encode_text(prompt), max_tokens=1, priority=priority)
    async with aclosing(backend.stream(request)) as events:
        async for _ in events:
            return trio.current_time() - start
    raise AssertionError("no event")


@pytest.mark.parametrize("chunk", [512, 0])
async def test_a_higher_priority_prefill_waits_one_chunk_of_a_long_one(
    autojump_clock: trio.testing.MockClock, chunk: int,
) -> None:
    """A 2000-token cold prefill holds the lane from 10 ms; a priority-5
    100-token request comes at 50 ms. Chunked (512 tokens a turn, 1 ms each),
    it goes when the first chunk ends (522 ms) and the long one finishes
    100 ms late; whole prompts, it waits for all 2000."""
    backend = MockBackend(msgspec.structs.replace(CACHED, prefill_chunk_tokens=chunk))
    ttfts: dict[str, float] = {}

    async def one(name: str, prompt: str, at: float, priority: int) -> None:
        ttfts[name] = await _ttft_at(backend, prompt, at=at, priority=priority)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "long", "l" * 2000, 0.0, 0)
        nursery.start_soon(one, "urgent", "u" * 100, 0.050, 5)
    if chunk:
        assert ttfts == pytest.approx({"urgent": 0.622 - 0.050, "long": 2.110})
    else:
        assert ttfts == pytest.approx({"urgent": 2.110 - 0.050, "long": 2.010})


async def test_a_prefill_cancelled_while_it_yields_leaves_the_lane_to_one_holder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The long prefill yields to an urgent one and is cancelled while it
    waits for the lane back: the urgent one keeps it alone, and the two that
    come next take it one after the other."""
    backend = MockBackend(CACHED)
    ttfts: dict[str, float] = {}

    async def one(name: str, prompt: str, at: float, priority: int = 0) -> None:
        ttfts[name] = await _ttft_at(backend, prompt, at=at, priority=priority)

    long = trio.CancelScope()

    async def cancellable() -> None:
        with long:
            await one("long", "l" * 2000, 0.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancellable)
        nursery.start_soon(one, "urgent", "u" * 600, 0.050, 5)  # from 522 ms to 1122 ms
        nursery.start_soon(one, "next", "n" * 100, 0.600)  # after urgent: 1122 -> 1222
        nursery.start_soon(one, "last", "z" * 100, 0.700)  # then: 1222 -> 1322
        await trio.sleep(0.8)
        long.cancel()
    assert "long" not in ttfts
    assert ttfts == pytest.approx({"urgent": 1.122 - 0.050, "next": 1.222 - 0.600, "last": 1.322 - 0.700})


def test_the_lru_holds_its_bound_and_reports_evictions_as_removed_events() -> None:
    cache = PrefixCache(capacity_blocks=4, block_size=2)
    a, b = chain_hashes([1, 2, 3, 4, 5, 6], 2), chain_hashes([7, 8, 9, 10], 2)
    assert [(e.seq, e.kind, e.block_hashes, e.parent_hash) for e in cache.store(a)] == [
        (1, "stored", tuple(a), None)
    ]
    assert cache.store(a) == []  # nothing new: touched only
    events = cache.store(b)
    assert [(e.seq, e.kind) for e in events] == [(2, "stored"), (3, "removed")]
    # a was touched tail first, so its tail goes first and its head stays.
    assert events[1].block_hashes == (a[2],) and len(cache) == 4
    assert cache.contents() == [a[1], a[0], b[1], b[0]]
    assert cache.match(a, 6) == 4  # two leading blocks left of three
    assert [e.seq for e in cache.since(1)] == [2, 3] and cache.since(3) == []


def test_a_stored_tail_names_its_parent_and_the_history_is_bounded() -> None:
    cache = PrefixCache(capacity_blocks=100, block_size=2, history=3)
    ids = list(range(20))
    cache.store(chain_hashes(ids[:4], 2))
    event = cache.store(chain_hashes(ids[:8], 2))[0]
    assert event.parent_hash == chain_hashes(ids[:4], 2)[-1]
    for n in range(10, 16, 2):
        cache.store(chain_hashes(ids[:n], 2))
    assert [e.seq for e in cache.since(-1)] == [3, 4, 5]  # a subscriber at 1 sees a gap


@asynccontextmanager
async def _serving(backend: MockBackend) -> AsyncIterator[str]:
    app = build_app(backend)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve_lean, app, ServeOptions(port=0),
                                          answer_now=app.answer_now))
        try:
            yield url
        finally:
            nursery.cancel_scope.cancel()


async def _events(client: httpx.AsyncClient, query: str, n: int) -> list[tuple[int, KVEvent]]:
    """The first ``n`` events of ``GET /v1/kv_events{query}``: (SSE id, event)."""
    got: list[tuple[int, KVEvent]] = []
    with trio.fail_after(5):
        async with client.stream("GET", "/v1/kv_events" + query) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            event_id = None
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    event_id = int(line[4:])
                elif line.startswith("data: "):
                    assert event_id is not None
                    got.append((event_id, msgspec.json.decode(line[6:], type=KVEvent)))
                    if len(got) == n:
                        return got
    raise AssertionError(f"the stream ended after {len(got)} events")


@pytest.mark.parametrize(("h2", "per_token"), [(False, 0.0), (True, 0.0), (True, 2e-5)])
async def test_kv_events_stream_over_http_resumes_with_since_and_cached_tokens_are_on_the_wire(
    h2: bool, per_token: float,
) -> None:
    """Zero delays: the lean server's synchronous answer; a prefill cost: the paced fast path."""
    backend = MockBackend(MockConfig(block_size=16, cache_blocks=40, max_context=8192,
                                     prefill_s_per_token=per_token))
    prompts = [SHARED + "a" * 32, SHARED + "b" * 300]  # 34 blocks, then 18 new (12 evicted)
    async with _serving(backend) as url, \
            httpx.AsyncClient(base_url=url, http1=not h2, http2=h2, timeout=5) as client:
        models = (await client.get("/v1/models")).json()["data"][0]
        assert (models["block_size"], models["kv_events"], models["tokenizer"]) == (16, True, "bytes")
        usages = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}
            r = await client.post("/v1/completions", json=body)
            usages.append(msgspec.json.decode(r.text.split("data: ")[-2])["usage"])
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 512]
        # Not streamed (the frontend's path): 40 of its 50 blocks survived the eviction.
        r = await client.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 640
        everything = await _events(client, "", 3)
        assert [(i, e.seq, e.kind) for i, e in everything] == [
            (1, 1, "stored"), (2, 2, "stored"), (3, 3, "removed")
        ]
        assert everything[0][1].block_hashes == tuple(chain_hashes(encode_text(prompts[0]), 16))
        assert len(everything[2][1].block_hashes) == 34 + 18 - 40
        assert [i for i, _ in await _events(client, "?since=2", 1)] == [3]


def test_the_command_line_refuses_a_prefill_cost_without_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--prefill-ms-per-token", "1"]) == 2
    assert "--prefill-ms-per-token without --block-size" in capsys.readouterr().err

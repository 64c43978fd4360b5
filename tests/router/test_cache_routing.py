"""Cache-aware routing end to end: the real router over HTTP in front of real
engine servers (the real EngineBackend, block manager and prefix cache over
the fake runner) and prefix-cache mocks, all on 127.0.0.1.

A second request sharing a long prefix lands on the backend that cached the
first (kv_aware from the engines' KV events, prefix_hash from the key alone),
and the engine's ``cached_tokens`` shows the hit; under round robin it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from backends.base import ChatMessage, GenerateRequest, chain_hashes
from backends.engine.server import run_server
from backends.mock import MockConfig
from backends.openai_http import OpenAIHTTPBackend
from frontend.serving import ServeOptions
from router.app import KVFanOut, NamedBackend, Router, kv_sink_for
from router.config import decode_config
from router.prefix_keys import load_tokenizer
from tests.backends.conftest import serve_mock
from tests.router.test_integration import serve_router
from tests.router.test_prefix_keys import fake_engine_backend, write_tokenizer_gguf

pytestmark = pytest.mark.timeout(60)

SYSTEM = "You answer in one word. The water in the well is cold in the winter. " * 6


@pytest.fixture(scope="module")
def tok_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_gguf(tmp_path_factory.mktemp("cachetok") / "tiny-tok.gguf")


async def engines_router(nursery: trio.Nursery, tok_gguf: Path, policy: str, n: int = 3) -> tuple[Router, httpx.AsyncClient]:
    backends = []
    for i in range(n):
        engine = fake_engine_backend(load_tokenizer(str(tok_gguf)), model=str(tok_gguf))
        url = await nursery.start(run_server, engine, ServeOptions("127.0.0.1", 0, graceful_timeout=0.5))
        backends.append(NamedBackend(f"e{i}", OpenAIHTTPBackend(url, name=f"e{i}", token_ids=True)))
    config = decode_config({"backends": [{"kind": "mock", "name": f"e{i}"} for i in range(n)],
                            "routing": {"policy": policy}, "health": {"interval": 0.2}})
    router = Router(config, backends)
    url = await serve_router(nursery, router)
    client = httpx.AsyncClient(base_url=url, timeout=10)
    with trio.fail_after(20):  # every model's tokenizer learned from /v1/models
        while not any(router.keys.statistics().models.values()):
            await trio.sleep(0.05)
    return router, client


def body(question: str) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def served(router: Router) -> dict[str, int]:
    return {a.name: a.statistics().requests for a in router.actors}


async def mocks_router(nursery: trio.Nursery, n: int, client_timeout: float = 10, **mock: Any) -> tuple[Router, httpx.AsyncClient, Any]:
    """``n`` prefix-cache mocks (``mock``: their MockConfig fields) behind a
    kv_aware router, once it has learned their tokenizer: (router, client, policy)."""
    backends = []
    for i in range(n):
        served_mock = await serve_mock(nursery, MockConfig(name=f"m{i}", models=("mock",), block_size=16, **mock), [])
        backends.append(NamedBackend(f"m{i}", OpenAIHTTPBackend(served_mock.url, name=f"m{i}")))
    config = decode_config({"backends": [{"kind": "mock", "name": f"m{i}"} for i in range(n)],
                            "routing": {"policy": "kv_aware"}, "health": {"interval": 0.2}})
    router = Router(config, backends)
    client = httpx.AsyncClient(base_url=await serve_router(nursery, router), timeout=client_timeout)
    with trio.fail_after(10):
        while not any(router.keys.statistics().models.values()):
            await trio.sleep(0.05)
    return router, client, router.dispatcher.policy


async def cached_tokens(client: httpx.AsyncClient, system: str) -> int:
    """What the mock served from its cache for one chat with this system prompt."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    r = await client.post("/v1/chat/completions", json={"model": "mock", "messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def ask(client: httpx.AsyncClient, question: str) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json=body(question))
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_hash"])
async def test_a_second_request_sharing_a_long_prefix_lands_where_it_is_cached(
    nursery: trio.Nursery, tok_gguf: Path, policy: str
) -> None:
    router, client = await engines_router(nursery, tok_gguf, policy)
    async with client:
        first = await ask(client, "what is in the well?")
        home = [name for name, n in served(router).items() if n == 1]
        assert len(home) == 1 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if policy == "kv_aware":  # the engine's "stored" events reach the index
            kv = router.dispatcher.policy
            with trio.fail_after(10):
                while not kv.index.follows(home[0]):  # type: ignore[attr-defined]
                    await trio.sleep(0.02)
        for i, question in enumerate(["and in the winter?", "is it cold?", "why so?"]):
            answer = await ask(client, question)
            assert served(router)[home[0]] == i + 2  # the same backend every time
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 0.7 * answer["usage"]["prompt_tokens"], answer["usage"]
    if policy == "kv_aware":
        stats = kv.statistics()  # type: ignore[attr-defined]
        assert stats.hits == 3 and stats.predicted_cached_tokens > 0
        assert stats.checked == 4 and stats.agreed == 4  # the engine's cached_tokens, predicted


async def test_round_robin_spreads_the_same_requests_and_misses(nursery: trio.Nursery, tok_gguf: Path) -> None:
    router, client = await engines_router(nursery, tok_gguf, "round_robin")
    async with client:
        answers = [await ask(client, q) for q in ("what is in the well?", "and in the winter?", "is it cold?")]
    assert set(served(router).values()) == {1}
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0, 0]


async def test_kv_aware_over_cache_model_mocks_predicts_what_they_report(nursery: trio.Nursery) -> None:
    """Mocks with the prefix-cache model publish KV events with the mock's
    byte tokenizer ("bytes" in /v1/models): the router's keys are the mocks'
    own, and what kv_aware predicts as cached is what the mocks report."""
    _, client, kv = await mocks_router(nursery, 3, cache_blocks=256)
    reported = 0
    async with client:
        for group in range(4):
            for turn in range(3):
                msgs = [{"role": "system", "content": f"[{group}] " + SYSTEM},
                        {"role": "user", "content": f"question {turn}"}]
                r = await client.post("/v1/chat/completions", json={"model": "mock", "messages": msgs, "max_tokens": 2})
                assert r.status_code == 200, r.text
                reported += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                with trio.fail_after(5):  # let the stored events land before the next turn
                    while sum(kv.index.statistics().backends.values()) == 0:  # type: ignore[attr-defined]
                        await trio.sleep(0.01)
                await trio.sleep(0.05)
        listed = (await client.get("/admin/routing")).json()
    assert listed["data"][0]["policy"] == "kv_aware" and listed["data"][0]["statistics"]["checked"] == 12
    assert listed["keys"]["models"]["mock"] and listed["keys"]["requests"]["tokens"] == 12  # the mocks' own tokens
    stats = kv.statistics()  # type: ignore[attr-defined]
    assert stats.hits == 8  # every turn after a group's first
    assert reported > 0 and abs(stats.predicted_cached_tokens - reported) <= 0.05 * reported
    # Request by request, the prediction at the pick is what the mock reported.
    assert stats.checked == 12 and stats.agreed >= 0.95 * stats.checked


async def test_kv_aware_predicts_the_evictions_of_prompts_queued_before_the_backends_events(nursery: trio.Nursery) -> None:
    """One mock whose cache holds about 1.5 system prompts, its prefill lane
    slow enough that a request sent while another is prefilling waits
    behind it: A is cached (the mock's events say so), then B (a new prompt)
    and A' (A's prompt again) are sent while B prefills. B's store evicts
    A's tail before A' is looked up, and no event says so until after A'
    was routed; the router knows the mock's capacity from /v1/models and
    predicts the part of A left, which is what the mock reports."""
    router, client, kv = await mocks_router(nursery, 1, client_timeout=20, cache_blocks=40, prefill_s_per_token=0.001)
    assert router.actors[0].view().cache_blocks == 40  # from the mock's /v1/models
    cached: dict[str, int] = {}

    async def send(label: str, system: str) -> None:
        cached[label] = await cached_tokens(client, system)

    a, b = "[A] " + SYSTEM, "[B] " + SYSTEM[::-1]  # ~26 blocks each
    async with client:
        await send("A", a)
        with trio.fail_after(5):  # A's stored events are in the index
            while not kv.index.statistics().backends.get("m0"):  # type: ignore[attr-defined]
                await trio.sleep(0.01)
        async with trio.open_nursery() as inner:
            inner.start_soon(send, "B", b)
            with trio.fail_after(5):
                while router.actors[0].in_flight == 0:  # B is on its way to the lane
                    await trio.sleep(0.005)
            await trio.sleep(0.05)
            inner.start_soon(send, "A'", a)
    stats = kv.statistics()  # type: ignore[attr-defined]
    assert cached["B"] == 0 and 0 < cached["A'"] < 16 * 26  # A's head survived B, its tail did not
    assert stats.model_evictions > 0
    assert (stats.checked, stats.over, stats.under) == (3, 0, 0)  # the index alone predicted all of A


async def test_kv_aware_predicts_a_hit_on_a_prompt_still_prefilling_where_the_backend_shares_it(nursery: trio.Nursery) -> None:
    """A mock prefills in arrival order (``prefix_sharing`` in /v1/models):
    A' sent while A, with the same new prompt, is still prefilling finds
    A's blocks cached at its turn, before any event of them reached the
    router. The prediction at A''s pick says so (from what was sent)."""
    router, client, kv = await mocks_router(nursery, 1, client_timeout=20, cache_blocks=400, prefill_s_per_token=0.001)
    assert router.actors[0].view().prefix_sharing
    cached: dict[str, int] = {}

    async def send(label: str) -> None:
        cached[label] = await cached_tokens(client, "[A] " + SYSTEM)

    async with client, trio.open_nursery() as inner:
        inner.start_soon(send, "A")
        with trio.fail_after(5):
            while router.actors[0].in_flight == 0:
                await trio.sleep(0.005)
        await trio.sleep(0.05)
        assert not kv.index.statistics().backends.get("m0")  # type: ignore[attr-defined]  # no event of A yet
        inner.start_soon(send, "A'")
    stats = kv.statistics()  # type: ignore[attr-defined]
    assert cached["A"] == 0 and cached["A'"] >= 16 * 20
    assert (stats.checked, stats.over, stats.under) == (2, 0, 0)  # A' was predicted cached (under before)


def test_a_backend_two_groups_share_feeds_both_policies_in_step() -> None:
    from policies.kv_aware import KVAware
    from tests.policies.test_kv_aware import stored

    a, b = KVAware(), KVAware()
    assert kv_sink_for("x", [(a, ("x",)), (KVAware.__new__(KVAware), ("y",))]) is a
    fan = kv_sink_for("x", [(a, None), (b, ("x", "y"))])
    assert isinstance(fan, KVFanOut)
    assert fan.on_kv_events("x", [stored(1, 7, 8)], 0.0)
    assert a.index.match([7, 8], ["x"]) == b.index.match([7, 8], ["x"]) == {"x": 2}
    b.on_kv_reset("x")  # out of step: the fan-out resets both and asks for everything
    assert fan.kv_since("x") == -1 and a.index.match([7, 8], ["x"]) == {}


async def test_a_models_configured_tokenizer_gives_the_engines_keys_without_learning(nursery: trio.Nursery, tok_gguf: Path) -> None:
    """``[[models]] tokenizer = PATH``: the keys are token blocks from that
    file even though the backend (a plain mock) names no tokenizer; a path
    that cannot be read leaves the model on text blocks, with one warning."""
    mock = await serve_mock(nursery, MockConfig(name="m", models=("tiny",)), [])
    config = decode_config({"backends": [{"kind": "mock", "name": "m"}],
                            "models": [{"name": "tiny", "tokenizer": str(tok_gguf)},
                                       {"name": "other", "tokenizer": "/nonexistent.gguf"}],
                            "health": {"interval": 0.2}})
    router = Router(config, [NamedBackend("m", OpenAIHTTPBackend(mock.url, name="m"))])
    await serve_router(nursery, router)
    with trio.fail_after(20):
        while not router.keys.statistics().models.get("tiny", "").startswith("config"):
            await trio.sleep(0.05)
    request = GenerateRequest(model="tiny", messages=[ChatMessage(role="system", content=SYSTEM),
                                                      ChatMessage(role="user", content="hi")])
    keys = router.keys.keys(request)
    engine = fake_engine_backend(load_tokenizer(str(tok_gguf)), model=str(tok_gguf))
    assert keys.source == "tokens" and keys.block_hashes == tuple(chain_hashes(engine.prompt_ids(request), 16))
    assert router.keys.keys(msgspec.structs.replace(request, model="other")).source == "text"


async def test_an_in_process_mock_names_its_byte_tokenizer_so_keys_are_its_own() -> None:
    from backends.mock import MockBackend, encode_text, render_chat
    from router.prefix_keys import PrefixKeys

    mock = MockBackend(MockConfig(name="m", models=("mock",), block_size=16))
    keys = PrefixKeys()
    await keys.learn(mock, mock.info())
    request = GenerateRequest(model="mock", messages=[ChatMessage(role="user", content=SYSTEM)])
    assert keys.keys(request).block_hashes == tuple(chain_hashes(encode_text(render_chat(request.messages or [])), 16))

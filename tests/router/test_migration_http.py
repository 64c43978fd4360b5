"""Stream migration through the real router over HTTP/2 on 127.0.0.1, with
faults injected at the HTTP level by real mock servers (issue 14).

Each mock fault, beside a healthy mock: every answer is the exact,
complete, uninterrupted one (the healthy mock answered directly is the
reference), streaming and not, chat and completions; a mock that reports no
token ids is replayed and verified; a mock that answers differently on
replay gives the clean terminal error (in-band, no ``[DONE]``; 502 when not
streaming); the openai SDK sees one ordinary stream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio

from backends.mock import Fault, MockConfig, parse_fault
from backends.openai_http import OpenAIHTTPBackend
from router.app import NamedBackend, Router
from router.config import decode_config
from tests.backends.conftest import serve_mock
from tests.router.test_integration import serve_router

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"model": "mock", "prompt": "the mill", "max_tokens": 24, "seed": 5, "stop": [" grain flour"]}
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 24, "seed": 9}


def data_lines(sse: str) -> list[str]:
    return [line.removeprefix("data: ") for line in sse.splitlines() if line.startswith("data: ")]


def streamed_text(sse: str, chat: bool) -> str:
    out = []
    for d in data_lines(sse):
        if d == "[DONE]":
            continue
        obj = json.loads(d)
        for c in obj.get("choices", []):
            out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text", ""))
    return "".join(out)


async def router_with(nursery: trio.Nursery, faulty: MockConfig, faults: list[Fault], healthy: MockConfig | None = None,
                      migration: dict[str, Any] | None = None) -> tuple[Router, str, str]:  # fmt: skip
    bad = await serve_mock(nursery, faulty, faults)
    good = await serve_mock(nursery, healthy or MockConfig(name="good"), [])
    backends = [NamedBackend("bad", OpenAIHTTPBackend(bad.url, name="bad")), NamedBackend("good", OpenAIHTTPBackend(good.url, name="good"))]
    config = decode_config({"routing": {"policy": "round_robin"}, "migration": migration or {}, "breaker": {"enabled": False}})
    router = Router(config, backends)
    return router, await serve_router(nursery, router), good.url


async def answers(url: str, path: str, body: dict[str, Any], n: int) -> list[tuple[int, str]]:
    """``n`` streamed answers (round robin: half start on the faulty mock)."""
    out = []
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=20) as client:
        for _ in range(n):
            async with client.stream("POST", path, json={**body, "stream": True}) as r:
                out.append((r.status_code, (await r.aread()).decode()))
    return out


@pytest.mark.parametrize("fault", ["cut-after=5", "malformed-after=5", "no-final", "stall-after=5", "status=500"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_every_answer_is_exact_and_complete_beside_a_faulty_mock(nursery: trio.Nursery, fault: str, kind: str) -> None:
    chat = kind == "chat"
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    router, url, good = await router_with(nursery, MockConfig(name="bad"), [parse_fault(fault)], migration={"stall_timeout": 0.5})
    async with httpx.AsyncClient(base_url=good, timeout=20) as direct:
        reference = (await direct.post(path, json=body)).json()
    want = reference["choices"][0]["message"]["content"] if chat else reference["choices"][0]["text"]
    assert want
    for status, sse in await answers(url, path, body, 4):
        assert status == 200
        lines = data_lines(sse)
        assert lines[-1] == "[DONE]", sse[-300:]
        assert streamed_text(sse, chat) == want
        finals = [c.get("finish_reason") for d in lines[:-1] for c in json.loads(d).get("choices", [])]
        assert finals[-1] == reference["choices"][0]["finish_reason"] and all(f is None for f in finals[:-1])
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=20) as client:
        for _ in range(2):  # not streaming: migrated behind the scenes
            r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"] == reference["choices"] and got["usage"] == reference["usage"]
    migrations = router.dispatcher.statistics().migration.migrations
    if fault == "status=500":  # before the first byte: a retry, never a migration
        assert migrations == {}
    else:
        assert sum(migrations.values()) >= 2 and all(k.endswith(":resumed") for k in migrations), migrations


async def test_no_done_after_the_final_event_is_a_complete_answer(nursery: trio.Nursery) -> None:
    router, url, good = await router_with(nursery, MockConfig(name="bad"), [parse_fault("no-done")])
    async with httpx.AsyncClient(base_url=good, timeout=20) as direct:
        want = (await direct.post("/v1/completions", json=COMPLETION)).json()["choices"][0]["text"]
    for status, sse in await answers(url, "/v1/completions", COMPLETION, 4):
        assert status == 200 and data_lines(sse)[-1] == "[DONE]" and streamed_text(sse, False) == want
    assert router.dispatcher.statistics().migration.migrations == {}  # nothing was broken


async def test_a_backend_without_token_ids_is_replayed_and_verified(nursery: trio.Nursery) -> None:
    router, url, good = await router_with(
        nursery, MockConfig(name="bad", token_ids=False), [parse_fault("cut-after=6")], healthy=MockConfig(name="good", token_ids=False)
    )
    async with httpx.AsyncClient(base_url=good, timeout=20) as direct:
        want = (await direct.post("/v1/completions", json=COMPLETION)).json()["choices"][0]["text"]
    for status, sse in await answers(url, "/v1/completions", COMPLETION, 4):
        assert status == 200 and data_lines(sse)[-1] == "[DONE]" and streamed_text(sse, False) == want
    assert router.dispatcher.statistics().migration.migrations == {"broken:replayed": 2}


async def test_a_replay_that_diverges_ends_with_the_terminal_error(nursery: trio.Nursery) -> None:
    router, url, _ = await router_with(
        nursery, MockConfig(name="bad", token_ids=False), [parse_fault("cut-after=6")],
        healthy=MockConfig(name="good", token_ids=False, faults=(parse_fault("diverge"),)),
    )  # fmt: skip
    got = await answers(url, "/v1/completions", COMPLETION, 2)
    broken = [sse for _, sse in got if data_lines(sse)[-1] != "[DONE]"]
    assert len(broken) == 1  # the one that started on the faulty mock
    error = json.loads(data_lines(broken[0])[-1])["error"]
    assert error["code"] == "replay_diverged"
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=20) as client:
        statuses = [(await client.post("/v1/completions", json=COMPLETION)).status_code for _ in range(2)]
    assert sorted(statuses) == [200, 502]
    stats = router.dispatcher.statistics().migration
    assert stats.divergences == 2 and stats.migrations == {"broken:failed": 2}


async def test_the_openai_sdk_sees_one_ordinary_stream(nursery: trio.Nursery) -> None:
    router, url, good = await router_with(nursery, MockConfig(name="bad"), [parse_fault("cut-after=4")])

    def use_sdk() -> tuple[list[str], str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        direct = openai.OpenAI(base_url=good + "/v1", api_key="none", max_retries=0)
        want = direct.chat.completions.create(model="mock", messages=CHAT["messages"], max_tokens=24, seed=9)  # type: ignore[arg-type]
        texts = []
        for _ in range(2):
            chunks = list(client.chat.completions.create(model="mock", messages=CHAT["messages"], max_tokens=24, seed=9, stream=True))  # type: ignore[arg-type]
            assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        return texts, want.choices[0].message.content or ""

    texts, want = await trio.to_thread.run_sync(use_sdk)
    assert texts == [want, want]
    assert router.dispatcher.statistics().migration.migrations == {"broken:resumed": 1}


async def test_migrations_show_in_metrics(nursery: trio.Nursery) -> None:
    _, url, _ = await router_with(nursery, MockConfig(name="bad"), [parse_fault("cut-after=3")])
    await answers(url, "/v1/completions", COMPLETION, 2)
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        text = (await client.get("/metrics")).text
    assert 'headrace_migrations_total{outcome="resumed",reason="broken"} 1.0' in text
    # The mocks model no prefix cache: the continuation reports 0 cached tokens.
    assert 'headrace_resume_gap_seconds_count{backend="good",prefix="missed"} 1.0' in text


async def test_n_choices_and_logprobs_survive_a_migration(nursery: trio.Nursery) -> None:
    """Each of n choices is its own stream: the ones that start on the faulty
    mock migrate, and the whole answer (texts, logprobs, offsets, usage) is
    the uninterrupted one."""
    router, url, good = await router_with(nursery, MockConfig(name="bad"), [parse_fault("cut-after=5")])
    body = {**COMPLETION, "n": 3, "logprobs": 2, "max_tokens": 16}
    async with httpx.AsyncClient(base_url=good, timeout=20) as direct:
        want = (await direct.post("/v1/completions", json=body)).json()
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=20) as client:
        for _ in range(2):
            got = (await client.post("/v1/completions", json=body)).json()
            assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    assert router.dispatcher.statistics().migration.migrations.get("broken:resumed", 0) >= 3

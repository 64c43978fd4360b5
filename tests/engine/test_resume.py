"""The engine side of stream migration's resume contract: a request whose prompt is
the original prompt plus its first k output tokens, with ``resumed_tokens=k`` and
``max_tokens`` / ``min_tokens`` reduced by k, produces exactly the events the
unbroken run produced after token k: the same ids, text, logprobs (text offsets
included), finish reason and usage, whatever the detokenizer and the stop matcher
were holding back at k (half a UTF-8 character, the start of a stop string).

Tiny random float32 model; every k of each generation is tried."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from backends.base import Event, GenerateRequest
from backends.engine.backend import EngineBackend, build_engine, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.sequence import SamplingParams
from backends.engine.server import run_server
from backends.engine.tokenizer import Tokenizer
from backends.errors import BadRequest
from backends.openai_http import OpenAIHTTPBackend
from frontend.serving import ServeOptions

PROMPT = [5, 70, 100, 200, 33]
# Seed 11 of this prompt on the tiny model: 24 random bytes, among them three UTF-8
# characters split across tokens (checked by _split_characters, not assumed).
SEEDED = GenerateRequest(
    prompt_token_ids=PROMPT,
    max_tokens=24,
    min_tokens=10,
    temperature=1.0,
    top_p=0.95,
    seed=11,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    logprobs=2,
)
GREEDY = GenerateRequest(
    prompt_token_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0
)


def _config(path: Path, **kw: object) -> EngineConfig:
    base: dict[str, object] = {
        "model": str(path),
        "num_kv_blocks": 256,
        "block_size": 4,
        "max_model_len": 128,
    }
    return EngineConfig(**(base | kw))  # type: ignore[arg-type]


async def _collect(backend: EngineBackend, request: GenerateRequest) -> list[Event]:
    return [e async for e in backend.stream(request)]


def _ids(events: list[Event]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _resume(request: GenerateRequest, events: list[Event], k: int) -> GenerateRequest:
    """What the router sends after relaying the first k tokens of ``events``."""
    assert request.prompt_token_ids is not None and request.max_tokens is not None
    return msgspec.structs.replace(
        request,
        prompt_token_ids=request.prompt_token_ids + _ids(events)[:k],
        resumed_tokens=k,
        max_tokens=request.max_tokens - k,
        min_tokens=max(0, request.min_tokens - k),
        seed=events[0].seed,
    )


def _same_event(got: Event, want: Event) -> None:
    assert (got.token_ids, got.text, got.logprobs, got.finish_reason) == (
        want.token_ids,
        want.text,
        want.logprobs,
        want.finish_reason,
    )
    if want.usage is not None:
        assert got.usage is not None
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            want.usage.prompt_tokens,
            want.usage.completion_tokens,
        )
        assert got.usage.cached_tokens <= got.usage.prompt_tokens


async def _check_every_resume_point(
    backend: EngineBackend, request: GenerateRequest, full: list[Event]
) -> None:
    """Resume after each event but the last (one token per event here, so at
    every k in 1..n-1): the resumed events are the unbroken run's remaining ones."""
    n = len(_ids(full))
    assert [len(e.token_ids) for e in full] == [1] * n  # so every k is an event boundary
    for k in range(1, n):
        resumed = await _collect(backend, _resume(request, full, k))
        assert resumed[0].prompt_token_ids == request.prompt_token_ids
        assert resumed[0].seed == full[0].seed
        assert len(resumed) == n - k
        for got, want in zip(resumed, full[k:], strict=True):
            _same_event(got, want)
        text = "".join(e.text for e in full[:k]) + "".join(e.text for e in resumed)
        assert text == "".join(e.text for e in full)


def _split_characters(tok: Tokenizer, ids: list[int]) -> list[int]:
    """The k at which a valid multi-byte UTF-8 character is cut: token k-1 ends
    with its lead byte and token k begins with the rest."""
    pieces = [tok.token_piece(t)[1] for t in ids]
    out = []
    for k in range(1, len(ids)):
        before, after = pieces[k - 1], pieces[k]
        if before and 0xC2 <= before[-1] <= 0xF4:
            width = 2 if before[-1] < 0xE0 else 3 if before[-1] < 0xF0 else 4
            try:
                (before[-1:] + after[: width - 1]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(after) >= width - 1:
                out.append(k)
    return out


def _straddling_stop(full: list[Event]) -> tuple[str, int]:
    """A 3-character string of the output, first seen where an event boundary
    (a resume point) cuts it, a few characters in: (it, where it starts)."""
    text = "".join(e.text for e in full)
    bounds, at = set(), 0
    for e in full:
        at += len(e.text)
        bounds.add(at)
    for start in range(3, len(text) - 3):
        stop = text[start : start + 3]
        if text.find(stop) == start and "\ufffd" not in stop and bounds & {start + 1, start + 2}:
            return stop, start
    raise AssertionError("no stop string straddles a resume point")  # pragma: no cover


async def test_a_seeded_request_with_penalties_min_tokens_and_logprobs_resumes_exactly_at_every_k(
    tiny_gguf: Path,
) -> None:
    """Presence, frequency and repetition penalties and ``min_tokens`` count the k
    earlier tokens as output; the text cut inside a multi-byte character at k is
    held back and completed as in the unbroken run; text offsets continue."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        full = await _collect(backend, SEEDED)
        assert full[-1].finish_reason == "length" and len(_ids(full)) == 24
        splits = _split_characters(tok, _ids(full))
        assert splits  # the case this test is for
        for k in splits:  # the character is held back at k, and completed after it
            assert full[k - 1].text == "" or not full[k - 1].text.endswith("\ufffd")
        await _check_every_resume_point(backend, SEEDED, full)


async def test_a_stop_string_that_straddles_the_resume_point_still_stops_the_stream(
    tiny_gguf: Path,
) -> None:
    """The stop matcher holds back the start of the stop string at k; the resumed
    stream completes the match and ends there, without the stop text."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        unstopped = await _collect(backend, SEEDED)
        stop, start = _straddling_stop(unstopped)
        request = msgspec.structs.replace(SEEDED, stop=["never seen here", stop])
        full = await _collect(backend, request)
        assert full[-1].finish_reason == "stop"
        assert "".join(e.text for e in full) == "".join(e.text for e in unstopped)[:start]
        await _check_every_resume_point(backend, request, full)


async def test_a_greedy_request_resumes_exactly_at_every_k(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        full = await _collect(backend, GREEDY)
        assert full[-1].finish_reason == "length" and len(_ids(full)) == 16
        await _check_every_resume_point(backend, GREEDY, full)


async def test_min_tokens_counts_the_earlier_tokens_as_generated(tiny_gguf: Path) -> None:
    """Every token but ten is a stop token: ``min_tokens`` masks them, so the
    generation draws from the ten for exactly ``min_tokens`` tokens and stops at
    the next one. Resumed at any k (``min_tokens`` reduced by k), it stops there too."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    allowed = set(tok.encode("abcdefghij", add_special_tokens=False))
    assert len(allowed) == 10
    request = msgspec.structs.replace(
        SEEDED,
        max_tokens=16,
        min_tokens=6,
        stop_token_ids=[t for t in range(tok.vocab_size) if t not in allowed],
    )
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        full = await _collect(backend, request)
        ids = _ids(full)
        assert set(ids[:6]) <= allowed and ids[6] not in allowed
        assert full[-1].finish_reason == "stop" and len(ids) == 7
        await _check_every_resume_point(backend, request, full)


async def test_resume_without_max_tokens_continues_the_default_budget(tiny_gguf: Path) -> None:
    """No ``max_tokens``: the resumed request gets what the unbroken run's default
    left (``default_max_tokens - k``), so both stop at the same token; when the k
    earlier tokens used it all, one final event says ``length``."""
    engine, tok, name = build_engine(_config(tiny_gguf, default_max_tokens=6))
    request = msgspec.structs.replace(GREEDY, max_tokens=None)
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        full = await _collect(backend, request)
        assert len(_ids(full)) == 6
        resumed = await _collect(
            backend,
            msgspec.structs.replace(
                request, prompt_token_ids=PROMPT + _ids(full)[:2], resumed_tokens=2
            ),
        )
        assert _ids(resumed) == _ids(full)[2:]
        done = await _collect(
            backend,
            msgspec.structs.replace(request, prompt_token_ids=PROMPT + _ids(full), resumed_tokens=6),
        )
    assert [(e.token_ids, e.text, e.finish_reason) for e in done] == [([], "", "length")]
    assert done[0].usage is not None and done[0].usage.completion_tokens == 6


async def test_earlier_output_that_already_holds_a_stop_string_ends_at_once(
    tiny_gguf: Path,
) -> None:
    """Not a resume the router sends (that stream had ended), but an answer: one
    final event, no tokens, ``stop``; the engine is not asked."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        full = await _collect(backend, GREEDY)
        text = "".join(e.text for e in full)
        k = next(k for k in range(1, 16) if "".join(e.text for e in full[:k]).strip())
        stop = "".join(e.text for e in full[:k]).strip()[-1]
        request = msgspec.structs.replace(GREEDY, stop=[stop])
        events = await _collect(backend, _resume(request, full, k))
        steps = engine.statistics().num_steps
    assert stop in text
    assert [(e.token_ids, e.text, e.finish_reason) for e in events] == [([], "", "stop")]
    assert events[0].prompt_token_ids == PROMPT
    assert engine.statistics().num_steps == steps


async def test_bad_resumed_tokens_are_a_client_error(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        for bad in (
            GenerateRequest(prompt_token_ids=[1, 2], resumed_tokens=2, max_tokens=2),
            GenerateRequest(prompt_token_ids=[1, 2], resumed_tokens=-1, max_tokens=2),
            GenerateRequest(prompt="hello", resumed_tokens=1, max_tokens=2),
        ):
            with pytest.raises(BadRequest) as info:
                await _collect(backend, bad)
            assert info.value.param == "resumed_tokens"
        with pytest.raises(BadRequest) as info:
            engine.add_request("x", [1, 2], SamplingParams(max_tokens=2), resumed_tokens=2)
        assert info.value.param == "resumed_tokens"


# ---- over HTTP ------------------------------------------------------------------------


@pytest.fixture
async def server(tiny_gguf: Path) -> AsyncIterator[tuple[str, EngineBackend]]:
    engine, tok, name = build_engine(_config(tiny_gguf))
    backend = EngineBackend(engine, tok, model_name=name)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server, backend, ServeOptions("127.0.0.1", 0), shutdown)
        yield url, backend
        shutdown.set()


async def _stream(client: httpx.AsyncClient, body: dict[str, object]) -> list[dict[str, Any]]:
    """The choices of a streamed completion's chunks that carry tokens."""
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
    return [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]


async def test_a_resumed_completion_over_http_gives_the_continuation(
    server: tuple[str, EngineBackend],
) -> None:
    """``prompt`` as ids plus ``resumed_tokens``: the text after the k tokens, the
    usage of the whole generation; a bad ``resumed_tokens`` is a 400 naming it;
    ``/v1/models`` says the engine resumes exactly."""
    url, _ = server
    body = {
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0.8,
        "seed": 5,
        "presence_penalty": 0.4,
        "return_token_ids": True,
        "logprobs": 1,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=url) as client:
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["exact_resume"] for m in models] == [True]
        assert [m["token_ids"] for m in models] == [True]  # so an "auto" adapter resumes by ids at once
        adapter = OpenAIHTTPBackend(url, token_ids="auto")
        info = await adapter.refresh()
        assert info.token_ids and info.exact_resume
        await adapter.aclose()
        whole = await _stream(client, body)
        ids = [t for c in whole for t in c["token_ids"]]
        assert [len(c["token_ids"]) for c in whole] == [1] * 10
        k = 4
        resumed_body = body | {"prompt": PROMPT + ids[:k], "max_tokens": 10 - k, "resumed_tokens": k}
        resumed = (await client.post("/v1/completions", json=resumed_body)).json()
        choice = resumed["choices"][0]
        assert choice["token_ids"] == ids[k:]
        assert choice["prompt_token_ids"] == PROMPT
        assert choice["text"] == "".join(c["text"] for c in whole[k:])
        offsets = [o for c in whole for o in c["logprobs"]["text_offset"]]
        assert choice["logprobs"]["text_offset"] == offsets[k:]
        assert resumed["usage"]["prompt_tokens"] == len(PROMPT)
        assert resumed["usage"]["completion_tokens"] == 10
        for bad in (
            {"resumed_tokens": len(PROMPT) + k},
            {"resumed_tokens": -1},
            {"prompt": "text", "resumed_tokens": 1},
        ):
            r = await client.post("/v1/completions", json=resumed_body | bad)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "resumed_tokens"
        chat = {"messages": [{"role": "user", "content": "hi"}], "resumed_tokens": 1}
        r = await client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "resumed_tokens"

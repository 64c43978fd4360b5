"""The mock's fast path answers byte for byte what the shared frontend
answers (ids and timestamps aside), for every request shape it takes, and
hands every other shape, and every error, to the frontend's own answer."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from backends.mock import MockBackend, MockConfig
from backends.mock_http import serve_lean
from backends.mock_server import FastPath, build_app
from frontend.serving import ServeOptions, serve

PROMPT = "the river runs under a stone bridge"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi é ☃"}]
USAGE = {"stream_options": {"include_usage": True}}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, **USAGE}),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": False}}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True, "seed": 3}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.8}),  # drawn seed
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, **USAGE}),
    ("/v1/completions", {"prompt": [5, 6, 7, 300], "max_tokens": 3, "return_token_ids": True}),
    ("/v1/completions", {"prompt": "a\n\"quoted\" \\ tab\t", "model": "", "max_tokens": 3}),
    ("/v1/completions", {"prompt": PROMPT, "model": "mock", "max_tokens": 12, "stop": [" a"]}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop_token_ids": [256, 257, 258]}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "priority": 2}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 3, **USAGE}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 9, "stop": "a"}),
    ("/v1/generate", {"prompt": PROMPT, "max_tokens": 4}),
    ("/v1/generate", {"prompt_token_ids": [1, 2, 3], "max_tokens": 2, "seed": 7, **USAGE}),
    ("/v1/generate", {"messages": MSGS, "max_tokens": 1}),
    # resumed (stream migration's continuation): the last ids are earlier output
    ("/v1/completions", {"prompt": [5, 6, 7, 300, 301], "resumed_tokens": 2, "max_tokens": 3,
                         "return_token_ids": True, "seed": 3, **USAGE}),
    ("/v1/completions", {"prompt": [5, 6, 7, 300, 301], "resumed_tokens": 2, "max_tokens": 6,
                         "stop": [" wheel", "zz"], "seed": 3}),
    ("/v1/generate", {"prompt_token_ids": [1, 2, 300], "resumed_tokens": 1, "max_tokens": 2}),
    # left to the frontend: shapes the fast path does not render (FALLBACKS)
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "seed": 1}),
    ("/v1/completions", {"prompt": [PROMPT, "other"], "max_tokens": 3, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "logprobs": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": False}),
    # errors, answered as the frontend answers them (ERRORS)
    ("/v1/completions", {"prompt": PROMPT, "model": "nope"}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 100}),  # over max_context
    ("/v1/completions", {"prompt": 5}),
    ("/v1/generate", {"prompt_token_ids": [-1], "max_tokens": 1}),
    ("/v1/generate", {"prompt": "a", "prompt_token_ids": [1]}),
]

FALLBACKS, ERRORS = 5, 6


def _normal(text: str) -> str:
    text = re.sub(r'"id":"(cmpl|chatcmpl|gen)-[0-9a-f]+(-\d+)?"', r'"id":"\1-X\2"', text)
    return re.sub(r'"created":\d+', '"created":0', text)


async def _answers(
    nursery: trio.Nursery, config: MockConfig, fast: bool, server: str = "hypercorn"
) -> list[Any]:
    backend = MockBackend(config)
    app = build_app(backend, fast=fast)
    handed_over: list[str] = []
    if fast:
        assert isinstance(app.fast, FastPath)
        frontend = app.fast.fallback

        async def counting(scope: dict[str, Any], receive: Any, send: Any) -> None:
            handed_over.append(scope["path"])
            await frontend(scope, receive, send)

        app.fast.fallback = counting
    if server == "lean":  # as headrace mock serves it: answer_now first, then the app
        run = partial(serve_lean, app, ServeOptions(), answer_now=app.answer_now)
        url = await nursery.start(run)
    else:
        url = await nursery.start(serve, app, ServeOptions())
    out: list[Any] = [len(handed_over)]
    async with httpx.AsyncClient(base_url=url, http2=True, http1=False) as client:
        for path, body in CASES:
            body = {"stream": True, **body}
            if body["prompt"] == 5 if "prompt" in body else False:
                r = await client.post(path, content=b'{"prompt": 5, "stream": true')
            else:
                r = await client.post(path, json=body)
            headers = {k: v for k, v in r.headers.items()
                       if k not in ("date", "server", "content-length")}
            text = _normal(r.text)
            several = isinstance(body.get("prompt"), list) and len(body["prompt"]) == 2
            if body.get("n", 1) > 1 or several:
                text = "\n".join(sorted(text.split("\n")))  # the frontend interleaves choices
            out.append((path, body, r.status_code, headers, text))
    out.append(backend.statistics())
    out[0] = len(handed_over)
    return out


@pytest.mark.parametrize("server", ["hypercorn", "lean"])
@pytest.mark.parametrize(
    "config",
    [MockConfig(max_context=160), MockConfig(max_context=160, tpot_s=0.001, ttft_s=0.002)],
    ids=["burst", "paced"],
)
async def test_the_fast_path_answers_exactly_as_the_frontend(
    nursery: trio.Nursery, config: MockConfig, server: str
) -> None:
    fast = await _answers(nursery, config, fast=True, server=server)
    slow = await _answers(nursery, config, fast=False)
    assert fast[0] == FALLBACKS and slow[0] == 0
    for got, want in zip(fast[1:], slow[1:], strict=True):
        assert got == want
    assert fast[-1].completed == len(CASES) - ERRORS + 2 and fast[-1].rejected == 1  # n=2: 2 streams


async def test_without_token_ids_the_fast_path_still_answers_as_the_frontend(
    nursery: trio.Nursery,
) -> None:
    """``--no-token-ids``: neither path sends ids (asked for or not), and the
    native route is a 404 from both."""
    config = MockConfig(max_context=160, token_ids=False)
    fast = await _answers(nursery, config, fast=True, server="lean")
    slow = await _answers(nursery, config, fast=False)
    natives = sum(path == "/v1/generate" for path, _ in CASES)
    assert fast[0] == FALLBACKS + natives
    for got, want in zip(fast[1:-1], slow[1:-1], strict=True):
        assert got == want
        path, _, status, _, text = got
        assert '"token_ids"' not in text, (path, status, text)
        if path == "/v1/generate":
            assert status == 404 and "reports no token ids" in text, text

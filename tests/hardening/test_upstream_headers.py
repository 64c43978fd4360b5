"""Backends receive an allow-list of headers, never the client's: a request
to ``headrace serve`` carrying credentials, cookies, proxy and tracing
headers reaches a capturing upstream (over HTTP/2 and HTTP/1.1) with only
what the router's adapter writes itself (content type, accept, length, the
backend's own key), the request id, which is the client's only when it
is a sane token, and a ``traceparent`` of the router's own (the client's
trace, the router's attempt span: issue 18)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from backends.mock import MockBackend, MockConfig
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.hardening.harness import start_router

pytestmark = pytest.mark.timeout(120)
UPSTREAM_KEY = "sk-upstream-own-key"
HOSTILE = {
    "authorization": "Bearer sk-client-secret",
    "cookie": "session=client-cookie",
    "proxy-authorization": "Basic Y2xpZW50",
    "x-api-key": "client-api-key",
    "x-forwarded-for": "10.9.8.7",
    "forwarded": "for=10.9.8.7",
    "x-real-ip": "10.9.8.7",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "user-agent": "client-agent/6.6",
    "x-custom": "client-value",
    "accept-language": "fr",
}
# What the router's HTTP adapter may send upstream (h2client or httpx write
# the framing and transport headers themselves).
ALLOWED = {"content-type", "accept", "content-length", "x-request-id", "authorization",
           "host", "accept-encoding", "connection", "user-agent", "traceparent"}  # fmt: skip


class Capturing:
    """An OpenAI mock that records the headers of every generation request."""

    def __init__(self) -> None:
        self.app = OpenAIServer(MockBackend(MockConfig(models=("mock",), max_tokens=4)))
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            self.seen.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@pytest.mark.parametrize("http", ["2", "1.1"])
async def test_backends_get_only_the_allowed_headers_never_the_clients(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, http: str
) -> None:
    upstream = Capturing()
    url = await nursery.start(serve, upstream, ServeOptions(graceful_timeout=0.1))
    monkeypatch.setenv("HEADRACE_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    router = await start_router(nursery, tmp_path, [url],
                                {"backends.0.options": {"http": http, "api_key_env": "HEADRACE_TEST_UPSTREAM_KEY"}})  # fmt: skip
    completion = {"model": "mock", "prompt": "x", "max_tokens": 2}
    chat = {"model": "mock", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            for stream in (False, True):
                r = await client.post(path, content=json.dumps({**body, "stream": stream}),
                                      headers={**HOSTILE, "content-type": "application/json", "x-request-id": "client-req-42"})  # fmt: skip
                assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", content=json.dumps(completion),
                              headers={"content-type": "application/json", "x-request-id": "not a token " + "x" * 200})  # fmt: skip
        assert r.status_code == 200
    assert len(upstream.seen) == 5
    for headers in upstream.seen:
        names = {n for n in headers if not n.startswith(":")}
        assert names <= ALLOWED, names - ALLOWED
        assert headers.get("authorization") == f"Bearer {UPSTREAM_KEY}"  # the backend's own key, not the client's
        assert headers.get("user-agent") != HOSTILE["user-agent"]
        for value in HOSTILE.values():
            assert value not in headers.values()
    assert [h["x-request-id"] for h in upstream.seen[:4]] == ["client-req-42"] * 4
    # The client's trace goes on, under a span of the router's (never the client's header as sent).
    assert {h["traceparent"][3:35] for h in upstream.seen[:4]} == {HOSTILE["traceparent"][3:35]}
    fresh = upstream.seen[4]["x-request-id"]
    assert fresh and "not a token" not in fresh  # an unsafe id is replaced, not forwarded

"""Structured request logs (issue 18): one JSON line per request through the
real router over 127.0.0.1 to real mock servers, with tenant, model,
backend, status, token counts, timings and the latency phases, trace id,
migrations and error code; for a success, a 429 and a 503, a migrated
stream and a client that leaves; never an API key, a cookie or the prompt
unless ``log_prompts`` is on."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio

from backends.mock import MockConfig, parse_fault
from backends.openai_http import OpenAIHTTPBackend
from router.app import NamedBackend, Router
from router.config import decode_config
from router.logs import JsonFormatter
from router.server import config_from_args, parse_args
from tests.backends.conftest import serve_mock
from tests.router.test_integration import serve_router

pytestmark = pytest.mark.timeout(60)

KEY = "sk-team-a-never-logged-7d1e"
PROMPT = "the secret recipe is forty-two"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
BODY = {"model": "mock", "prompt": PROMPT, "max_tokens": 5, "stream": True}
PHASES = {"ingress", "queue", "connect", "prefill", "decode", "egress"}


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    formatter = JsonFormatter()
    return [json.loads(formatter.format(r)) for r in caplog.records if r.name == "headrace.requests"]


async def lines_after(caplog: pytest.LogCaptureFixture, n: int) -> list[dict[str, Any]]:
    """The request lines once ``n`` are written (the router writes one after
    the last byte, which the client may have read already)."""
    with trio.fail_after(5):
        while len(request_lines(caplog)) < n:
            await trio.sleep(0.005)
    return request_lines(caplog)


async def start(nursery: trio.Nursery, settings: dict[str, Any] | None = None, *, faults: str | None = None,
                **mock: Any) -> tuple[Router, str]:  # fmt: skip
    backends = []
    if faults is not None:
        bad = await serve_mock(nursery, MockConfig(name="bad", models=("mock",)), [parse_fault(faults)])
        backends.append(NamedBackend("bad", OpenAIHTTPBackend(bad.url, name="bad")))
    good = await serve_mock(nursery, MockConfig(name="good", models=("mock",), **mock))
    backends.append(NamedBackend("good", OpenAIHTTPBackend(good.url, name="good")))
    config = {"logging": {"format": "json"}, "routing": {"policy": "round_robin"}, "breaker": {"enabled": False},
              "auth": {"keys": {KEY: "team-a"}}, **(settings or {})}  # fmt: skip
    router = Router(decode_config(config), backends)
    return router, await serve_router(nursery, router)


def headers(**extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}", "cookie": "session=c00kie-value", "traceparent": TRACEPARENT, **extra}


async def test_a_success_is_one_line_with_its_tenant_tokens_timings_and_trace(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _, url = await start(nursery)
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        r = await client.post("/v1/completions", json=BODY, headers=headers(**{"x-request-id": "req-1"}))
        assert r.status_code == 200 and "[DONE]" in r.text
    (line,) = await lines_after(caplog, 1)
    assert line["msg"] == "request" and line["level"] == "INFO" and line["logger"] == "headrace.requests"
    assert line["ts"].endswith("Z")
    want = {
        "request_id": "req-1", "trace_id": TRACE, "route": "/v1/completions", "status": 200, "tenant": "team-a",
        "model": "mock", "backend": "good", "stream": True, "error_code": None, "migrations": 0, "attempts": 1,
    }  # fmt: skip
    assert {k: line[k] for k in want} == want
    assert line["key_id"] and len(line["key_id"]) == 12
    assert line["completion_tokens"] == 5 and line["prompt_tokens"] > 0
    assert set(line["phases_ms"]) == PHASES
    assert all(v >= 0 for v in line["phases_ms"].values())
    # The phases add up to the request's time (each is a difference of the same clock's readings).
    assert sum(line["phases_ms"].values()) == pytest.approx(line["duration_ms"], abs=max(1.0, 0.05 * line["duration_ms"]))
    assert 0 < line["ttft_ms"] <= line["duration_ms"]


async def test_refusals_are_logged_with_their_status_and_code(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant over its rate (429 rate_limited) and a model group whose
    only backend is down (503): a line each, no backend, no tokens."""
    caplog.set_level(logging.INFO)
    _, url = await start(nursery, {"tenants": {"team-a": {"requests_per_minute": 1}}})
    down = Router(decode_config({"logging": {"format": "json"}, "health": {"interval": 60}}),
                  [NamedBackend("gone", OpenAIHTTPBackend("http://127.0.0.1:9", name="gone"))])  # fmt: skip
    down_url = await serve_router(nursery, down)
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        assert (await client.post("/v1/completions", json=BODY, headers=headers())).status_code == 200
        r = await client.post("/v1/completions", json=BODY, headers=headers())
        assert r.status_code == 429
    async with httpx.AsyncClient(base_url=down_url, timeout=20) as client:
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 503
    lines = await lines_after(caplog, 3)
    limited = next(x for x in lines if x["status"] == 429)
    assert limited["error_code"] == "rate_limited" and limited["backend"] is None and limited["tenant"] == "team-a"
    assert limited["completion_tokens"] == 0 and set(limited["phases_ms"]) == {"ingress", "queue"}
    unavailable = next(x for x in lines if x["status"] == 503)
    assert unavailable["error_code"] in ("no_healthy_backend", "backend_unavailable")
    assert unavailable["tenant"] == "default"


async def test_a_migrated_stream_says_how_many_times_it_moved(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _, url = await start(nursery, faults="cut-after=2")
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:  # round robin: the first goes to the faulty mock
        r = await client.post("/v1/completions", json={**BODY, "max_tokens": 10}, headers=headers())
        assert r.status_code == 200 and "[DONE]" in r.text
    (line,) = await lines_after(caplog, 1)
    assert line["migrations"] == 1 and line["attempts"] == 2 and line["backend"] == "good"
    assert line["status"] == 200 and line["error_code"] is None and line["completion_tokens"] == 10


async def test_a_client_that_leaves_is_logged_as_499(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _, url = await start(nursery, tpot_s=0.02, max_tokens=500)
    async with (httpx.AsyncClient(base_url=url, timeout=20) as client,
                client.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 500}, headers=headers()) as r):  # fmt: skip
        assert r.status_code == 200
        async for chunk in r.aiter_bytes():
            if b"data:" in chunk:
                break
    (line,) = await lines_after(caplog, 1)
    assert line["status"] == 499 and line["error_code"] == "client_disconnected" and line["backend"] == "good"


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_no_key_cookie_or_prompt_in_any_log_line_unless_prompts_are_enabled(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, log_prompts: bool
) -> None:
    """Every record the router and the mocks write, at DEBUG, as JSON: the
    key and the cookie never; the prompt and output only with log_prompts."""
    caplog.set_level(logging.DEBUG)
    _, url = await start(nursery, {"logging": {"format": "json", "log_prompts": log_prompts}})
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        r = await client.post("/v1/completions", json={**BODY, "stream": False}, headers=headers())
        assert r.status_code == 200
        text = r.json()["choices"][0]["text"]
    (line,) = await lines_after(caplog, 1)
    everything = "\n".join(JsonFormatter().format(rec) for rec in caplog.records) + caplog.text
    assert KEY not in everything and "c00kie-value" not in everything
    assert (PROMPT in everything) is log_prompts
    if log_prompts:
        assert line["prompt"] == PROMPT and line["output"] == text
    else:
        assert "prompt" not in line and "output" not in line


def test_log_format_json_from_the_command_line() -> None:
    assert config_from_args(parse_args(["--log-format", "json"])).logging.format == "json"
    assert config_from_args(parse_args([])).logging.format == "text"


def test_the_json_formatter_writes_one_object_per_record_with_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    obj = json.loads(JsonFormatter().format(record))
    assert obj["msg"] == "failed here" and obj["level"] == "ERROR" and "ValueError: boom" in obj["exc"]
    assert "\n" not in JsonFormatter().format(record)

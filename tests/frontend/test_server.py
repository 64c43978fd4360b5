"""The shared OpenAI frontend, over real HTTP/2 on loopback, against a tiny
in-test backend whose output is a pure function of the request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import httpx
import pytest
import trio

from backends.base import Event, GenerateRequest
from backends.errors import BackendUnavailable
from frontend.server import DisconnectHook, OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.frontend.instruments import Spawns
from tests.router.fakes import FakeBackend


class CountingBackend(FakeBackend):
    """The router tests' verified fake (tokens 0, 1, ... as " t<i>"; it passes
    the conformance suite) serving models m1 and m2, refusing the prompt
    "overload" with 503 before any token."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__("counting", ("m1", "m2"), delay=delay)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if request.prompt == "overload":
            raise BackendUnavailable("busy", retry_after=2)
        async with aclosing(super().stream(request)) as events:  # type: ignore[type-var]
            async for event in events:
                yield event


@pytest.fixture
async def served(nursery: trio.Nursery) -> AsyncIterator[tuple[str, CountingBackend]]:
    backend = CountingBackend()
    url = await nursery.start(serve, OpenAIServer(backend, max_body_bytes=10_000), ServeOptions())
    yield url, backend


async def test_completion_non_streaming_has_text_usage_and_finish(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 3})
    assert r.http_version == "HTTP/2"
    body = r.json()
    assert r.status_code == 200, body
    assert body["choices"][0]["text"] == " t0 t1 t2"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 6


async def test_chat_streaming_frames_sse_with_stable_id_and_usage(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    payload = {
        "model": "m2",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "n": 2,
        "seed": 5,
    }
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/chat/completions", json=payload)
    lines = [line for line in r.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    by_index: dict[int, list[int]] = {0: [], 1: []}
    seeds = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]] += choice["token_ids"]
        if "seed" in choice:
            seeds[choice["index"]] = choice["seed"]
    assert by_index == {0: [0, 1], 1: [0, 1]}
    assert seeds == {0: 5, 1: 6}


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'{"prompt": 5}', 400, None),
        ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404, "model_not_found"),
        ("/v1/chat/completions", b'{"messages": []}', 400, None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, None),
        ("/v1/completions", b'{"prompt": "' + b"a" * 20_000 + b'"}', 413, "payload_too_large"),
        ("/v1/nowhere", b"{}", 404, "not_found"),
    ],
)
async def test_bad_input_gets_openai_error_shape(
    served: tuple[str, CountingBackend], path: str, body: bytes, status: int, code: str | None
) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code


async def test_wrong_method_is_405(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/v1/completions")
    assert r.status_code == 405


async def test_overload_before_first_token_is_503_with_retry_after(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/completions", json={"prompt": "overload", "stream": True})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "2"


async def test_client_disconnect_cancels_backend_stream(served: tuple[str, CountingBackend]) -> None:
    url, backend = served
    backend.delay = 0.05
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        async with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break
        assert backend.in_flight == 1
    with trio.fail_after(1):
        while backend.in_flight:
            await trio.sleep(0.01)
    assert backend.cancelled == 1


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "h2"])
async def test_client_leaving_a_whole_answer_cancels_it_without_a_watcher_task(
    served: tuple[str, CountingBackend], http2: bool
) -> None:
    """A non-streaming request is cancelled when its client leaves: the
    server calls the request's DisconnectHook, and no task per request waits
    on ``receive`` for ``http.disconnect`` (it used to be spawned)."""
    url, backend = served
    backend.delay = 0.05
    spawns = Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        async with httpx.AsyncClient(base_url=url, http1=not http2, http2=http2) as client:
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
            with trio.move_on_after(0.3):  # leaves after a few of its 1000 tokens
                await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000})
            assert backend.in_flight == 1
        with trio.fail_after(2):
            while backend.in_flight:
                await trio.sleep(0.01)
    finally:
        trio.lowlevel.remove_instrument(spawns)
    assert backend.cancelled == 1
    assert not [n for n in spawns.names if "watch_disconnect" in n], spawns.names


async def test_disconnect_is_watched_by_a_task_under_a_server_without_the_hook() -> None:
    """An ASGI server that offers no hook (here the app called directly):
    a task reads ``receive`` and the disconnect still cancels the request."""
    backend = CountingBackend(delay=0.05)
    app = OpenAIServer(backend)
    inbox_send, inbox = trio.open_memory_channel[dict](4)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    body = json.dumps({"prompt": "x", "max_tokens": 1000}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", str(len(body)).encode())]}
    await inbox_send.send({"type": "http.request", "body": body, "more_body": False})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope, inbox.receive, send)
        with trio.fail_after(2):
            while not backend.in_flight:
                await trio.sleep(0.01)
        await inbox_send.send({"type": "http.disconnect"})
    assert backend.cancelled == 1
    assert not any(m.get("type") == "http.response.body" and not m.get("more_body") and m.get("body") for m in sent)


def test_disconnect_hook_calls_back_once_and_at_once_when_already_closed() -> None:
    calls: list[str] = []
    hook = DisconnectHook()
    hook.then(lambda: calls.append("a"))
    hook()
    hook()
    assert calls == ["a"]
    hook.then(lambda: calls.append("b"))  # registered after the close: called at once
    assert calls == ["a", "b"]


async def test_oversized_h2_body_does_not_take_the_server_down(served: tuple[str, CountingBackend]) -> None:
    """hypercorn used to crash its whole nursery on DATA after an early 413."""
    url, _ = served
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        for _ in range(3):
            r = await client.post("/v1/completions", content=b"x" * 200_000)
            assert r.status_code == 413
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200


async def test_observe_sees_the_status_sent_and_499_for_a_disconnect() -> None:
    seen: list[tuple[str, int]] = []
    backend = CountingBackend(delay=0.05)
    app = OpenAIServer(backend, observe=lambda route, status, tenant, secs: seen.append((route, status)))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, app, ServeOptions())
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            await client.get("/v1/nowhere")
            async with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break
        with trio.fail_after(2):
            while len(seen) < 3:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert seen == [("/v1/completions", 200), ("other", 404), ("/v1/completions", 499)], seen


async def _raw_exchange(url: str, payload: bytes, until: bytes = b"") -> bytes:
    """Send raw bytes; read until the server closes, ``until`` shows up, or 2 s."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(payload)
        data = b""
        with trio.move_on_after(2):
            while chunk := await stream.receive_some(65536):
                data += chunk
                if until and until in data:
                    break
    return data


async def test_h2_headers_and_body_in_one_write_are_read_whole(served: tuple[str, CountingBackend]) -> None:
    """curl --http2-prior-knowledge sends HEADERS and DATA in one packet."""
    import h2.config
    import h2.connection
    import h2.events

    url, _ = served
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = b'{"prompt": "hi", "max_tokens": 2}'
    headers = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
               (":authority", "x"), ("content-type", "application/json"), ("content-length", str(len(body)))]
    conn.send_headers(1, headers)
    conn.send_data(1, body, end_stream=True)
    data = await _raw_exchange(url, conn.data_to_send(), until=b'"usage"')
    events = conn.receive_data(data)
    status = [dict(e.headers)[b":status"] for e in events if isinstance(e, h2.events.ResponseReceived)]
    received = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert status == [b"200"], received
    assert b"t0 t1" in received


async def test_malformed_h2c_upgrade_closes_one_connection_not_the_server(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    request = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: !!!not-base64!!!\r\n\r\n"
    )
    await _raw_exchange(url, request)
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/health")
    assert r.status_code == 200


async def test_error_inside_one_of_n_choices_keeps_its_status(served: tuple[str, CountingBackend]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/completions", json={"prompt": "overload", "n": 3})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "backend_unavailable"

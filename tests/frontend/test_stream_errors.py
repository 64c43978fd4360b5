"""Any exception, of any type, that ends a backend stream early must end the
client's answer as an error: the in-band error event and no ``[DONE]`` for a
stream, an error status for a collected answer. Issue 12, bug 2: an
``httpcore.WriteError`` escaped translation and the frontend closed the
stream with ``data: [DONE]``, so a cut-off answer looked complete."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import h2.exceptions
import httpcore
import httpx
import pytest
import trio
import trio.lowlevel

from backends.base import BackendInfo, Event, GenerateRequest, Health, Usage
from backends.errors import StreamBroken
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve

# One exception from each layer a stream passes through.
ERRORS = [
    pytest.param(lambda: httpcore.WriteError("Broken pipe"), id="httpcore.WriteError"),
    pytest.param(lambda: httpcore.RemoteProtocolError("ConnectionTerminated"), id="httpcore.RemoteProtocolError"),
    pytest.param(lambda: h2.exceptions.ProtocolError("bad frame"), id="h2.ProtocolError"),
    pytest.param(lambda: trio.BrokenResourceError("peer gone"), id="trio.BrokenResourceError"),
    pytest.param(lambda: OSError(104, "Connection reset by peer"), id="OSError"),
    pytest.param(lambda: KeyError("token"), id="KeyError"),
    pytest.param(lambda: RuntimeError("bug"), id="RuntimeError"),
    pytest.param(lambda: StreamBroken("reset"), id="StreamBroken"),
    pytest.param(lambda: None, id="ends-without-final-event"),
]


class BreakingBackend:
    """Two token events, then ``make()`` is raised (or, when it gives None,
    the stream just stops without its final event)."""

    def __init__(self, make: object) -> None:
        self.make = make

    def info(self) -> BackendInfo:
        return BackendInfo(name="breaking", models=("m",))

    async def health(self) -> Health:
        return Health(ok=True)

    async def aclose(self) -> None:
        pass

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        yield Event(token_ids=[1], text=" a", prompt_token_ids=[7], seed=0)
        await trio.lowlevel.checkpoint()
        yield Event(token_ids=[2], text=" b")
        if request.prompt == "whole":
            yield Event(token_ids=[3], text=" c", finish_reason="length", usage=Usage(1, 3))
            return
        exc = self.make()  # type: ignore[operator]
        if exc is not None:
            raise exc


@pytest.fixture
def make_url(nursery: trio.Nursery):  # type: ignore[no-untyped-def]
    async def start(make: object) -> str:
        return await nursery.start(serve, OpenAIServer(BreakingBackend(make)), ServeOptions())  # type: ignore[no-any-return]

    return start


def _data(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("make", ERRORS)
@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
async def test_a_stream_cut_by_any_error_ends_with_an_error_event_and_no_done(make_url, make: object, http2: bool) -> None:  # type: ignore[no-untyped-def]
    url = await make_url(make)
    async with httpx.AsyncClient(base_url=url, http1=not http2, http2=http2) as client:
        with trio.fail_after(10):
            r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 8})
    assert r.status_code == 200
    data = _data(r.text)
    assert "[DONE]" not in data, r.text
    last = json.loads(data[-1])
    assert last["error"]["type"] == "upstream_error" and last["error"]["message"], last
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == [" a", " b"]


@pytest.mark.parametrize("make", ERRORS)
async def test_a_collected_answer_cut_by_any_error_is_a_502(make_url, make: object) -> None:  # type: ignore[no-untyped-def]
    url = await make_url(make)
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        with trio.fail_after(10):
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "upstream_error"


async def test_one_of_n_choices_cut_short_fails_the_stream(make_url) -> None:  # type: ignore[no-untyped-def]
    url = await make_url(lambda: None)
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True, "n": 2, "max_tokens": 8})
    assert "[DONE]" not in _data(r.text) and "error" in json.loads(_data(r.text)[-1])


async def test_a_whole_stream_still_ends_with_done(make_url) -> None:  # type: ignore[no-untyped-def]
    url = await make_url(lambda: RuntimeError("never raised"))
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/completions", json={"prompt": "whole", "stream": True, "max_tokens": 3})
    data = _data(r.text)
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"

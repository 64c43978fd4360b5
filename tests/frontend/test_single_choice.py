"""A streamed call with one choice runs in the request's own task: no pump
task, no channel. The events a backend marks ``more_ready`` wait for the
next one, so the events of one upstream read leave in one write; any other
event is written at once; the backend stream is closed however the call
ends, even when its producer never runs. A whole (non-streamed) answer with
one choice is collected in the request's task too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest
import trio

from backends.base import BackendInfo, Event, GenerateRequest, Health, Usage
from frontend.call import DONE, prepare_call
from frontend.context import RequestContext
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.frontend.instruments import Spawns


class ScriptedBackend:
    """Yields ``script``'s events (a fresh copy per stream), with a
    checkpoint before each; counts streams closed."""

    def __init__(self, script: list[Event]) -> None:
        self.script = script
        self.closed = 0

    def info(self) -> BackendInfo:
        return BackendInfo(name="scripted", models=("m",))

    async def health(self) -> Health:
        return Health(ok=True)

    async def aclose(self) -> None:
        pass

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        try:
            for event in self.script:
                await trio.lowlevel.checkpoint()
                yield Event(**{f: getattr(event, f) for f in event.__struct_fields__})
        finally:
            self.closed += 1


def _script(*hints: bool) -> list[Event]:
    """len(hints) token events with these hints, the last one final."""
    events = [Event(token_ids=[i], text=f" t{i}", more_ready=more) for i, more in enumerate(hints)]
    events[-1].finish_reason, events[-1].usage = "length", Usage(1, len(hints))
    return events


async def _writes(backend: ScriptedBackend, *, coalesce: bool = True) -> list[bytes]:
    body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    call = prepare_call("completion", body, backend, RequestContext(request_id="r"), coalesce=coalesce)
    writes: list[bytes] = []

    async def emit(chunk: bytes, last: bool = False) -> None:
        writes.append(chunk)

    async with AsyncExitStack() as defer, trio.open_nursery() as nursery:
        produce = await call.start_stream(nursery, defer)
        await produce(emit)
    return writes


def _texts(write: bytes) -> list[str]:
    return [json.loads(line[6:])["choices"][0]["text"] for line in write.split(b"\n\n") if line.startswith(b"data: {")]


@pytest.mark.parametrize(
    ("hints", "groups"),
    [
        # the final event not marked: the end was not there yet, [DONE] follows alone
        ((False, False, False, False), [[" t0"], [" t1"], [" t2"], [" t3"], []]),
        ((True, True, False, False), [[" t0", " t1", " t2"], [" t3"], []]),
        ((True, False, True, True), [[" t0", " t1"], [" t2", " t3"]]),
    ],
    ids=["none-ready", "a-read-of-three", "ready-to-the-end"],
)
async def test_events_marked_more_ready_leave_with_the_next_in_one_write(hints: tuple[bool, ...], groups: list[list[str]]) -> None:
    backend = ScriptedBackend(_script(*hints))
    writes = await _writes(backend)
    assert [_texts(w) for w in writes] == groups
    assert writes[-1].endswith(DONE) and backend.closed == 1


async def test_without_coalescing_each_event_is_its_own_write_whatever_the_hints() -> None:
    backend = ScriptedBackend(_script(True, True, True, False))
    writes = await _writes(backend, coalesce=False)
    assert [_texts(w) for w in writes] == [[" t0"], [" t1"], [" t2"], [" t3"], []]
    assert writes[-1] == DONE


async def test_a_stream_whose_producer_never_runs_is_closed_by_the_request() -> None:
    backend = ScriptedBackend(_script(False, False))
    body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    call = prepare_call("completion", body, backend, RequestContext(request_id="r"))
    async with AsyncExitStack() as defer, trio.open_nursery() as nursery:
        await call.start_stream(nursery, defer)
        assert backend.closed == 0
    assert backend.closed == 1


@pytest.mark.parametrize("n", [1, 2])
async def test_one_choice_streams_without_a_pump_task_and_n_choices_with_one_each(n: int) -> None:
    backend = ScriptedBackend(_script(True, False, False))
    spawns = Spawns()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, OpenAIServer(backend, coalesce=True), ServeOptions())
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
            await client.get("/health")  # the connection's own tasks start before counting
            trio.lowlevel.add_instrument(spawns)
            try:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True, "n": n})
            finally:
                trio.lowlevel.remove_instrument(spawns)
        nursery.cancel_scope.cancel()
    assert r.status_code == 200 and r.text.endswith(DONE.decode())
    assert r.text.count('"text":" t1"') == n
    assert sum("_pump" in name for name in spawns.names) == (0 if n == 1 else n), spawns.names
    assert backend.closed == n


@pytest.mark.parametrize("n", [1, 2])
async def test_a_whole_answer_with_one_choice_is_collected_in_the_requests_task(n: int) -> None:
    backend = ScriptedBackend(_script(True, False, False))
    spawns = Spawns()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, OpenAIServer(backend), ServeOptions())
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
            await client.get("/health")
            trio.lowlevel.add_instrument(spawns)
            try:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": n})
            finally:
                trio.lowlevel.remove_instrument(spawns)
        nursery.cancel_scope.cancel()
    assert r.status_code == 200
    assert [c["text"] for c in r.json()["choices"]] == [" t0 t1 t2"] * n
    assert sum("Call.collect" in name for name in spawns.names) == (0 if n == 1 else n), spawns.names


@pytest.mark.parametrize(("n", "stream", "nurseries"), [(1, True, 0), (1, False, 0), (2, True, 1)])
async def test_a_request_opens_a_nursery_only_for_tasks_it_starts(
    n: int, stream: bool, nurseries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One choice spawns no task (the server's disconnect hook, no pump), so
    it opens no nursery, whose exit alone costs a scheduler turn."""
    from frontend import server as server_module

    opened: list[object] = []
    original = server_module._Tasks.nursery

    async def counted(self: server_module._Tasks) -> trio.Nursery:
        nursery = await original(self)
        if nursery not in opened:
            opened.append(nursery)
        return nursery

    monkeypatch.setattr(server_module._Tasks, "nursery", counted)
    backend = ScriptedBackend(_script(True, False, False))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, OpenAIServer(backend, coalesce=True), ServeOptions())
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream, "n": n})
        nursery.cancel_scope.cancel()
    assert r.status_code == 200
    assert len(opened) == nurseries

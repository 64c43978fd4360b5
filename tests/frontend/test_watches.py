"""A gate watches a call's backend streams (``Call.watch``) instead of
wrapping its backend: each watch sees every event, in the order the watches
were added, before the call uses it, and its end however the stream ends
(finished, failed, left by the client); each choice's stream gets its own
watch; the backend stream is closed whichever way."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from backends.base import Event, GenerateRequest, Usage
from backends.errors import UpstreamError
from frontend.call import Call, prepare_call
from frontend.context import RequestContext
from tests.frontend.test_single_choice import ScriptedBackend, _script


class _Backend(ScriptedBackend):
    """``tokens`` token events then a final one per stream; with ``fail_at``,
    an upstream error instead of that event. Logs closes in ``log``."""

    def __init__(self, log: list[str], tokens: int = 3, fail_at: int | None = None) -> None:
        super().__init__([])
        self.log, self.tokens, self.fail_at = log, tokens, fail_at

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        try:
            for i in range(self.tokens):
                await trio.lowlevel.checkpoint()
                if i == self.fail_at:
                    raise UpstreamError("the backend went away")
                final = i == self.tokens - 1
                yield Event(token_ids=[i], text=f" t{i}", finish_reason="length" if final else None,
                            usage=Usage(1, self.tokens) if final else None)  # fmt: skip
        finally:
            self.log.append("closed")


class _Watch:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        log.append(f"{name} start")

    def events(self, events: Sequence[Event]) -> None:
        self.log.extend(f"{self.name} {event.token_ids[0]}" for event in events)

    def end(self) -> None:
        self.log.append(f"{self.name} end")


def _call(backend: _Backend, log: list[str], **body: object) -> Call:
    raw = json.dumps({"model": "m", "prompt": "x", **body}).encode()
    call = prepare_call("completion", raw, backend, RequestContext(request_id="r"), coalesce=True)
    call.watch(lambda: _Watch("a", log))
    call.watch(lambda: _Watch("b", log))
    return call


async def _stream(call: Call, *, leave_after: int | None = None) -> bytes:
    body: list[bytes] = []

    async def emit(chunk: bytes, last: bool = False) -> None:
        body.append(chunk)
        if leave_after is not None and len(body) >= leave_after:
            raise trio.BrokenResourceError("the client left")

    async with AsyncExitStack() as defer, trio.open_nursery() as nursery:
        produce = await call.start_stream(nursery, defer)
        try:
            await produce(emit)
        except trio.BrokenResourceError:
            pass
    return b"".join(body)


async def test_each_watch_sees_every_event_in_order_then_its_end_then_the_stream_closes() -> None:
    log: list[str] = []
    body = await _stream(_call(_Backend(log), log, stream=True))
    assert body.endswith(b"data: [DONE]\n\n")
    assert log == ["a start", "b start", "a 0", "b 0", "a 1", "b 1", "a 2", "b 2", "closed", "a end", "b end"]


async def test_a_stream_that_fails_still_ends_its_watches_and_closes() -> None:
    log: list[str] = []
    body = await _stream(_call(_Backend(log, fail_at=2), log, stream=True))
    assert b"the backend went away" in body and b"[DONE]" not in body
    assert log == ["a start", "b start", "a 0", "b 0", "a 1", "b 1", "closed", "a end", "b end"]


async def test_a_client_that_leaves_mid_stream_ends_the_watches_and_closes_the_stream() -> None:
    log: list[str] = []
    backend = _Backend(log, tokens=50)
    call = _call(backend, log, stream=True)
    call.coalesce = False  # a write per event: the client leaves after the second
    await _stream(call, leave_after=2)
    assert log[-3:] == ["a end", "b end", "closed"]
    assert len([line for line in log if line.startswith("a ") and line[2:].isdigit()]) < 50


async def test_each_choice_gets_its_own_watches_and_a_whole_answer_is_watched_too() -> None:
    log: list[str] = []
    answer = await _call(_Backend(log, tokens=2), log, n=2).collect()
    assert [c["text"] for c in answer["choices"]] == [" t0 t1", " t0 t1"]
    assert log.count("a start") == log.count("b start") == 2
    assert log.count("a end") == log.count("b end") == log.count("closed") == 2
    assert log.count("a 0") == log.count("b 1") == 2


async def test_a_stream_that_fails_before_its_first_event_still_ends_its_watches() -> None:
    log: list[str] = []
    with pytest.raises(BaseExceptionGroup) as raised:  # the request's nursery: a real status code, not an in-band error
        await _stream(_call(_Backend(log, fail_at=0), log, stream=True))
    assert raised.group_contains(UpstreamError, match="went away")
    assert log == ["a start", "b start", "closed", "a end", "b end"]


class _Batches:
    """Logs what each ``events`` call got: the token ids, one list a call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def events(self, events: Sequence[Event]) -> None:
        self.calls.append([event.token_ids[0] for event in events])

    def end(self) -> None:
        self.calls.append([])


async def test_a_watch_is_shown_a_reads_events_in_one_call_and_the_first_alone() -> None:
    """One ``events`` call a write (the events a read brought, ``more_ready``),
    before it; the stream's first event alone, as soon as it is here."""
    backend = ScriptedBackend(_script(True, True, False, True, False, False))
    batches = _Batches()
    raw = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    call = prepare_call("completion", raw, backend, RequestContext(request_id="r"), coalesce=True)
    call.watch(lambda: batches)
    writes: list[list[int]] = []

    async def emit(chunk: bytes, last: bool = False) -> None:
        writes.append([json.loads(line[6:])["choices"][0]["text"] for line in chunk.split(b"\n\n") if line.startswith(b"data: {")])
        shown = [f" t{i}" for ids in batches.calls for i in ids]
        assert all(text in shown for write in writes for text in write)  # the watch saw them first

    async with AsyncExitStack() as defer, trio.open_nursery() as nursery:
        produce = await call.start_stream(nursery, defer)
        assert batches.calls == [[0]]
        await produce(emit)
    assert batches.calls == [[0], [1, 2], [3, 4], [5], []]
    assert writes == [[" t0", " t1", " t2"], [" t3", " t4"], [" t5"], []]


class _Hangs(ScriptedBackend):
    """Its script, then a wait for ever."""

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        async for event in super().stream(request):
            yield event
        await trio.sleep_forever()


async def test_events_pulled_but_not_yet_written_are_shown_when_the_stream_is_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    """A read's events wait for the rest of the read to be written together;
    cancelled meanwhile, the watches still see what was pulled (the backend
    generated it: the meters count it)."""
    backend = _Hangs(_script(False, True, True))
    backend.script[-1].finish_reason = None  # no end: the stream hangs after its third event
    batches = _Batches()
    raw = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    call = prepare_call("completion", raw, backend, RequestContext(request_id="r"), coalesce=True)
    call.watch(lambda: batches)

    async def emit(chunk: bytes, last: bool = False) -> None:
        pass

    with trio.move_on_after(1):
        async with AsyncExitStack() as defer, trio.open_nursery() as nursery:
            produce = await call.start_stream(nursery, defer)
            await produce(emit)
    assert batches.calls == [[0], [1, 2], []]

"""One OpenAI call run against any :class:`~backends.base.Backend`, with no
HTTP in it: decode a body, check the model, fan out into one backend stream
per choice, and either collect the answer (JSON) or produce it as SSE.

The HTTP frontend (:mod:`frontend.server`) runs every completions, chat and
generate request through :func:`prepare_call` and :class:`Call`; the job and
batch runners run request bodies the same way, without a socket.

Streaming: each choice's backend stream is iterated start to end by one
task (async generators must not migrate between tasks). With one choice,
that is the request's own task, which turns the events into SSE chunks and
writes them, those the backend marks ready together (``Event.more_ready``)
in one write. With ``n`` > 1, one pump task per choice hands its events to
the producer over a channel, and the producer writes the chunks that are
ready together in one write. Any exception
that ends a choice early ends the answer with the in-band error event and no
``[DONE]``: a truncated answer never looks complete.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol

import msgspec
import trio

from backends.base import Backend, Event, GenerateRequest, Usage, close_stream
from backends.errors import HeadraceError, ModelNotFound, StreamBroken, UpstreamError
from frontend.context import RequestContext
from frontend.wire import (
    Kind,
    WireRequest,
    chunk_choice,
    decode_request,
    error_body,
    logprobs_payload,
    new_id,
    now,
    to_generate_requests,
    usage_payload,
)

__all__ = ["DONE", "Call", "Emit", "Producer", "StreamWatch", "error_event", "prepare_call", "sse", "watched"]

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
# A token's choice as chunk_choice builds it and msgspec encodes it, around
# its text (Call._chunk), ending the chunk's choices list and object too.
_TOKEN_CHOICE = {"completion": b'{"index":%d,"text":', "chat": b'{"index":%d,"delta":{"content":'}
_TOKEN_CHOICE_END = {
    "completion": b',"logprobs":null,"finish_reason":null}]}\n\n',
    "chat": b'},"logprobs":null,"finish_reason":null}]}\n\n',
}

# ``emit(chunk)``; ``emit(chunk, True)`` sends the body's last chunk (the
# stream ends with it, in the same write).
Emit = Callable[..., Awaitable[None]]
# A streaming body: called with ``emit`` once the headers are out.
Producer = Callable[[Emit], Awaitable[None]]

DONE = b"data: [DONE]\n\n"

# Events waiting in a streamed call's channel, between the backend streams'
# pumps and the producer that writes them: at most CHANNEL_EVENTS, and at most
# CHANNEL_TEXT_BYTES of text (one event always fits). The producer's writes
# are bounded by the connection's unsent-output limits (frontend/hardening.py);
# what waits here is not, so for a client that stops reading this is what the
# router holds per stream beyond them before it stops reading the backend.
# 8 KiB keeps every event of one upstream read together at ordinary token
# sizes (the count binds first: coalesced writes unchanged) and holds a
# zero-window client's 100 streams of 1 KB tokens to ~8 events each instead
# of 64 (tests/hardening/test_slow_readers.py: the backends generated 8.8k
# events for it instead of 24.7k before stopping, in half the time).
CHANNEL_EVENTS = 64
CHANNEL_TEXT_BYTES = 8 * 1024


class StreamWatch(Protocol):
    """What a gate sees of one backend stream of a call it admitted
    (:meth:`Call.watch`): its events, in order, before the client is sent
    them, and the stream's end, however it ends (finished, failed,
    cancelled, or left by its consumer). Both are synchronous and must not
    block.

    ``events`` gets the events that leave for the client in one write
    together (one upstream read's, ``Event.more_ready``), or one event at a
    time where they do not; a stream's first event always alone, as soon as
    it is here. One call a write, not one an event: a whole answer that
    comes in one read was 20 calls of each watch, 1-2% of a streamed
    request's instructions.

    A watch, not a wrapper around the call's backend (CONVENTIONS #3): each
    wrapper was one more async generator every event passed through, and
    the SLI timer, the usage meter and the admission meter watch every
    stream. One loop calls them all: :func:`watched`, or a single streamed
    choice's producer itself (``Call._start_one``)."""

    def events(self, events: Sequence[Event]) -> None: ...

    def end(self) -> None: ...


async def watched(events: AsyncIterator[Event], watches: list[StreamWatch]) -> AsyncIterator[Event]:
    """``events`` with each shown to ``watches`` in order, and their ends
    called however the stream ends; then the stream is closed."""
    try:
        async for event in events:
            one = (event,)
            for watch in watches:
                watch.events(one)
            yield event
    finally:
        try:
            _end_watches(watches)
        finally:
            await close_stream(events)


def _show(watches: list[StreamWatch], events: list[Event]) -> None:
    """``events`` (if any) to each of ``watches``, in order."""
    if events:
        for watch in watches:
            watch.events(events)


def _end_watches(watches: list[StreamWatch]) -> None:
    for watch in watches:
        watch.end()


def sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def error_event(exc: HeadraceError) -> bytes:
    """The in-band error that ends a stream (no ``[DONE]`` follows it)."""
    return sse(error_body(exc.message, exc.type, exc.param, exc.code))


def check_model(backend: Backend, model: str | None) -> str:
    """The model the answer names: the requested one if the backend serves
    it (404 otherwise), or the backend's first when none was asked for."""
    models = backend.info().models
    if model is None or model == "":
        return models[0] if models else "default"
    if models and model not in models:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    return model


def prepare_call(
    kind: Kind, body: bytes, backend: Backend, context: RequestContext, *, coalesce: bool = False
) -> Call:
    """Decode and validate ``body`` (a :class:`~backends.errors.BadRequest`
    names the field), check the model, split it into its choices."""
    wire, extra = decode_request(body, kind)
    model = check_model(backend, wire.model)
    rid = new_id(kind)
    subs = to_generate_requests(
        wire, extra, request_id=context.request_id, tenant=context.tenant, traceparent=context.traceparent
    )
    return Call(kind, rid, model, wire, subs, backend, coalesce=coalesce)


class Call:
    """One OpenAI call: ``n`` sub-generations (``subs``) merged into one
    response, the OpenAI ``id`` being ``rid``."""

    def __init__(
        self,
        kind: Kind,
        rid: str,
        model: str,
        wire: WireRequest,
        subs: list[GenerateRequest],
        backend: Backend,
        *,
        coalesce: bool = False,
    ) -> None:
        self.kind, self.rid, self.model, self.wire, self.subs = kind, rid, model, wire, subs
        self.backend = backend
        self.created = now()
        self.token_ids = wire.return_token_ids or kind == "native"
        self.coalesce = coalesce
        self.headers: list[tuple[str, str]] = []  # response headers a gate adds (x-ratelimit-*)
        self.watches: list[Callable[[], StreamWatch]] = []
        self._head_bytes = b""  # see _head
        self._head_model: str | None = None

    def watch(self, start: Callable[[], StreamWatch]) -> None:
        """Have ``start()`` (a new watch for each choice's stream) see every
        backend stream of this call, after the watches added before it."""
        self.watches.append(start)

    def _open(self, sub: GenerateRequest) -> AsyncIterator[Event]:
        events = self.backend.stream(sub)
        if not self.watches:
            return events
        return watched(events, [start() for start in self.watches])

    # -------- non-streaming

    async def collect(self) -> dict[str, Any]:
        results: list[_Choice] = [_Choice() for _ in self.subs]

        async def run(i: int) -> None:
            try:
                async for event in self._open(self.subs[i]):
                    results[i].add(event)
            except HeadraceError:
                raise
            except Exception as exc:
                raise _untranslated(i, exc) from exc
            if results[i].finish_reason is None:
                raise _cut_short()

        try:
            if len(self.subs) == 1:
                await run(0)  # in this task: no nursery, no task to spawn
            else:
                async with trio.open_nursery() as nursery:
                    for i in range(len(self.subs)):
                        nursery.start_soon(run, i)
        except BaseExceptionGroup as group:
            # One failed choice fails the call: surface the first error of
            # ours unwrapped so it keeps its status code.
            raise _first_headrace_error(group) or group from None
        usage = _total_usage(results)
        self.model = results[0].model or self.model  # the model that answered (a router's fallback)
        if self.kind == "native":
            return results[0].native(self.rid, self.model, usage)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        choices = [r.openai(self.kind, i, self.token_ids) for i, r in enumerate(results)]
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage_payload(usage)}

    # -------- streaming

    async def start_stream(self, nursery: trio.Nursery | None, defer: AsyncExitStack) -> Producer:
        """Wait for each choice's first event (an error there raises, so it
        gets a real status code), and return the producer of the SSE body.

        Each backend stream is iterated start to end by one task: async
        generators must not migrate between tasks. With one choice that is
        the request's own task, which reads the stream and writes the body
        (see :meth:`_start_one`); with ``n`` > 1, one pump task per choice
        in the request's nursery. ``defer`` closes a stream the producer
        never ran for. ``nursery`` may be None with one choice."""
        if len(self.subs) == 1:
            return await self._start_one(defer)
        if nursery is None:
            raise TypeError(f"{len(self.subs)} choices need a nursery for their pumps")
        send, recv = trio.open_memory_channel[tuple[int, Event | HeadraceError]](CHANNEL_EVENTS)
        budget = _TextBudget(CHANNEL_TEXT_BYTES)
        async with send:
            for i, sub in enumerate(self.subs):
                nursery.start_soon(_pump, i, self._open(sub), send.clone(), budget)
        pending: list[tuple[int, Event]] = []
        started: set[int] = set()
        while len(started) < len(self.subs):
            try:
                i, item = await recv.receive()
            except trio.EndOfChannel:
                raise UpstreamError("the backend ended the stream without any event") from None
            if isinstance(item, HeadraceError):
                raise item
            budget.give(len(item.text))
            started.add(i)
            pending.append((i, item))
            if i == 0 and item.model is not None:
                self.model = item.model  # the model that answered (a router's fallback)

        flush = self._flush

        async def produce(emit: Emit) -> None:
            states = [_Streamed() for _ in self.subs]
            parts = [self._chunk(i, event, states[i]) for i, event in pending]
            while True:
                # Chunks that are ready leave in one write (coalesce); a
                # write goes out as soon as nothing more is ready.
                try:
                    i, item = recv.receive_nowait()
                except trio.WouldBlock:
                    if parts:
                        await flush(emit, parts)
                    try:
                        i, item = await recv.receive()
                    except trio.EndOfChannel:
                        break
                except trio.EndOfChannel:
                    break
                if isinstance(item, HeadraceError):
                    parts.append(error_event(item))
                    await flush(emit, parts, True)
                    return
                budget.give(len(item.text))
                parts.append(self._chunk(i, item, states[i]))
            await flush(emit, self._ending(parts, states), True)

        return produce

    async def _start_one(self, defer: AsyncExitStack) -> Producer:
        """One choice, without a pump, a channel or a task: the request's task
        pulls the stream's events and writes them. Events the backend marks
        ``more_ready`` (the rest of one upstream read) wait for the next, so
        those ready together leave in one write, as the pump's channel gave;
        and the upstream is read only as fast as the client takes the body,
        so a client that stops reading holds nothing here. The stream is
        closed by ``defer`` (the request's exit stack), whether the producer
        ran to its end, failed, was cancelled, or never ran.

        Two fewer scheduler turns before the first byte (the pump's start, the
        producer's wake on its channel) and a task spawn less per request."""
        # The watches are called here, not by :func:`watched`: one async
        # generator fewer that every event passes (~1% of a streamed
        # request's instructions). They end, then the stream is closed, in
        # ``defer``, however the request ends, as :func:`watched` does.
        it = self.backend.stream(self.subs[0])
        defer.push_async_callback(close_stream, it)  # the one place it is closed, however the request ends
        watches = [start() for start in self.watches]
        if watches:
            defer.callback(_end_watches, watches)
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise UpstreamError("the backend ended the stream without any event") from None
        except HeadraceError:
            raise
        except Exception as exc:
            raise _untranslated(0, exc) from exc
        one = (first,)
        for watch in watches:
            watch.events(one)
        if first.model is not None:
            self.model = first.model  # the model that answered (a router's fallback)
        flush = self._flush

        async def produce(emit: Emit) -> None:
            state = _Streamed()
            parts = [self._chunk(0, first, state)]
            more = first.more_ready
            seen: list[Event] = []  # pulled since the last write, not yet shown to the watches
            failed: bytes | None = None  # the in-band error event that ends the body
            try:
                while True:
                    if not more:
                        if seen:
                            _show(watches, seen)
                            seen = []
                        await flush(emit, parts)
                    try:
                        event = await it.__anext__()
                    except StopAsyncIteration:
                        break
                    except HeadraceError as exc:
                        failed = error_event(exc)
                        break
                    except Exception as exc:
                        failed = error_event(_untranslated(0, exc))
                        break
                    seen.append(event)
                    parts.append(self._chunk(0, event, state))
                    more = event.more_ready
            finally:
                _show(watches, seen)  # before the last write; pulled, then cancelled: still seen
            if failed is not None:
                parts.append(failed)
                await flush(emit, parts, True)
                return
            await flush(emit, self._ending(parts, [state]), True)

        return produce

    async def _flush(self, emit: Emit, parts: list[bytes], last: bool = False) -> None:
        if self.coalesce:
            await emit(b"".join(parts), last)
        else:  # one SSE event per write, as fault injectors count them
            for part in parts:
                await emit(part)
        parts.clear()

    def _ending(self, parts: list[bytes], states: Sequence[_Choice]) -> list[bytes]:
        """``parts`` and what ends the body once every stream has ended."""
        if any(state.finish_reason is None for state in states):
            # Every stream ended, yet some choice never got its final event:
            # a truncated answer must not look like a complete one.
            parts.append(error_event(_cut_short()))
            return parts
        opts = self.wire.stream_options
        if self.kind != "native" and opts is not None and opts.include_usage:
            parts.append(sse(self._envelope([], usage_payload(_total_usage(states)))))
        parts.append(DONE)
        return parts

    def _chunk(self, i: int, event: Event, state: _Streamed) -> bytes:
        first = state.events == 0
        offset = state.text_length
        state.add(event)
        if self.kind == "native":
            payload: dict[str, Any] = {"id": self.rid, "text": event.text, "token_ids": event.token_ids}
            if event.prompt_token_ids is not None:
                payload["prompt_token_ids"] = event.prompt_token_ids
            if event.seed is not None:
                payload["seed"] = event.seed
            if event.logprobs:
                payload["logprobs"] = logprobs_payload("completion", event.logprobs, offset)
            if event.finish_reason is not None:
                payload["finish_reason"] = event.finish_reason
                payload["usage"] = usage_payload(state.usage)
            return sse(payload)
        if event.finish_reason is None and not event.logprobs and not self.token_ids and (self.kind == "completion" or not first):
            # A token's chunk (no finish, logprobs or ids; for chat, not the
            # first, which names the role): chunk_choice's bytes, framed
            # here without its dict (tests/frontend/test_chunk_head.py).
            opening = _TOKEN_CHOICE[self.kind]
            return b"".join((self._head(), opening % i, _encoder.encode(event.text), _TOKEN_CHOICE_END[self.kind]))
        choice = chunk_choice(self.kind, i, event, token_ids=self.token_ids, first=first, text_offset=offset)
        return self._head() + _encoder.encode(choice) + b"]}\n\n"

    def _head(self) -> bytes:
        """``data: {"id":…,"object":…,"created":…,"model":…,"choices":[``,
        the part of every chunk of this call before its choice, encoded once
        (again if the answering model changes): the bytes
        ``sse(self._envelope([choice], None))`` starts with."""
        if self._head_model is not self.model:
            whole = _encoder.encode(self._envelope([], None))  # ...,"choices":[]}
            self._head_bytes, self._head_model = b"data: " + whole[:-2], self.model
        return self._head_bytes

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out: dict[str, Any] = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


class _TextBudget:
    """The text of the events in a call's channel (see CHANNEL_TEXT_BYTES):
    a pump whose event would take it past ``limit`` waits until the
    producer has taken enough, unless the channel holds no text."""

    __slots__ = ("_lot", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.held = 0
        self.limit = limit
        self._lot = trio.lowlevel.ParkingLot()

    async def take(self, n: int) -> None:
        """Count ``n`` more; parks (a checkpoint) only while over the bound."""
        while self.held and self.held + n > self.limit:
            await self._lot.park()
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n
        if self._lot and self.held < self.limit:
            self._lot.unpark_all()


async def _pump(i: int, it: AsyncIterator[Event], send: trio.MemorySendChannel[tuple[int, Event | HeadraceError]],
                budget: _TextBudget) -> None:
    """Relay one backend stream into the call's channel. Whatever ends the
    stream early is sent as an error, never as a plain end of channel: the
    producer answers ``[DONE]`` only after every choice's final event."""
    async with send:
        try:
            async for event in it:
                await budget.take(len(event.text))
                # Without a checkpoint while the channel has room (take parks
                # only when over its bound): the events of one upstream read
                # reach the producer together.
                try:
                    send.send_nowait((i, event))
                except trio.WouldBlock:
                    await send.send((i, event))
        except HeadraceError as exc:
            await send.send((i, exc))
        except Exception as exc:
            await send.send((i, _untranslated(i, exc)))
        finally:
            await close_stream(it)


def _untranslated(i: int, exc: Exception) -> UpstreamError:
    """A backend stream ended by an exception that is not one of ours (a bug
    in an adapter): logged with its traceback, answered as an upstream error."""
    log.error("choice %d: the backend stream failed with an untranslated error", i, exc_info=exc)
    return UpstreamError(f"backend stream failed: {type(exc).__name__}")


def _cut_short() -> StreamBroken:
    """Every pump ended, yet a choice never got its final event."""
    return StreamBroken("the backend stream ended before its final event")


def _first_headrace_error(group: BaseExceptionGroup[BaseException]) -> HeadraceError | None:
    for exc in group.exceptions:
        if isinstance(exc, HeadraceError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_headrace_error(exc)
            if found is not None:
                return found
    return None


class _Choice:
    """Accumulates one choice's events."""

    def __init__(self) -> None:
        self.events = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.prompt_token_ids: list[int] | None = None
        self.seed: int | None = None
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.model: str | None = None

    def add(self, event: Event) -> None:
        self.events += 1
        self.text += event.text
        self.token_ids += event.token_ids
        if event.logprobs:
            self.logprobs += event.logprobs
        if event.prompt_token_ids is not None:
            self.prompt_token_ids = event.prompt_token_ids
        if event.seed is not None:
            self.seed = event.seed
        self._outcome(event)

    def _outcome(self, event: Event) -> None:
        """The answering model, the finish reason and the usage, as they come."""
        if event.model is not None:
            self.model = event.model
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        if event.usage is not None:
            self.usage = event.usage

    def openai(self, kind: Kind, index: int, token_ids: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice["logprobs"] = logprobs_payload(kind, self.logprobs) if self.logprobs else None
        choice["finish_reason"] = self.finish_reason
        if token_ids:
            choice["token_ids"] = self.token_ids
            choice["prompt_token_ids"] = self.prompt_token_ids
            choice["seed"] = self.seed
        return choice

    def native(self, rid: str, model: str, usage: Usage) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid,
            "model": model,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "usage": usage_payload(usage),
        }
        if self.logprobs:
            out["logprobs"] = logprobs_payload("completion", self.logprobs)
        return out


class _Streamed(_Choice):
    """A streamed choice: what its chunks and the stream's ending read (the
    events so far, the text's length for logprob offsets, the outcome and
    usage), not the text and token ids themselves, which went to the client
    as they came (kept, they were copied on every event: quadratic in a
    long answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.text_length = 0

    def add(self, event: Event) -> None:
        self.events += 1
        self.text_length += len(event.text)
        self._outcome(event)


def _total_usage(choices: Sequence[_Choice]) -> Usage:
    # The prompt is shared by the n choices of one prompt; count it once per
    # distinct prompt as OpenAI does (here: the max, since n shares one prompt).
    prompt = max((c.usage.prompt_tokens for c in choices), default=0)
    cached = max((c.usage.cached_tokens for c in choices), default=0)
    completion = sum(c.usage.completion_tokens for c in choices)
    gpu = sum(c.usage.gpu_seconds for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, gpu_seconds=gpu)



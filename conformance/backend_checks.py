"""The checks of the in-process suite (see :mod:`conformance.backend`)."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import trio
import trio.lowlevel

from backends.errors import ContextLengthExceeded, ModelNotFound

from .backend import BACKEND, BackendTarget, Run, _run, collect, expect_raises
from .registry import expect, expect_equal, fail, skip

GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 1234}
SAMPLED: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "seed": 4242}


@BACKEND.check("backend.events", "events")
async def events(t: BackendTarget) -> str:
    """Events carry tokens; exactly one final event, last, with finish_reason and usage."""
    run = await _run(t, max_tokens=8, **GREEDY)
    return f"{len(run.events)} events, finish {run.final.finish_reason}"


@BACKEND.check("backend.chat", "events")
async def chat(t: BackendTarget) -> None:
    """A chat request (messages) streams under the same invariants."""
    from backends.base import ChatMessage

    await _run(t, prompt=None, messages=[ChatMessage(role="user", content="Hello!")], max_tokens=6)


@BACKEND.check("backend.max_tokens", "params")
async def max_tokens(t: BackendTarget) -> str:
    """max_tokens=5 with ignore_eos gives exactly 5 tokens and finish_reason length."""
    run = await _run(t, max_tokens=5, ignore_eos=True, **GREEDY)
    usage = run.final.usage
    assert usage is not None
    expect_equal(run.final.finish_reason, "length", "finish_reason with ignore_eos")
    expect_equal(usage.completion_tokens, 5, "usage.completion_tokens")
    return "5 tokens"


@BACKEND.check("backend.temperature0", "params")
async def temperature_zero(t: BackendTarget) -> None:
    """Two greedy runs are identical."""
    request = t.request(max_tokens=12, temperature=0.0)  # no seed: greedy must not need one
    async with t.open() as backend:  # one backend: a seed drawn per request would show
        first = await collect(backend, request, token_ids=t.info.token_ids)
        second = await collect(backend, request, token_ids=t.info.token_ids)
    expect_equal(second.text, first.text, "second greedy text")
    expect_equal(second.ids, first.ids, "second greedy ids")


@BACKEND.check("backend.seed", "params", requires=("seeds",))
async def seed(t: BackendTarget) -> None:
    """Two sampled runs with the same seed are identical."""
    first, second = await _run(t, max_tokens=12, **SAMPLED), await _run(t, max_tokens=12, **SAMPLED)
    expect_equal(second.text, first.text, "second seeded text")
    expect_equal(second.ids, first.ids, "second seeded ids")


@BACKEND.check("backend.stop", "params")
async def stop(t: BackendTarget) -> str:
    """A stop string straddling two events' texts ends the text just before it."""
    whole = await _run(t, max_tokens=24, ignore_eos=True, **GREEDY)
    start, stop_str = _straddling(whole)
    run = await _run(t, max_tokens=24, ignore_eos=True, stop=[stop_str], **GREEDY)
    expect_equal(run.text, whole.text[:start], f"text with stop={stop_str!r}")
    expect_equal(run.final.finish_reason, "stop", f"finish_reason with stop={stop_str!r}")
    return f"stop={stop_str!r}"


def _straddling(run: Run) -> tuple[int, str]:
    text, offset = run.text, 0
    for piece in run.pieces[:-1]:
        offset += len(piece)
        start, cand = offset - 2, text[max(offset - 2, 0) : offset + 2]
        if start >= 1 and len(cand) == 4 and cand.strip() == cand and text.find(cand) == start:
            return start, cand
    skip(f"no stop string straddling two events in {text[:60]!r}")


@BACKEND.check("backend.prompt_ids", "tokens", requires=("token_ids",))
async def prompt_ids(t: BackendTarget) -> None:
    """prompt_token_ids as input generates what the text prompt generates."""
    text_run = await _run(t, max_tokens=8, **GREEDY)
    ids = text_run.events[0].prompt_token_ids or []
    ids_run = await _run(t, prompt_token_ids=ids, max_tokens=8, **GREEDY)
    expect_equal(ids_run.ids, text_run.ids, "ids generated from prompt_token_ids")


@BACKEND.check("backend.resume.greedy", "tokens", requires=("token_ids",))
async def resume_greedy(t: BackendTarget) -> str:
    """Greedy: prompt ids + 5 emitted ids, max_tokens reduced, continue identically."""
    return await _resume(t, GREEDY)


@BACKEND.check("backend.resume.seeded", "tokens", requires=("token_ids", "seeds"))
async def resume_seeded(t: BackendTarget) -> str:
    """Seeded sampling: the resumed request draws what the unbroken one drew."""
    return await _resume(t, SAMPLED)


async def _resume(t: BackendTarget, sampling: dict[str, Any], cut: int = 5) -> str:
    whole = await _run(t, max_tokens=12, ignore_eos=True, **sampling)
    prompt = (whole.events[0].prompt_token_ids or []) + whole.ids[:cut]
    rest = len(whole.ids) - cut
    expect(rest > 0, f"the unbroken run has {len(whole.ids)} tokens; cannot cut at {cut}")
    resumed = await _run(t, prompt_token_ids=prompt, max_tokens=rest, ignore_eos=True, **sampling)
    expect_equal(resumed.ids, whole.ids[cut:], "continuation ids")
    return f"resumed {rest} after {cut}"


def _long(t: BackendTarget) -> int:
    """Tokens for a stream that should still be running when it is cancelled."""
    context = t.info.max_context
    return 1024 if context is None else max(8, min(1024, context // 2))


@BACKEND.check("backend.cancel.aclose", "cancellation")
async def cancel_aclose(t: BackendTarget) -> None:
    """Closing iterators after one event leaves the backend serving the next request."""
    async with t.open() as backend:
        with trio.move_on_after(t.grace) as scope:
            for _ in range(t.concurrency):
                it = backend.stream(t.request(max_tokens=_long(t), ignore_eos=True))
                expect(hasattr(it, "aclose"), "stream() returned an iterator without aclose()")
                async with aclosing(it):  # type: ignore[type-var]
                    await anext(it)
            await collect(backend, t.request(max_tokens=4, **GREEDY), token_ids=t.info.token_ids)
        _leaked(scope, t, "closed after one event")


@BACKEND.check("backend.cancel.scope", "cancellation")
async def cancel_scope(t: BackendTarget) -> None:
    """Cancelling consumers mid-stream leaves the backend serving the next requests."""
    async with t.open() as backend:
        async def consume(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            started = False
            async for _ in backend.stream(t.request(max_tokens=_long(t), ignore_eos=True)):
                if not started:
                    started = True
                    task_status.started()
            await trio.sleep_forever()  # a short stream ended: wait for the cancel

        with trio.move_on_after(t.grace) as scope:
            async with trio.open_nursery() as nursery:
                for _ in range(t.concurrency):
                    await nursery.start(consume)
                nursery.cancel_scope.cancel()
            await _parallel(t, backend, 4)
        _leaked(scope, t, "cancelled")


def _leaked(scope: trio.CancelScope, t: BackendTarget, how: str) -> None:
    if scope.cancelled_caught:
        fail(f"streams {how} held capacity: {t.concurrency} such streams and a short request "
             f"did not complete within {t.grace:g}s")


async def _parallel(t: BackendTarget, backend: Any, max_tokens: int) -> list[Run]:
    runs: list[Run] = []

    async def one(i: int) -> None:
        request = t.request(prompt=f"{t.request().prompt} ({i})", max_tokens=max_tokens,
                            seed=1000 + i)
        runs.append(await collect(backend, request, token_ids=t.info.token_ids))

    async with trio.open_nursery() as nursery:
        for i in range(t.concurrency):
            nursery.start_soon(one, i)
    return runs


@BACKEND.check("backend.concurrency", "concurrency")
async def concurrency(t: BackendTarget) -> str:
    """N concurrent streams on one backend all complete, each well-formed."""
    async with t.open() as backend:
        runs = await _parallel(t, backend, 16)
    expect_equal(len(runs), t.concurrency, "completed streams")
    return f"{len(runs)} streams"


@BACKEND.check("backend.errors.unknown_model", "errors")
async def unknown_model(t: BackendTarget) -> str:
    """An unknown model raises ModelNotFound (or is served: then skipped)."""
    async with t.open() as backend:
        request = t.request(model="no-such-model-conformance", max_tokens=2)
        err = await expect_raises(ModelNotFound, lambda: collect(backend, request, token_ids=False),
                                  "unknown model")
    if err is None:
        skip("backend serves any model name")
    return "ModelNotFound"


@BACKEND.check("backend.errors.context_length", "errors")
async def context_length(t: BackendTarget) -> str:
    """A prompt longer than info().max_context raises ContextLengthExceeded."""
    limit = t.info.max_context
    if limit is None:
        skip("info().max_context is not set")
    async with t.open() as backend:
        request = t.request(prompt=" hello" * (limit + 16), max_tokens=2)
        err = await expect_raises(ContextLengthExceeded,
                                  lambda: collect(backend, request, token_ids=False), "long prompt")
    expect(err is not None, f"a prompt of ~{limit + 16} tokens was accepted (max_context {limit})")
    return f"max_context {limit}"


@BACKEND.check("backend.kv_events", "kv", requires=("kv_events",))
async def kv_events(t: BackendTarget) -> str:
    """A backend claiming KV events publishes increasing seqs after a request."""
    async with t.open() as backend:
        source = getattr(backend, "kv_events", None)
        expect(callable(source), "info().kv_events is set but the backend has no kv_events()")
        seqs: list[int] = []
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                async for event in source():  # type: ignore[misc]
                    seqs.append(event.seq)
                    if event.kind == "stored":
                        nursery.cancel_scope.cancel()
            nursery.start_soon(watch)
            await trio.lowlevel.checkpoint()
            await collect(backend, t.request(max_tokens=8, **GREEDY), token_ids=t.info.token_ids)
            with trio.move_on_after(5):
                await trio.sleep_forever()
            fail("no 'stored' KV event within 5s of a request")
    expect(seqs == sorted(set(seqs)), f"KV event seqs are not increasing: {seqs[:8]}")
    return f"{len(seqs)} events"

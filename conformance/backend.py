"""``check_backend(make_backend)``: the in-process suite for Backend adapters.

The same contract as the HTTP suite, stated on :mod:`backends.base` objects:
per-event invariants, exactly one final event with ``finish_reason`` and
``usage``, ``max_tokens``, determinism, the resume contract when
``info().token_ids``, errors from :mod:`backends.errors` only, and cancellation
(closing the iterator early or cancelling the consumer) leaving the backend
usable. ``make_backend`` is called once per check, so one check's wreckage
never fails the next; each backend is closed (twice, to prove ``aclose`` is
idempotent) when its check ends.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from backends.base import Backend, BackendInfo, Event, GenerateRequest, Health
from backends.errors import HeadraceError

from .registry import Registry, expect, expect_equal, fail
from .report import Report
from .runner import run_checks, select

__all__ = ["BACKEND", "BackendTarget", "Run", "check_backend", "collect", "expect_raises"]

BACKEND = Registry()
MakeBackend = Callable[[], Backend | Awaitable[Backend]]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class BackendTarget:
    make: MakeBackend
    info: BackendInfo
    concurrency: int = 8
    grace: float = 5.0  # seconds for the cancellation checks before capacity counts as leaked

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Backend]:
        backend = self.make()
        if inspect.isawaitable(backend):
            backend = await backend
        try:
            yield backend
        finally:
            await backend.aclose()
            await backend.aclose()

    def request(self, **fields: Any) -> GenerateRequest:
        fields.setdefault("prompt", PROMPT)
        fields.setdefault("model", self.info.models[0] if self.info.models else None)
        return GenerateRequest(**fields)


@dataclass
class Run:
    events: list[Event] = field(default_factory=list)

    @property
    def final(self) -> Event:
        return self.events[-1]

    @property
    def ids(self) -> list[int]:
        return [i for e in self.events for i in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def pieces(self) -> list[str]:
        return [e.text for e in self.events if e.text]


async def collect(backend: Backend, request: GenerateRequest, *, token_ids: bool) -> Run:
    """Consume one stream and enforce the per-event contract."""
    run = Run()
    async for event in backend.stream(request):
        expect(isinstance(event, Event), f"stream yielded {type(event).__name__}, not Event")
        expect(not run.events or run.events[-1].finish_reason is None,
               "an event came after the final event")
        _check_event(event, first=not run.events)
        run.events.append(event)
    expect(run.events, "stream yielded no events")
    _check_final(run, request, token_ids)
    return run


def _check_event(event: Event, *, first: bool) -> None:
    ok_ids = isinstance(event.token_ids, list) and all(isinstance(i, int) for i in event.token_ids)
    expect(ok_ids, f"event token_ids is not a list of ints: {event.token_ids!r}")
    expect(isinstance(event.text, str), "event text is not a str")
    expect(first or event.prompt_token_ids is None, "prompt_token_ids on an event other than the first")
    if event.finish_reason is None:
        expect(event.token_ids or event.text, "a non-final event carries no tokens and no text")
        expect(event.usage is None, "usage on a non-final event")


def _check_final(run: Run, request: GenerateRequest, token_ids: bool) -> None:
    final = run.final
    expect(final.finish_reason in ("stop", "length"),
           f"final finish_reason is {final.finish_reason!r}, expected stop or length")
    expect(final.usage is not None, "final event has no usage")
    assert final.usage is not None
    if token_ids:
        expect_equal(final.usage.completion_tokens, len(run.ids),
                     "usage.completion_tokens vs token ids emitted")
        first = run.events[0].prompt_token_ids
        expect(first is not None, "first event lacks prompt_token_ids (info().token_ids is set)")
        expect_equal(final.usage.prompt_tokens, len(first or []), "usage.prompt_tokens vs prompt ids")
    limit = request.max_tokens
    if limit is not None:
        expect(final.usage.completion_tokens <= limit,
               f"{final.usage.completion_tokens} tokens for max_tokens={limit}")


async def _run(t: BackendTarget, **fields: Any) -> Run:
    async with t.open() as backend:
        return await collect(backend, t.request(**fields), token_ids=t.info.token_ids)


async def check_backend(
    make_backend: MakeBackend,
    *,
    only: str | None = None,
    check_timeout: float = 30.0,
    concurrency: int = 8,
    grace: float = 5.0,
) -> Report:
    """Run the in-process suite; ``make_backend()`` (sync or async) returns a
    fresh backend. Returns a :class:`Report`; call ``report.raise_for_failures()``
    for trio-style raising."""
    from . import backend_checks  # noqa: F401  (registers the checks)

    target = BackendTarget(make_backend, BackendInfo(name="?", models=()), concurrency, grace)
    async with target.open() as backend:
        info = backend.info()
        health = await backend.health()
    if not isinstance(info, BackendInfo) or not isinstance(health, Health):
        got = f"info() gave {type(info).__name__}, health() gave {type(health).__name__}"
        raise TypeError(f"not a Backend: {got}")
    target.info = info
    caps = {"token_ids": info.token_ids, "seeds": info.seeds, "kv_events": info.kv_events}
    results = await run_checks(select(BACKEND.checks, only), target, caps, check_timeout=check_timeout)
    return Report(target=f"backend {info.name}", capabilities=caps, results=results)


async def expect_raises(
    exc_type: type[HeadraceError], fn: Callable[[], Awaitable[object]], what: str
) -> HeadraceError | None:
    """Run ``fn``; return the error if it is ``exc_type``, None if nothing was
    raised; fail for any other exception (convention 4: only the project's
    tree escapes a backend)."""
    try:
        await fn()
    except exc_type as exc:
        return exc
    except HeadraceError as exc:
        fail(f"{what}: raised {type(exc).__name__}, expected {exc_type.__name__}")
    except Exception as exc:
        fail(f"{what}: raised {type(exc).__name__} ({exc}), not a backends.errors exception")
    return None


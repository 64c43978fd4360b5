"""The request pipeline: the gate runs once per client request (not once per
choice), before any backend stream starts, and is held until the answer's
last byte; a stage that refuses stops the request with its status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from functools import partial
from types import SimpleNamespace

import httpx
import pytest
import trio
import trio.testing

from backends.base import Event, GenerateRequest
from backends.errors import RateLimited
from frontend.call import Call
from frontend.context import THROUGH, Hold, Leave, RequestContext
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from router.logs import Journal
from router.pipeline import Pipeline
from tests.router.fakes import FakeBackend


class CountingStage:
    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[RequestContext, int]] = []
        self.holding = 0
        self.refuse = refuse

    @asynccontextmanager
    async def admit(self, context: RequestContext, call: Call) -> AsyncIterator[None]:
        self.calls.append((context, len(call.subs)))
        if self.refuse:
            raise RateLimited("slow down", code="rate_limited", retry_after=3)
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1


async def _serve(nursery: trio.Nursery, stage: CountingStage, backend: FakeBackend) -> tuple[str, Pipeline]:
    pipeline = Pipeline([stage])
    url = await nursery.start(serve, OpenAIServer(backend, gate=pipeline), ServeOptions())
    return url, pipeline


@pytest.mark.parametrize("stream", [False, True])
async def test_the_gate_runs_once_per_request_with_n_choices(nursery: trio.Nursery, stream: bool) -> None:
    stage, backend = CountingStage(), FakeBackend()
    url, pipeline = await _serve(nursery, stage, backend)
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "hi", "n": 3, "max_tokens": 2, "stream": stream},
            headers={"x-request-id": "req-42"},
        )
    assert r.status_code == 200, r.text
    assert len(stage.calls) == 1 and stage.calls[0][1] == 3
    assert stage.calls[0][0].request_id == "req-42"
    assert backend.started == 3
    with trio.fail_after(2):  # released once the server has sent the last byte
        while stage.holding or pipeline.statistics().in_flight:
            await trio.sleep(0.005)
    assert pipeline.statistics().admitted == 1


async def test_the_gate_is_held_until_the_last_byte_of_a_stream(nursery: trio.Nursery) -> None:
    """Held while the body is produced: the backend's events come after the
    handler has returned its response, so a gate released then shows 0 at
    them. At the client, every line but the last write's arrives while it is
    held (the last write ends the body, and the gate goes right after it, so
    the client may read that write after the release)."""
    stage = CountingStage()
    held_at_events: list[int] = []

    class Watched(FakeBackend):
        async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
            async with aclosing(super().stream(request)) as events:  # type: ignore[type-var]
                async for event in events:
                    held_at_events.append(stage.holding)
                    yield event

    url, _ = await _serve(nursery, stage, Watched(delay=0.05))
    seen: list[int] = []
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen.append(stage.holding)
    assert len(held_at_events) >= 4 and all(h == 1 for h in held_at_events), held_at_events
    assert len(seen) >= 5 and all(h == 1 for h in seen[:-2]), seen  # 50 ms apart: read while held
    with trio.fail_after(1):
        while stage.holding:
            await trio.sleep(0.01)


async def test_a_refusing_stage_answers_its_status_and_no_backend_stream_starts(nursery: trio.Nursery) -> None:
    stage, backend = CountingStage(refuse=True), FakeBackend()
    url, pipeline = await _serve(nursery, stage, backend)
    async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "rate_limited"
    assert backend.started == 0
    assert pipeline.statistics().rejected == {"rate_limited": 1}


async def test_a_bad_body_is_refused_before_the_gate(nursery: trio.Nursery) -> None:
    stage, backend = CountingStage(), FakeBackend()
    url, _ = await _serve(nursery, stage, backend)
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 0})
    assert r.status_code == 400 and stage.calls == []


async def test_the_pipeline_times_refusals_from_arrival_and_leaves_queue_timeouts_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Slow:
        """Refuses after ``delay`` s, with ``code``."""

        def __init__(self, delay: float, code: str) -> None:
            self.delay, self.code = delay, code

        @asynccontextmanager
        async def admit(self, context: RequestContext, call: Call) -> AsyncIterator[None]:
            await trio.sleep(self.delay)
            raise RateLimited("no", code=self.code, retry_after=1)
            yield  # pragma: no cover

    pipeline = Pipeline()
    assert pipeline.statistics().rejection_p99 is None
    for delay, code in ((0.002, "shed"), (0.004, "shed"), (30.0, "queue_timeout")):
        pipeline.stages = [Slow(delay, code)]
        context = RequestContext(request_id="r", arrival=trio.current_time())
        with pytest.raises(RateLimited):
            async with pipeline.admit(context, None):  # type: ignore[arg-type]
                pass
    stats = pipeline.statistics()
    assert stats.rejected == {"shed": 2, "queue_timeout": 1}
    assert stats.rejection_p50 == pytest.approx(0.004) and stats.rejection_p99 == pytest.approx(0.004)


class Logged:
    """A stage in each of the three forms a stage may take, logging its
    entry and exit (and the error it left with) to ``log``."""

    def __init__(self, name: str, log: list[str], form: str, refuse: bool = False) -> None:
        self.name, self.log, self.form, self.refuse = name, log, form, refuse

    def admit(self, context: RequestContext, call: Call) -> AbstractAsyncContextManager[None]:
        if self.form == "generator":
            return self._generator()
        if self.form == "hold":
            return Hold(self._hold())
        return self._Class(self)

    def _enter(self) -> None:
        self.log.append(f"enter {self.name}")
        if self.refuse:
            raise RateLimited("no", code="shed", retry_after=1)

    exit_error: Exception | None = None

    def _leave(self, error: BaseException | None) -> None:
        self.log.append(f"leave {self.name}" + (f" after {type(error).__name__}" if error else ""))
        if self.exit_error is not None:
            raise self.exit_error

    @asynccontextmanager
    async def _generator(self) -> AsyncIterator[None]:
        await trio.lowlevel.checkpoint()
        self._enter()
        try:
            yield
        except BaseException as exc:
            self._leave(exc)
            raise
        else:
            self._leave(None)

    async def _hold(self) -> Leave:
        await trio.lowlevel.checkpoint()
        self._enter()
        return partial(self._leave, None)  # a Hold is not told how the call ended

    class _Class:
        def __init__(self, stage: Logged) -> None:
            self.stage = stage

        async def __aenter__(self) -> None:
            self.stage._enter()

        async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
            self.stage._leave(exc)


FORMS = ["generator", "hold", "class"]


@pytest.mark.parametrize("forms", [FORMS, FORMS[::-1]])
@pytest.mark.parametrize("journal", [False, True])
async def test_stages_of_every_form_are_entered_in_order_and_left_in_reverse_however_the_call_ends(
    forms: list[str], journal: bool
) -> None:
    """A call that ends well, one whose body raises, and one a middle stage
    refuses: each stage entered is left once, last first; the refusal is
    counted and leaves nothing in flight or in the journal."""
    log: list[str] = []
    stages = [Logged(f"{i}:{form}", log, form) for i, form in enumerate(forms)]
    pipeline = Pipeline(stages, journal=Journal() if journal else None)
    names = [s.name for s in stages]
    call = SimpleNamespace(model="m", wire=SimpleNamespace(stream=True), subs=[])  # what the journal's record reads

    def context() -> RequestContext:
        return RequestContext(request_id="r", arrival=trio.current_time(), span_id="0123456789abcdef")

    async with pipeline.admit(context(), call):  # type: ignore[arg-type]
        assert pipeline.statistics().in_flight == 1
        assert pipeline.journal is None or len(pipeline.journal) == 1
    assert log == [f"enter {n}" for n in names] + [f"leave {n}" for n in reversed(names)]

    log.clear()
    with pytest.raises(KeyError):
        async with pipeline.admit(context(), call):  # type: ignore[arg-type]
            raise KeyError("the body failed")
    told = {"generator": " after KeyError", "class": " after KeyError", "hold": ""}
    assert log == [f"enter {n}" for n in names] + [f"leave {s.name}{told[s.form]}" for s in reversed(stages)]

    log.clear()
    stages[1].refuse = True
    with pytest.raises(RateLimited):
        async with pipeline.admit(context(), call):  # type: ignore[arg-type]
            raise AssertionError("a refused call's body never runs")
    left = f"leave {names[0]}" + (" after RateLimited" if stages[0].form != "hold" else "")
    assert log == [f"enter {names[0]}", f"enter {names[1]}", left]
    stats = pipeline.statistics()
    assert (stats.admitted, stats.in_flight, stats.rejected) == (2, 0, {"shed": 1})
    assert pipeline.journal is None or len(pipeline.journal) == 0

    # An exit that raises on a clean way out: the stages before it are still
    # left (told of that error), and it is the call's error.
    log.clear()
    stages[1].refuse = False
    stages[1].exit_error = ValueError("exit failed")
    with pytest.raises(ValueError, match="exit failed"):
        async with pipeline.admit(context(), call):  # type: ignore[arg-type]
            pass
    assert log[-1] == f"leave {names[0]}" + (" after ValueError" if stages[0].form != "hold" else "")
    assert pipeline.statistics().in_flight == 0
    with pytest.raises(TypeError, match="asynchronous context manager"):
        pipeline.stages = [SimpleNamespace(admit=lambda context, call: object())]
        async with pipeline.admit(context(), call):  # type: ignore[arg-type]
            pass


async def test_a_hold_enters_when_entered_and_leaves_once() -> None:
    """Nothing runs when a stage's ``admit`` is called, only on entry; the
    leave runs once however the block ends; an entry that raises leaves
    nothing to undo."""
    log: list[str] = []

    async def enter(fail: bool) -> Leave:
        log.append("enter")
        if fail:
            raise RateLimited("no", code="shed", retry_after=1)
        return lambda: log.append("leave")

    hold = Hold(enter(False))
    assert log == []
    async with hold:
        assert log == ["enter"]
    assert log == ["enter", "leave"]
    with pytest.raises(ValueError):
        async with Hold(enter(False)):
            raise ValueError
    assert log == ["enter", "leave", "enter", "leave"]
    with pytest.raises(RateLimited):
        async with Hold(enter(True)):
            raise AssertionError("not reached")
    assert log == ["enter", "leave", "enter", "leave", "enter"]
    async with THROUGH, THROUGH:  # stateless: one for every call, even nested
        pass

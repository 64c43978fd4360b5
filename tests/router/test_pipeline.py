"""The request pipeline: the gate runs once per client request (not once per
choice), before any backend stream starts, and is held until the answer's
last byte; a stage that refuses stops the request with its status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from backends.base import Event, GenerateRequest
from backends.errors import RateLimited
from frontend.call import Call
from frontend.context import RequestContext
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
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

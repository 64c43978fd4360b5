"""Cancellation, concurrency and overload: the checks that drive load.

Sized by ``--concurrency`` (parallel streams) and ``--burst`` (the bounded
burst that tries to overload the target). They run after the others because
they may leave the target briefly busy.
"""

from __future__ import annotations

import email.utils
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import trio

from .registry import expect, expect_equal, fail, skip
from .suite import HTTP, PROMPT, complete
from .target import HttpTarget

LONG = 1024  # tokens a dropped stream would still generate if not cancelled
HOLD = 3.0  # seconds the burst keeps its streams open waiting for the rest


@asynccontextmanager
async def open_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
    """A streaming POST whose body is read (or not) by the caller."""
    req = client.build_request("POST", "/v1/completions", content=msgspec.json.encode(
        {**body, "stream": True}), headers={"content-type": "application/json"})
    response = await client.send(req, stream=True)
    try:
        yield response
    finally:
        await response.aclose()


async def _first_chunk(response: httpx.Response) -> None:
    async for data in response.aiter_bytes():
        if data:
            return
    fail("stream ended before its first chunk")


@HTTP.check("load.cancellation", "load")
async def cancellation(t: HttpTarget) -> str:
    """Streams dropped after their first chunk free their capacity at once."""
    start = trio.current_time()
    await complete(t, max_tokens=4, temperature=0)
    baseline = trio.current_time() - start
    limit = LONG if t.caps.max_context is None else max(8, min(LONG, t.caps.max_context // 2))
    long_body = t.completion_body(PROMPT, max_tokens=limit, temperature=0, ignore_eos_if_supported=True)

    async def drop_one() -> None:
        # Own connection, closed on the way out: a real client disconnect.
        assert t.new_client is not None
        async with t.new_client() as client, open_stream(client, long_body) as response:
            expect_equal(response.status_code, 200, "status of a long stream")
            await _first_chunk(response)

    deadline = t.grace + 4 * baseline
    with trio.move_on_after(deadline) as scope:
        async with trio.open_nursery() as nursery:
            for _ in range(t.concurrency):
                nursery.start_soon(drop_one)
    if scope.cancelled_caught:
        fail(f"{t.concurrency} streams, each dropped after its first chunk, did not all start "
             f"within {deadline:.1f}s: dropped streams still hold capacity")
    with trio.move_on_after(deadline) as scope:
        await _parallel(t, t.concurrency, max_tokens=4)
    if scope.cancelled_caught:
        fail(f"after dropping {t.concurrency} streams, {t.concurrency} short requests did not "
             f"finish within {deadline:.1f}s: the dropped streams still hold capacity")
    return f"dropped {t.concurrency} streams; baseline {baseline:.2f}s"


async def _parallel(t: HttpTarget, n: int, **params: Any) -> list[Any]:
    results: list[Any] = [None] * n

    async def one(i: int) -> None:
        results[i] = await complete(t, stream=True, prompt=f"{PROMPT} ({i})",
                                    stream_options={"include_usage": True},
                                    seed=1000 + i, temperature=1.0, **params)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


@HTTP.check("load.concurrency", "load")
async def concurrency(t: HttpTarget) -> str:
    """N parallel streams all complete, each well-formed, with distinct ids and sane usage."""
    outs = await _parallel(t, t.concurrency, max_tokens=16)
    ids = {out.id for out in outs}
    expect_equal(len(ids), len(outs), "distinct completion ids across parallel streams")
    for out in outs:
        count = out.completion_tokens()
        expect(0 < count <= 16, f"stream {out.id}: completion_tokens {count} outside 1..16")
        if out.ids:
            expect_equal(len(out.ids), count, f"stream {out.id}: token_ids vs usage")
    return f"{len(outs)} streams"


@HTTP.check("load.overload", "load")
async def overload(t: HttpTarget) -> str:
    """Under a bounded burst, every 429/503 carries a valid Retry-After and an error body."""
    body = t.completion_body(PROMPT, max_tokens=64, temperature=0)
    answers: list[tuple[int, str | None, bytes]] = []
    all_answered = trio.Event()

    async def one() -> None:
        async with open_stream(t.client, body) as response:
            raw = b"" if response.status_code == 200 else await response.aread()
            answers.append((response.status_code, response.headers.get("retry-after"), raw))
            if len(answers) == t.burst:
                all_answered.set()
            with trio.move_on_after(HOLD):
                await all_answered.wait()

    async with trio.open_nursery() as nursery:
        for _ in range(t.burst):
            nursery.start_soon(one)
    refused = [a for a in answers if a[0] in (429, 503)]
    others = sorted({a[0] for a in answers} - {200, 429, 503})
    expect(not others, f"burst answered with unexpected status(es) {others}")
    if not refused:
        skip(f"target never overloaded under a burst of {t.burst} streams")
    for status, retry_after, raw in refused:
        expect(retry_after is not None, f"HTTP {status} without Retry-After")
        expect(_valid_retry_after(retry_after or ""), f"HTTP {status}: bad Retry-After {retry_after!r}")
        err = msgspec.json.decode(raw) if raw.startswith(b"{") else None
        expect(isinstance(err, dict) and isinstance(err.get("error"), dict),
               f"HTTP {status} body is not an OpenAI error: {raw[:120]!r}")
    return f"{len(refused)} of {t.burst} refused, all with Retry-After"


def _valid_retry_after(value: str) -> bool:
    value = value.strip()
    if value.isdigit():
        return True
    try:
        return email.utils.parsedate_to_datetime(value) is not None
    except (TypeError, ValueError):
        return False

"""SIGTERM with 50 streams in flight: ``headrace serve`` stops accepting at
once, every stream runs to its ``[DONE]`` with all its tokens, and the
process exits 0 (well within ``drain_timeout``).

The clients: the router's own HTTP/2 client (backends/h2client.py), and
httpx over HTTP/2, whose h2 4.x fails every stream still open on a GOAWAY
(where RFC 9113 6.8 has them run to completion): so a draining router says
GOAWAY only after a connection's last byte has gone, and a moment later
(frontend/serving.py), and httpx loses nothing either."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import trio

from backends.h2client import H2Pool
from tests.hardening.harness import completion, start_mocks, start_router

pytestmark = pytest.mark.timeout(120)
STREAMS = 50
TOKENS = 40  # 40 x 50 ms: each stream runs about 2 s, most of it after SIGTERM


async def _stream(pool: H2Pool, started: list[int], results: list[tuple[int, bool]]) -> None:
    """One streamed completion: (tokens received, whether it ended with [DONE])."""
    tokens, done, text = 0, False, b""
    async with pool.stream("POST", "/v1/completions", headers=[("content-type", "application/json")], body=completion(TOKENS)) as r:
        assert r.status == 200
        async for chunk in r:
            text += chunk
            *lines, rest = text.split(b"\n")
            text = rest
            for line in (raw.decode() for raw in lines):
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    if event["choices"] and event["choices"][0]["text"]:
                        tokens += 1
                        if tokens == 1:
                            started.append(1)
    results.append((tokens, done))


async def test_sigterm_lets_50_streams_in_flight_finish_and_exits_0(nursery: trio.Nursery, tmp_path: Path) -> None:
    urls, _ = await start_mocks(nursery, tpot_s=0.05, max_tokens=TOKENS)
    router = await start_router(nursery, tmp_path, urls, {"server.drain_timeout": 30})
    started: list[int] = []
    results: list[tuple[int, bool]] = []
    async with H2Pool("127.0.0.1", router.port, max_connections=1) as pool, trio.open_nursery() as streams:
        for _ in range(STREAMS):
            streams.start_soon(_stream, pool, started, results)
        with trio.fail_after(30):
            while len(started) < STREAMS:  # every stream has its first token
                await trio.sleep(0.01)
        assert not results, "a stream ended before SIGTERM: make them longer"
        router.process.send_signal(signal.SIGTERM)
        signalled = trio.current_time()
        with trio.fail_after(10):
            while True:  # the listener closes at once: a new connection is refused
                try:
                    probe = await trio.open_tcp_stream("127.0.0.1", router.port)
                except OSError:
                    break
                await probe.aclose()
                await trio.sleep(0.05)
    with trio.fail_after(30):
        status = await router.process.wait()
    print(f"\nSIGTERM with {STREAMS} streams in flight: all ended {trio.current_time() - signalled:.1f} s later, exit {status}")
    assert sorted(results) == [(TOKENS, True)] * STREAMS
    assert status == 0, router.log_text()[-2000:]


async def test_sigterm_lets_httpx_http2_streams_finish_though_h2_fails_open_streams_on_goaway(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """10 streams on one httpx HTTP/2 connection, SIGTERM once each has its
    first token: every one ends with all its tokens and [DONE]. Before,
    hypercorn said GOAWAY as soon as the apps returned, and httpcore fails a
    stream waiting to read when a GOAWAY comes in the read that brought its
    last frames: 2 or 3 of 10 lost in about a third of the runs."""
    urls, _ = await start_mocks(nursery, tpot_s=0.05, max_tokens=TOKENS)
    router = await start_router(nursery, tmp_path, urls, {"server.drain_timeout": 30})
    started: list[int] = []
    results: list[tuple[int, bool] | str] = []

    async def one(client: httpx.AsyncClient) -> None:
        tokens, done = 0, False
        try:
            async with client.stream("POST", "/v1/completions", content=completion(TOKENS),
                                     headers={"content-type": "application/json"}) as r:  # fmt: skip
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        tokens += 1
                        if tokens == 1:
                            started.append(1)
        except httpx.HTTPError as exc:
            results.append(repr(exc))
            return
        results.append((tokens, done))

    async with httpx.AsyncClient(http1=False, http2=True, base_url=router.url, timeout=30) as client, trio.open_nursery() as streams:
        for _ in range(10):
            streams.start_soon(one, client)
        with trio.fail_after(30):
            while len(started) < 10:
                await trio.sleep(0.01)
        router.process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        status = await router.process.wait()
    assert results == [(TOKENS, True)] * 10, results
    assert status == 0

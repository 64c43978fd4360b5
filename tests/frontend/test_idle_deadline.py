"""The keep-alive timeout without a task per idle spell (frontend/hardening.py
``IdleDeadline``): one watcher per connection whose deadline moves, with
hypercorn's behaviour: an idle connection closes ``keep_alive_timeout`` after
its last answer, a busy one never, and one whose client left goes at once."""

from __future__ import annotations

from typing import Any

import trio

from frontend.serving import ServeOptions, serve
from tests.frontend.instruments import Spawns
from tests.frontend.test_serving import health_app

_GET = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def slow_app(delay: float) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await health_app(scope, receive, send)
            return
        await trio.sleep(delay)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def _connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").split(":")
    return await trio.open_tcp_stream(host, int(port))


async def _answer(sock: trio.SocketStream) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        chunk = await sock.receive_some(65536)
        assert chunk, "closed before the answer"
        data += chunk
    return data


async def _closed_after(sock: trio.SocketStream, patience: float) -> float:
    """Seconds until the server closes ``sock`` (at most ``patience``)."""
    start = trio.current_time()
    with trio.fail_after(patience):
        while await sock.receive_some(65536):
            pass
    return trio.current_time() - start


async def test_many_requests_on_one_connection_start_one_idle_watcher(nursery: trio.Nursery) -> None:
    url = await nursery.start(serve, slow_app(0), ServeOptions(keep_alive_timeout=5))
    spawns = Spawns()
    sock = await _connect(url)
    trio.lowlevel.add_instrument(spawns)
    try:
        for _ in range(20):
            await sock.send_all(_GET)
            assert (await _answer(sock)).startswith(b"HTTP/1.1 200")
        watchers = [t.name for t in _all_tasks()].count("hypercorn idle deadline")
    finally:
        trio.lowlevel.remove_instrument(spawns)
        await sock.aclose()
    assert watchers == 1  # the connection's one watcher, started at its first idle spell
    # and no task per idle spell (hypercorn's own idle task: one after each answer)
    assert len(spawns.names) == 20 and set(spawns.names) == {"hypercorn.trio.task_group._handle"}, spawns.names


async def test_an_idle_connection_closes_at_the_keep_alive_timeout_after_its_last_answer(nursery: trio.Nursery) -> None:
    url = await nursery.start(serve, slow_app(0), ServeOptions(keep_alive_timeout=0.4))
    sock = await _connect(url)
    for _ in range(3):  # each answer moves the deadline
        await sock.send_all(_GET)
        await _answer(sock)
        await trio.sleep(0.25)
    waited = await _closed_after(sock, 3)
    assert 0.05 <= waited <= 1.0, waited  # 0.4 s after the last answer, 0.25 s of it slept already


async def test_a_busy_connection_outlives_the_keep_alive_timeout(nursery: trio.Nursery) -> None:
    url = await nursery.start(serve, slow_app(0.8), ServeOptions(keep_alive_timeout=0.3))
    sock = await _connect(url)
    await sock.send_all(_GET)
    with trio.fail_after(3):
        assert (await _answer(sock)).startswith(b"HTTP/1.1 200")  # answered after 0.8 s: not closed at 0.3
    assert await _closed_after(sock, 3) <= 1.0  # then idle: closed 0.3 s later


async def test_a_connection_whose_client_left_ends_without_waiting_for_its_deadline() -> None:
    """The watcher must not hold the connection's task group (and its socket)
    until the keep-alive timeout once the client is gone."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, slow_app(0), ServeOptions(keep_alive_timeout=60, graceful_timeout=0.1))
        sock = await _connect(url)
        await sock.send_all(_GET)
        await _answer(sock)
        assert "hypercorn idle deadline" in [t.name for t in _all_tasks()]
        await sock.aclose()
        with trio.fail_after(2):  # not 60 s
            while True:
                tasks = [t.name for t in _all_tasks()]
                if "hypercorn idle deadline" not in tasks:
                    break
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()


def _all_tasks() -> list[trio.lowlevel.Task]:
    out: list[trio.lowlevel.Task] = []
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        out.append(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return out

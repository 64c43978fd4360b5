"""The keep-alive timeout without a task per idle spell (frontend/hardening.py
``IdleDeadline``): one watcher per connection whose deadline moves, with
hypercorn's behaviour: an idle connection closes ``keep_alive_timeout`` after
its last answer, a busy one never, and one whose client left goes at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from frontend.hardening import IdleDeadline
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


class _Server:
    """What IdleDeadline reads of hypercorn's TCPServer; records when it is closed."""

    def __init__(self, keep_alive: float) -> None:
        self.config = SimpleNamespace(keep_alive_timeout=keep_alive)
        self.context = SimpleNamespace(terminated=trio.Event())
        self.closed_at: float | None = None

    async def _initiate_server_close(self) -> None:
        self.closed_at = trio.current_time()


async def _closes(keep_alive: float, script: Any) -> tuple[_Server, float]:
    """Runs ``script(idle, server)`` against a watcher; (server, start time)."""
    server = _Server(keep_alive)
    idle = IdleDeadline(server)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        group = SimpleNamespace(_nursery=nursery)
        await script(idle, group, server)
        await trio.sleep(10 * keep_alive)
        idle.end()
    return server, start


async def test_requests_on_a_connection_move_no_deadline_and_it_closes_a_timeout_after_going_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Busy and idle again, request after request: the watcher's deadline is
    the one set at the first idle spell (no deadline set a request); it
    passes while the connection is busy, and while it is idle but not yet
    for the whole timeout; the connection closes exactly ``keep_alive``
    after its last answer."""
    deadlines: list[float] = []

    async def script(idle: IdleDeadline, group: Any, server: _Server) -> None:
        await idle.restart(group, None)  # the connection opens idle
        for _ in range(30):  # a request every 0.4 s, each 0.3 s busy
            await trio.sleep(0.1)
            await idle.stop()
            deadlines.append(idle._scope.deadline)  # type: ignore[union-attr]
            await trio.sleep(0.3)
            await idle.restart(group, None)
            deadlines.append(idle._scope.deadline)  # type: ignore[union-attr]
        assert server.closed_at is None  # never idle for 1 s in 12 s

    server, start = await _closes(1.0, script)
    assert server.closed_at == pytest.approx(start + 12.0 + 1.0)
    assert len(set(deadlines)) <= 12 + 1, sorted(set(deadlines))  # set once a timeout at most, not once a request


async def test_a_connection_busy_at_its_deadline_closes_a_timeout_after_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(idle: IdleDeadline, group: Any, server: _Server) -> None:
        await idle.restart(group, None)
        await trio.sleep(0.5)
        await idle.stop()
        await trio.sleep(3.0)  # a long answer: the deadline (1.0) passes
        assert server.closed_at is None
        await idle.restart(group, None)

    server, start = await _closes(1.0, script)
    assert server.closed_at == pytest.approx(start + 3.5 + 1.0)


@pytest.mark.parametrize("busy", [False, True])
async def test_at_shutdown_an_idle_connection_closes_at_once_and_a_busy_one_when_its_answer_is_out(
    autojump_clock: trio.testing.MockClock, busy: bool
) -> None:
    async def script(idle: IdleDeadline, group: Any, server: _Server) -> None:
        await idle.restart(group, None)
        await trio.sleep(0.2)
        if busy:
            await idle.stop()
        await trio.sleep(0.1)
        server.context.terminated.set()
        await trio.sleep(0.3)
        if busy:
            assert server.closed_at is None
            await idle.restart(group, None)

    server, start = await _closes(1.0, script)
    assert server.closed_at == pytest.approx(start + (0.6 if busy else 0.3))


async def test_a_connection_whose_reading_ended_is_not_closed_by_its_watcher(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(idle: IdleDeadline, group: Any, server: _Server) -> None:
        await idle.restart(group, None)
        await trio.sleep(0.5)
        idle.end()

    server, _ = await _closes(1.0, script)
    assert server.closed_at is None

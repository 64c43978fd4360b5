"""A tiny OpenAI-style streaming server for the benchmark tests.

It answers ``GET /v1/models`` and streams ``/v1/completions`` and
``/v1/chat/completions`` token by token: the first token after ``ttft``
seconds, the rest ``gap`` apart, then a usage chunk and ``[DONE]``. Served by
hypercorn on 127.0.0.1:0, either inside the test's trio run (:func:`serve`) or
in a thread of its own (:func:`serve_in_thread`) for tests that call the CLI.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["FakeOpenAI", "serve", "serve_in_thread"]


class FakeOpenAI:
    def __init__(self, *, ttft: float = 0.05, gap: float = 0.002, model: str = "tiny") -> None:
        self.ttft, self.gap, self.model = ttft, gap, model
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []
        self.clients: list[tuple[str, int] | None] = []  # each request's connection (its peer address)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": self.model}]})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.requests += 1
        client = scope.get("client")
        self.clients.append(tuple(client) if client else None)  # type: ignore[arg-type]
        request = json.loads(body)
        self.bodies.append(request)
        await self._complete(scope["path"], request, send)

    async def _complete(self, path: str, request: dict[str, Any], send: Any) -> None:
        n = int(request.get("max_tokens") or 16)
        chat = path.endswith("/chat/completions")
        if not request.get("stream"):
            await trio.sleep(self.ttft + self.gap * (n - 1))
            await _json(send, 200, {"choices": [{"text": "x" * n}],
                                    "usage": {"prompt_tokens": 3, "completion_tokens": n}})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await trio.sleep(self.ttft)
        for i in range(n):
            if i:
                await trio.sleep(self.gap)
            choice = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            await _event(send, {"choices": [choice]})
        await _event(send, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _event(send: Any, payload: dict[str, Any]) -> None:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _json(send: Any, status: int, payload: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def _config() -> Config:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    return config


async def serve(nursery: trio.Nursery, app: FakeOpenAI) -> tuple[str, trio.Event]:
    """Serve ``app`` in ``nursery``; returns its URL and the event that stops it."""
    stop = trio.Event()
    binds = await nursery.start(
        lambda task_status: hypercorn_serve(app, _config(), shutdown_trigger=stop.wait,  # type: ignore[arg-type]
                                            task_status=task_status))
    return binds[0], stop


@contextlib.contextmanager
def serve_in_thread(app: FakeOpenAI) -> Iterator[str]:
    """Serve ``app`` from its own thread and trio run, for code that calls trio.run."""
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url, stop = await serve(nursery, app)
            ready.update(url=url, stop=stop, token=trio.lowlevel.current_trio_token())
            started.set()

    thread = threading.Thread(target=trio.run, args=(run,), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("fake server did not start")
    try:
        yield ready["url"]
    finally:
        trio.from_thread.run_sync(ready["stop"].set, trio_token=ready["token"])
        thread.join(10)

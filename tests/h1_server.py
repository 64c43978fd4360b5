"""An HTTP/1.1-only ASGI server on h11 and trio, as vLLM's and SGLang's
uvicorn servers and llama.cpp's server are: no HTTP/2 at all. An HTTP/2
prior-knowledge preface gets what uvicorn answers (``400 Bad Request``, then
the connection closes). Keep-alive, chunked responses, ``http.disconnect``
when the client goes away. For tests only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h11
import trio

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 11\r\nconnection: close\r\n\r\nBad Request"


class _Connection:
    def __init__(self, stream: trio.SocketStream, app: ASGIApp) -> None:
        self.stream, self.app = stream, app
        self.conn = h11.Connection(h11.SERVER)
        self.requests = 0
        self.broken = False

    async def next_event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.stream.receive_some(65536)
            self.conn.receive_data(data)

    async def send(self, event: Any) -> None:
        if self.broken:
            return  # the client left: the app finds out through http.disconnect
        data = self.conn.send(event)
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.broken = True

    async def serve(self) -> None:
        try:
            while True:
                try:
                    event = await self.next_event()
                except h11.RemoteProtocolError:
                    await self.stream.send_all(_BAD_REQUEST)
                    return
                if isinstance(event, h11.ConnectionClosed):
                    return
                assert isinstance(event, h11.Request)
                await self.one(event)
                if self.broken or self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.MUST_CLOSE:
                    return
                self.conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            return
        finally:
            await self.stream.aclose()

    async def one(self, request: h11.Request) -> None:
        self.requests += 1
        path, _, query = request.target.decode().partition("?")
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request.method.decode(), "path": path, "raw_path": request.target,
            "query_string": query.encode(), "headers": [(k.lower(), v) for k, v in request.headers],
            "scheme": "http", "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0),
        }  # fmt: skip
        body: list[bytes] = []
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
        done = trio.Event()
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            # A client that closes its side ends the exchange.
            while not done.is_set() and not self.broken:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                self.conn.receive_data(data)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                length = next((v for k, v in message.get("headers", []) if k.lower() == b"content-length"), None)
                if length is not None:
                    headers.append((b"content-length", length))
                else:
                    headers.append((b"transfer-encoding", b"chunked"))
                await self.send(h11.Response(status_code=message["status"], headers=headers))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    await self.send(h11.Data(data=message["body"]))
                if not message.get("more_body", False):
                    await self.send(h11.EndOfMessage())
                    done.set()

        async with trio.open_nursery() as nursery:

            async def run() -> None:
                await self.app(scope, receive, send)
                done.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
        if self.conn.our_state is not h11.DONE:
            raise trio.BrokenResourceError("the app ended mid-response")


async def _serve_connection(app: ASGIApp, stream: trio.SocketStream) -> None:
    await _Connection(stream, app).serve()


@asynccontextmanager
async def serving_http1(app: ASGIApp) -> AsyncIterator[str]:
    """Serve ``app`` over HTTP/1.1 only on 127.0.0.1:0 for the block; yield
    its base URL."""
    async with trio.open_nursery() as nursery:
        handler = partial(_serve_connection, app)
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            nursery.cancel_scope.cancel()

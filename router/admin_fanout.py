"""Admin changes reach every worker of ``headrace serve --workers N``.

The workers share the admin port (SO_REUSEPORT), so the kernel hands an
admin request to one of them: a drain, an added backend or new route
weights would change that worker's router only, and the others would go on
sending traffic where the operator said not to. So each worker also serves
its admin app on a private loopback port, and writes that port's URL to the
supervisor's peers directory (``$HEADRACE_ADMIN_PEERS/<index>``, replaced
when a worker restarts). :class:`FanOut` wraps the shared listener's app:

- reads (GET, HEAD) and anything outside ``/admin/`` are this worker's own;
- a change (POST, PUT, PATCH, DELETE under ``/admin/``) runs here first; if
  it succeeds (2xx) the same request goes to every peer's private port,
  with ``x-headrace-fanout: 1`` so that a peer applies it without passing
  it on; the answer is this worker's, with ``x-headrace-workers: K/N`` (the
  workers that applied it) and a warning logged for each peer that did not.

Every admin answer says which worker gave it (``x-headrace-worker``). The
private ports serve the same admin app, key check included; they are
loopback-only and named only in the supervisor's private directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from frontend.server import without_body_writer

__all__ = ["FANOUT_HEADER", "PEERS_ENV", "FanOut", "publish_peer"]

log = logging.getLogger(__name__)

PEERS_ENV = "HEADRACE_ADMIN_PEERS"
FANOUT_HEADER = b"x-headrace-fanout"
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
PEER_TIMEOUT = 10.0  # seconds for one peer to apply a change
MAX_BODY = 1 << 23  # bytes of an admin change held to pass on

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def publish_peer(peers: Path, index: int, url: str) -> None:
    """Name this worker's private admin URL (atomically: a peer never reads half)."""
    peers.mkdir(parents=True, exist_ok=True)
    tmp = peers / f".{index}.tmp"
    tmp.write_text(url)
    os.replace(tmp, peers / str(index))


class FanOut:
    """The shared admin listener's app for worker ``index`` (see the module)."""

    def __init__(self, app: ASGIApp, peers: Path, index: int, *, timeout: float = PEER_TIMEOUT) -> None:
        self.app, self.peers, self.index, self.timeout = app, peers, index, timeout
        self._worker = (b"x-headrace-worker", str(index).encode())

    def peer_urls(self) -> list[str]:
        """The other workers' private admin URLs, as they last published them."""
        urls = []
        for entry in sorted(self.peers.glob("[0-9]*")):
            if entry.name != str(self.index):
                try:
                    urls.append(entry.read_text().strip())
                except OSError:  # a worker restarting replaces its file
                    continue
        return [u for u in urls if u]

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
        headers = scope.get("headers") or []
        if (
            scope.get("type") != "http"
            or scope.get("method") not in CHANGES
            or not str(scope.get("path", "")).startswith("/admin/")
            or any(name == FANOUT_HEADER for name, _ in headers)
        ):
            await self.app(scope, receive, self._tagged(send, ()))
            return
        body = await _read_body(receive)
        if body is None:
            await _too_large(self._tagged(send, ()))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: Message | None = None
        chunks: list[Message] = []

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            else:
                chunks.append(message)

        await self.app(without_body_writer(scope), replay, capture)
        if start is None:
            return
        extra: tuple[tuple[bytes, bytes], ...] = ()
        if 200 <= start["status"] < 300:
            urls = self.peer_urls()
            applied = 1 + await self._forward(scope, headers, body, urls)
            extra = ((b"x-headrace-workers", f"{applied}/{1 + len(urls)}".encode()),)
        tagged = self._tagged(send, extra)
        await tagged(start)
        for chunk in chunks:
            await tagged(chunk)

    def _tagged(self, send: Callable[[Message], Awaitable[None]], extra: tuple[tuple[bytes, bytes], ...]) -> Callable[[Message], Awaitable[None]]:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._worker, *extra]}
            await send(message)

        return tagged

    async def _forward(self, scope: Scope, headers: list[tuple[bytes, bytes]], body: bytes, urls: list[str]) -> int:
        """Send the change to each peer at once; how many applied it (2xx)."""
        if not urls:
            return 0
        keep = {b"authorization", b"content-type"}
        sent = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in keep}
        sent[FANOUT_HEADER.decode()] = "1"
        target = scope["path"] + (("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else "")
        ok = 0

        async def one(client: httpx.AsyncClient, url: str) -> None:
            nonlocal ok
            try:
                r = await client.request(scope["method"], url + target, headers=sent, content=body)
            except httpx.HTTPError as exc:
                log.warning("admin %s %s did not reach the worker at %s: %s", scope["method"], target, url, exc)
                return
            if 200 <= r.status_code < 300:
                ok += 1
            else:
                log.warning("admin %s %s: the worker at %s answered %d: %s", scope["method"], target, url, r.status_code, r.text[:200])

        async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client, trio.open_nursery() as nursery:
            for url in urls:
                nursery.start_soon(one, client, url)
        return ok


async def _read_body(receive: Callable[[], Awaitable[Message]]) -> bytes | None:
    """The whole body (None: over :data:`MAX_BODY`)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        part = message.get("body", b"")
        size += len(part)
        if size > MAX_BODY:
            return None
        parts.append(part)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


async def _too_large(send: Callable[[Message], Awaitable[None]]) -> None:
    body = msgspec.json.encode({"error": {"message": f"an admin request body is at most {MAX_BODY} bytes",
                                          "type": "invalid_request_error", "param": None, "code": "body_too_large"}})  # fmt: skip
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})

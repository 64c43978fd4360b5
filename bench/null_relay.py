"""The least a Python router on this stack can do per request: the yardstick
``headrace bench budget`` measures the router's added latency against.

Read the request, open an upstream HTTP/2 stream to the next backend (round
robin), relay the upstream's bytes as they come, unparsed. The same ingress
and upstream code the router could use at its leanest (``headrace mock``'s
lean HTTP/1.1 + h2c server, backends/mock_http.py, and the router's own
HTTP/2 client, backends/h2client.py), and nothing else: no routing policy,
no admission, no metrics, no SSE parsing, no usage.

``--burn-ms X`` spins X ms of CPU in each request before it goes upstream,
on the path to its first byte: a router with X ms more work a request. Run
over several values it gives the curve of added latency against CPU per
request on this machine, on which the router's own point can be read.

    python bench/null_relay.py --port 0 --backend http://127.0.0.1:8001 --backend ...
    # prints "relay listening on URL"

Run it as a file (as bench/bare_app.py): ``python -m bench.null_relay``
would import the ``bench`` package and, through it, the router's frontend.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import trio

from backends.h2client import H2Pool
from backends.mock_http import LeanServer

ASGIApp = Callable[..., Any]
# request headers passed upstream as they came (the rest: hop-by-hop, or the pool's own)
FORWARD = frozenset({b"content-type", b"authorization", b"accept"})


def burn(seconds: float) -> None:
    """Spin the CPU for ``seconds`` (not sleep: the point is to be busy)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def relay_app(pools: Sequence[H2Pool], burn_s: float = 0.0) -> ASGIApp:
    """An ASGI app that relays each HTTP request to the next of ``pools``."""
    upstream = itertools.cycle(pools)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if burn_s:
            burn(burn_s)
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k in FORWARD]
        target = scope["path"] + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
        async with next(upstream).stream(scope["method"], target, headers=headers, body=body) as resp:
            forwarded = [(k, v) for k, v in resp.raw_headers if not k.startswith(b":") and k != b"content-length"]
            await send({"type": "http.response.start", "status": resp.status, "headers": forwarded})
            async for chunk in resp:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _pool(url: str) -> H2Pool:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise SystemExit(f"null_relay: --backend takes http://HOST:PORT (cleartext HTTP/2), not {url!r}")
    return H2Pool(parts.hostname, parts.port)


async def serve(host: str, port: int, backends: Sequence[str], burn_ms: float) -> None:
    pools = [_pool(url) for url in backends]
    server = LeanServer(relay_app(pools, burn_ms / 1000))
    gc.freeze()  # as the router does once serving (router/server.py)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(server.serve, host, port))
        print(f"relay listening on {url}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/null_relay.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--backend", action="append", required=True, help="http://HOST:PORT, h2c (repeat)")
    p.add_argument("--burn-ms", type=float, default=0.0, help="CPU spun per request before the upstream")
    args = p.parse_args(argv)
    if args.burn_ms < 0:
        p.error("--burn-ms must be >= 0")
    try:
        trio.run(serve, args.host, args.port, args.backend, args.burn_ms)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

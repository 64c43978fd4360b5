"""A bare hypercorn + trio ASGI app that streams what ``headrace mock
--max-tokens 20`` streams: the yardstick ``headrace bench router`` quotes the
router's CPU per request against.

No frontend, no backend, no routing: read the body, answer 200, send 20
ready-made completion chunks (one ``http.response.body`` each, as a relay
that forwards chunk by chunk sends them), a usage chunk and ``[DONE]``. What
it costs per request is what hypercorn and trio cost for a 20-chunk stream;
a router cannot relay the same stream for less without sending less often.

    python bench/bare_app.py --port 0        # prints "bare listening on URL"

Run it as a file, not with ``python -m bench.bare_app``: the ``bench``
package's ``__init__`` imports the load generator, which imports
frontend/serving.py, whose patches of hypercorn would then serve the
"bare" app (until stop 35 they did: its cost moved with every ingress
change, 1.12 -> 0.64 ms over HTTP/1.1 and 0.46 -> 0.85 ms over h2c in one
stop). :func:`main` refuses to serve with the patches loaded.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

__all__ = ["CHUNKS", "app", "main"]

WORDS = (" the", " river", " runs", " under", " a", " stone", " bridge", " and", " water",
         " turns", " its", " wheel", " of", " an", " old", " mill", " where", " grain",
         " becomes", " flour")


def _chunk(text: str, finish: str | None) -> bytes:
    return b"data: " + msgspec.json.encode({
        "id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "mock",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }) + b"\n\n"


CHUNKS: tuple[bytes, ...] = (
    *(_chunk(w, None) for w in WORDS[:-1]),
    _chunk(WORDS[-1], "length"),
    b'data: {"id":"cmpl-bare","object":"text_completion","created":0,"model":"mock",'
    b'"choices":[],"usage":{"prompt_tokens":32,"completion_tokens":20,"total_tokens":52}}\n\n',
    b"data: [DONE]\n\n",
)
PATCHES = "frontend.serving"  # the module whose import patches hypercorn
_MODELS = msgspec.json.encode({"object": "list", "data": [{"id": "mock", "object": "model"}]})
_HEALTH = b'{"status":"ok"}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        body = _MODELS if scope["path"] == "/v1/models" else _HEALTH
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _config(host: str, port: int) -> Config:
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_max_requests = 2**62  # hypercorn closes connections after 1,000
    config.h2_max_concurrent_streams = 1000
    return config


async def _serve(host: str, port: int) -> None:
    class _Started:
        def started(self, binds: list[str] | None = None) -> None:
            print(f"bare listening on {(binds or [''])[0]}", flush=True)

    await serve(app, _config(host, port), task_status=_Started(), mode="asgi")  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/bare_app.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    if PATCHES in sys.modules:
        print(f"bench/bare_app.py: {PATCHES} is loaded and has patched hypercorn; run this file "
              "as a script (python bench/bare_app.py), not as bench.bare_app", file=sys.stderr)
        return 2
    try:
        trio.run(partial(_serve, args.host, args.port))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serve an ASGI app with hypercorn on 127.0.0.1:0 for the length of a block."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of ``app``; HTTP/1.1
    and HTTP/2 with prior knowledge both work on it."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 0.1
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config))
        try:
            yield binds[0]
        finally:
            nursery.cancel_scope.cancel()

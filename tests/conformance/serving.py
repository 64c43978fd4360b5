"""Serve an ASGI app on 127.0.0.1:0 for the length of a block, with the
project's own HTTP stack (frontend.serving)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from frontend.serving import ServeOptions, serve


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of ``app``; HTTP/1.1
    and HTTP/2 with prior knowledge both work on it."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app, ServeOptions(graceful_timeout=0.1)))
        try:
            yield url
        finally:
            nursery.cancel_scope.cancel()

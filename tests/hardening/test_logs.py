"""No API key in any log line, at DEBUG too: hpack logged every decoded
header (``authorization: Bearer <key>``) at DEBUG."""

from __future__ import annotations

import logging
from pathlib import Path

import h2.events
import httpx
import pytest
import trio

from backends.errors import Unauthorized
from backends.mock import MockBackend
from frontend.context import Principal
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.hardening.harness import RawH2, of, start_mocks, start_router

KEY = "sk-do-not-log-4f1c9e"


def _auth(headers: dict[str, str]) -> Principal:
    if headers.get("authorization") != f"Bearer {KEY}":
        raise Unauthorized("no")
    return Principal("team", "k1")


@pytest.mark.parametrize("hpack_level", [None, logging.DEBUG])
async def test_an_api_key_never_reaches_the_logs_at_debug(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, hpack_level: int | None) -> None:
    """Root logger at DEBUG (and, the second time, hpack's own logger set to
    DEBUG as well): an HTTP/2 request with the key is served, and the key is
    in no captured record."""
    caplog.set_level(logging.DEBUG)
    if hpack_level is not None:
        logging.getLogger("hpack").setLevel(hpack_level)
    try:
        url = await nursery.start(serve, OpenAIServer(MockBackend(), authenticate=_auth), ServeOptions(access_log=True, graceful_timeout=0.1))
        client = await RawH2.open(int(url.rsplit(":", 1)[1]))
        client.request(1, "/v1/models", extra=[("authorization", f"Bearer {KEY}")])
        await client.flush()
        events = await client.read_until(lambda events: bool(of(events, h2.events.StreamEnded)), 5)
        assert dict(of(events, h2.events.ResponseReceived)[0].headers)[b":status"] == b"200"
        await client.aclose()
    finally:
        logging.getLogger("hpack").setLevel(logging.INFO)
    assert caplog.records  # DEBUG capture was on
    assert KEY not in caplog.text


def test_credential_headers_are_redacted_in_hypercorn_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger("hypercorn.error").error("bad request: %r", [(b"authorization", f"Bearer {KEY}".encode()), (b"x-api-key", b"k2")])
    logging.getLogger("hypercorn.access").info("authorization: Bearer %s", KEY)
    assert KEY not in caplog.text and "k2" not in caplog.text
    assert caplog.text.count("<redacted>") == 3


async def test_the_router_at_debug_logs_no_key(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``headrace serve --log-level DEBUG`` with an access log: a request with
    the key over HTTP/2 and one over HTTP/1.1; the key is in no line of its
    stderr."""
    urls, _ = await start_mocks(nursery, n=1)
    router = await start_router(nursery, tmp_path, urls, {"auth.keys": {KEY: "team"}, "server.access_log": True}, log_level="DEBUG")
    client = await RawH2.open(router.port)
    client.request(1, "/v1/models", extra=[("authorization", f"Bearer {KEY}")])
    await client.flush()
    events = await client.read_until(lambda events: bool(of(events, h2.events.StreamEnded)), 5)
    assert dict(of(events, h2.events.ResponseReceived)[0].headers)[b":status"] == b"200"
    async with httpx.AsyncClient(base_url=router.url) as h1:
        assert (await h1.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).status_code == 200
    await trio.sleep(0.3)
    log = router.log_text()
    assert log.count("GET /v1/models") >= 2  # the access log has both requests
    assert KEY not in log

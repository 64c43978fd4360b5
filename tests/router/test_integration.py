"""The router over real sockets: client disconnects cancel the backend, the
official openai SDK, TLS with ALPN h2, h2c Upgrade, and SIGTERM drain of a real
``headrace serve`` process."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import h2.connection
import h2.events
import h2.settings
import httpx
import openai
import pytest
import trio
import trustme

from backends.mock import MockBackend, MockConfig
from backends.openai_http import OpenAIHTTPBackend
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from router.app import NamedBackend, Router
from router.config import decode_config
from router.server import options_for, run_router
from tests.router.fakes import FakeBackend

REPO = Path(__file__).resolve().parents[2]


async def serve_router(nursery: trio.Nursery, router: Router, **server: object) -> str:
    config = decode_config({"server": {"port": 0, **server}})
    url: str = await nursery.start(lambda task_status: run_router(router, options_for(config), shutdown=trio.Event(), task_status=task_status))
    return url


async def wait_idle(fake: FakeBackend, router: Router) -> None:
    with trio.fail_after(1):
        while fake.in_flight or router.actors[0].in_flight:
            await trio.sleep(0.002)


@pytest.mark.parametrize("how", ["rst_stream", "close_connection"])
async def test_client_going_away_cancels_backend_within_100ms(nursery: trio.Nursery, how: str) -> None:
    """A raw h2 client reads the first event, then either resets its stream
    (connection stays up) or closes the whole connection."""
    fake = FakeBackend("slow", delay=0.02)
    router = Router(decode_config({}), [NamedBackend("slow", fake)])
    url = await serve_router(nursery, router)
    sock = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    body = json.dumps({"prompt": "x", "max_tokens": 10_000, "stream": True}).encode()
    headers = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"), (":authority", "router"),
               ("content-type", "application/json"), ("content-length", str(len(body)))]  # fmt: skip
    conn.send_headers(1, headers)
    await sock.send_all(conn.data_to_send())
    # Headers and body in separate writes: frontend/serving.py's DATA filter
    # drops DATA that arrives in the same read as its HEADERS (reported).
    await trio.sleep(0.05)
    conn.send_data(1, body, end_stream=True)
    await sock.send_all(conn.data_to_send())
    first: list[bytes] = []
    with trio.fail_after(5):
        while not first:
            events = conn.receive_data(await sock.receive_some(65536))
            first = [e.data for e in events if isinstance(e, h2.events.DataReceived)]
    assert first[0].startswith(b"data: {"), first
    assert fake.in_flight == 1 and router.actors[0].in_flight == 1
    gone_at = trio.current_time()
    if how == "rst_stream":
        conn.reset_stream(1)
        await sock.send_all(conn.data_to_send())
        await wait_idle(fake, router)
        await sock.aclose()
    else:
        await sock.aclose()
        await wait_idle(fake, router)
    assert fake.cancelled == 1 and fake.cancelled_at is not None
    assert fake.cancelled_at - gone_at < 0.1
    assert router.actors[0].statistics().cancelled == 1


@pytest.fixture
async def two_mock_servers(nursery: trio.Nursery) -> AsyncIterator[list[str]]:
    urls = []
    for i in range(2):
        app = OpenAIServer(MockBackend(MockConfig(name=f"m{i}", models=("mock",), tpot_s=0.001)))
        urls.append(await nursery.start(serve, app, ServeOptions()))
    yield urls


async def test_openai_sdk_chat_through_router_to_two_mock_servers(nursery: trio.Nursery, two_mock_servers: list[str]) -> None:
    backends = [NamedBackend(f"b{i}", OpenAIHTTPBackend(u, name=f"b{i}")) for i, u in enumerate(two_mock_servers)]
    # Round robin: the two identical requests go one to each server.
    router = Router(decode_config({"auth": {"keys": {"sk-test": "team"}}, "routing": {"policy": "round_robin"}}), backends)
    url = await serve_router(nursery, router)

    def use_sdk() -> tuple[str, str, int, str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        msgs = [{"role": "user", "content": "hello"}]
        full = client.chat.completions.create(model="mock", messages=msgs, max_tokens=5, seed=1)  # type: ignore[arg-type]
        chunks = list(
            client.chat.completions.create(
                model="mock", messages=msgs, max_tokens=5, seed=1, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and full.usage is not None
        try:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        except openai.AuthenticationError as exc:
            auth = str(exc.status_code)
        return full.choices[0].message.content or "", streamed, usage.completion_tokens, auth

    text, streamed, tokens, auth = await trio.to_thread.run_sync(use_sdk)
    assert text and text == streamed  # same seed, deterministic mock
    assert tokens == 5 and auth == "401"
    assert [a.statistics().requests for a in router.actors] == [1, 1]


async def test_tls_with_alpn_negotiates_h2(nursery: trio.Nursery, tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    router = Router(decode_config({}), [NamedBackend("a", FakeBackend("a"))])
    url = await serve_router(nursery, router, certfile=str(certfile), keyfile=str(keyfile))
    assert url.startswith("https://")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with httpx.AsyncClient(base_url=url, http2=True, verify=context) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.http_version == "HTTP/2"
    assert r.json()["choices"][0]["text"] == " t0 t1"


async def test_h2c_upgrade_is_accepted(nursery: trio.Nursery) -> None:
    router = Router(decode_config({}), [NamedBackend("a", FakeBackend("a"))])
    url = await serve_router(nursery, router)
    port = int(url.rsplit(":", 1)[1])
    conn = h2.connection.H2Connection()
    settings = conn.initiate_upgrade_connection()  # already base64url, as the header wants
    request = (
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
    )
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(5):
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101")
        assert b"upgrade: h2c" in head.lower()
        # the answer to the upgraded request arrives as HTTP/2 frames on stream 1
        await stream.send_all(conn.data_to_send())
        body, events = b"", conn.receive_data(rest)
        with trio.fail_after(5):
            while not any(isinstance(e, h2.events.StreamEnded) for e in events):
                body += b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
                events = conn.receive_data(await stream.receive_some(65536))
        body += b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert json.loads(body)["status"] == "ok"


@pytest.mark.slow
async def test_sigterm_lets_the_stream_in_flight_finish_and_refuses_new_connections(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[server]\ndrain_timeout = 10\n[[backends]]\nkind = "mock"\noptions = { tpot_s = 0.05 }\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "router.cli", "serve", "--workers", "1", "--config", str(config), "--port", "0", "--log-level", "WARNING"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        out = b""
        with trio.fail_after(20):
            while b"\n" not in out:
                out += await proc.stdout.receive_some(4096)
        line = out.decode().splitlines()[0]
        assert line.startswith("headrace listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        text = ""
        # HTTP/1.1: over h2 the request body can be dropped by frontend/serving.py (reported)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"prompt": "x", "max_tokens": 30, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for chunk in r.aiter_text():
                    text += chunk
                    if text.count("data: ") == 1:
                        proc.send_signal(signal.SIGTERM)
                        await trio.sleep(0.3)
                        with pytest.raises(httpx.ConnectError):
                            async with httpx.AsyncClient(base_url=url) as fresh:
                                await fresh.get("/health")
        assert text.rstrip().endswith("data: [DONE]")
        assert text.count('"text"') == 30
        with trio.fail_after(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

"""TLS: 1.2 or later with forward-secret AEAD ciphers only, and a rotated
certificate reloaded (SIGHUP, or ``ServeOptions.reload_certificates``)
without dropping a connection: new connections get the new certificate,
open ones keep theirs and go on serving; bad new files leave the old one in
service."""

from __future__ import annotations

import json
import signal
import ssl
from pathlib import Path
from typing import Any

import h2.errors
import h2.events
import pytest
import trio
import trustme
from cryptography import x509

from backends.mock import MockBackend, MockConfig
from frontend import lean_h2
from frontend.limits import Limits
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from frontend.tls import server_context
from tests.hardening.harness import RawH2, body_of, completion, of, start_mocks, start_router

pytestmark = pytest.mark.timeout(120)


class Files:
    """A certificate and key pair on disk, rotated by :meth:`install`."""

    def __init__(self, tmp: Path) -> None:
        self.ca = trustme.CA()
        self.certfile, self.keyfile = tmp / "cert.pem", tmp / "key.pem"

    def install(self) -> int:
        """Write a fresh certificate for 127.0.0.1; its serial number."""
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        cert.cert_chain_pems[0].write_to_path(str(self.certfile))
        cert.private_key_pem.write_to_path(str(self.keyfile))
        serial: int = x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes()).serial_number
        return serial

    def client(self, alpn: str = "http/1.1", **versions: ssl.TLSVersion) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        context.set_alpn_protocols([alpn])
        for name, value in versions.items():
            setattr(context, name, value)
        return context


async def _connect(port: int, context: ssl.SSLContext) -> tuple[trio.SSLStream[trio.SocketStream], int]:
    """A TLS connection after its handshake, and the server certificate's serial."""
    stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context, https_compatible=True)
    await stream.do_handshake()
    der = stream.getpeercert(binary_form=True)
    assert der is not None
    return stream, x509.load_der_x509_certificate(der).serial_number


async def _get(stream: trio.SSLStream[trio.SocketStream], path: str = "/health") -> bytes:
    """One HTTP/1.1 request on an open connection (kept alive); the status line."""
    await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
    got = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in got:
            got += await stream.receive_some(65536)
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += await stream.receive_some(65536)
    return head.split(b"\r\n")[0]


def test_the_server_context_allows_tls_12_and_later_with_forward_secret_aead_ciphers_only(tmp_path: Path) -> None:
    files = Files(tmp_path)
    files.install()
    context = server_context(str(files.certfile), str(files.keyfile))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_COMPRESSION and context.options & ssl.OP_NO_RENEGOTIATION
    tls12 = [c for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12 and all(c["kea"] == "kx-ecdhe" and c["aead"] for c in tls12), [c["name"] for c in tls12]


async def test_old_protocols_and_weak_ciphers_are_refused_modern_ones_served(nursery: trio.Nursery, tmp_path: Path) -> None:
    files = Files(tmp_path)
    files.install()
    url = await nursery.start(serve, OpenAIServer(MockBackend()),
                              ServeOptions(certfile=str(files.certfile), keyfile=str(files.keyfile), graceful_timeout=0.1))  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    for versions in ({}, {"maximum_version": ssl.TLSVersion.TLSv1_2}):
        stream, _ = await _connect(port, files.client(**versions))
        assert await _get(stream) == b"HTTP/1.1 200 "
        cipher, protocol, _ = stream.cipher()
        assert protocol in ("TLSv1.2", "TLSv1.3") and ("GCM" in cipher or "CHACHA20" in cipher), cipher
        await stream.aclose()
    old = files.client(minimum_version=ssl.TLSVersion.TLSv1, maximum_version=ssl.TLSVersion.TLSv1_1)
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    weak = files.client(maximum_version=ssl.TLSVersion.TLSv1_2)
    weak.set_ciphers("AES128-SHA:AES256-SHA")  # static RSA key exchange, CBC: no forward secrecy
    for context in (old, weak):
        with pytest.raises((ssl.SSLError, trio.BrokenResourceError)):
            await _connect(port, context)


async def test_a_reloaded_certificate_reaches_new_connections_while_open_ones_keep_serving(nursery: trio.Nursery, tmp_path: Path) -> None:
    files = Files(tmp_path)
    first = files.install()
    options = ServeOptions(certfile=str(files.certfile), keyfile=str(files.keyfile), graceful_timeout=0.1)
    port = int((await nursery.start(serve, OpenAIServer(MockBackend()), options)).rsplit(":", 1)[1])
    old, serial = await _connect(port, files.client())
    assert serial == first and await _get(old) == b"HTTP/1.1 200 "
    second = files.install()
    assert options.reload_certificates()
    new, serial = await _connect(port, files.client())
    assert serial == second != first
    assert await _get(old) == b"HTTP/1.1 200 "  # the open connection was not dropped
    assert await _get(new) == b"HTTP/1.1 200 "
    files.keyfile.write_text("not a key")  # a half-rotated pair: refused, the old one stays
    assert not options.reload_certificates()
    third, serial = await _connect(port, files.client())
    assert serial == second
    for stream in (old, new, third):
        await stream.aclose()


async def test_sighup_reloads_the_routers_certificate_without_dropping_a_connection(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``headrace serve`` with TLS: a connection opened before SIGHUP keeps
    its certificate and serves on; connections after it get the new one."""
    files = Files(tmp_path)
    first = files.install()
    urls, _ = await start_mocks(nursery, n=1)
    router = await start_router(nursery, tmp_path, urls, {"server.certfile": str(files.certfile), "server.keyfile": str(files.keyfile)})
    assert router.url.startswith("https://127.0.0.1:")
    assert router.admin_url.startswith("http://127.0.0.1:")  # loopback: plain HTTP
    old, serial = await _connect(router.port, files.client())
    assert serial == first and await _get(old) == b"HTTP/1.1 200 "
    second = files.install()
    router.process.send_signal(signal.SIGHUP)
    with trio.fail_after(10):
        while True:
            stream, serial = await _connect(router.port, files.client())
            await stream.aclose()
            if serial == second:
                break
            await trio.sleep(0.05)
    assert await _get(old) == b"HTTP/1.1 200 "
    assert router.process.returncode is None
    await old.aclose()


async def test_sighup_to_the_worker_supervisor_reaches_every_worker(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``--workers 2``: the workers run in sessions of their own; the
    supervisor passes SIGHUP on, so new connections, whichever worker the
    kernel gives them to, get the new certificate."""
    files = Files(tmp_path)
    files.install()
    urls, _ = await start_mocks(nursery, n=1)
    router = await start_router(nursery, tmp_path, urls, {"server.certfile": str(files.certfile), "server.keyfile": str(files.keyfile)},
                                workers=2)  # fmt: skip
    second = files.install()
    router.process.send_signal(signal.SIGHUP)
    with trio.fail_after(20):
        fresh = 0
        while fresh < 16:  # 16 new connections in a row, spread over both workers, see it
            stream, serial = await _connect(router.port, files.client())
            await stream.aclose()
            fresh = fresh + 1 if serial == second else 0
            if not fresh:
                await trio.sleep(0.05)
    assert router.process.returncode is None


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_without_tls_leaves_the_router_serving(nursery: trio.Nursery, tmp_path: Path, workers: int) -> None:
    """SIGHUP's default action ends a process; without TLS there is nothing
    to reload, and the router (and each worker) serves on."""
    urls, _ = await start_mocks(nursery, n=1)
    router = await start_router(nursery, tmp_path, urls, workers=workers)
    assert router.url.startswith("http://127.0.0.1:")
    for _ in range(2):
        router.process.send_signal(signal.SIGHUP)
        await trio.sleep(0.3)
    with trio.fail_after(10):
        for _ in range(8):  # fresh connections: over both workers too
            stream = await trio.open_tcp_stream("127.0.0.1", router.port)
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            head = await stream.receive_some(64)
            await stream.aclose()
            assert head.startswith(b"HTTP/1.1 200 "), head
    assert router.process.returncode is None


def _lean_connections(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each connection frontend/lean_h2.py's protocol serves from now on: its ``ssl`` flag."""
    built: list[bool] = []
    real = lean_h2.LeanH2Protocol.__init__

    def spy(self: lean_h2.LeanH2Protocol, *args: Any) -> None:
        built.append(args[5])  # (app, config, context, task_group, state, ssl, ...)
        real(self, *args)

    monkeypatch.setattr(lean_h2.LeanH2Protocol, "__init__", spy)
    return built


@pytest.mark.parametrize("ingress", ["lean", "hypercorn"])
async def test_http2_over_tls_answers_whole_streams_through_a_small_window(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ingress: str
) -> None:
    """ALPN ``h2`` is served by the HTTP/2 ingress ``h2_ingress`` names, the
    lean one by default, as cleartext HTTP/2 is. Eight streamed answers on
    one connection through a 1 KiB window the client credits as it reads:
    most of each answer waits for the window and leaves from the flush task
    through the TLS stream, yet every answer arrives whole and in order."""
    built = _lean_connections(monkeypatch)
    files = Files(tmp_path)
    files.install()
    options = ServeOptions(certfile=str(files.certfile), keyfile=str(files.keyfile), graceful_timeout=0.1, h2_ingress=ingress)
    port = int((await nursery.start(serve, OpenAIServer(MockBackend()), options)).rsplit(":", 1)[1])
    client = await RawH2.open(port, window=1024, tls=files.client("h2"))
    sids = [1 + 2 * i for i in range(8)]
    for sid in sids:
        client.request(sid, body=completion(120))
    await client.flush()
    await client.read_until(lambda events: len(of(events, h2.events.StreamEnded)) == len(sids), 30)
    assert not of(client.events, h2.events.StreamReset)
    assert sorted({e.stream_id for e in of(client.events, h2.events.DataReceived)}) == sids
    for sid in sids:
        body = body_of(client.events, sid)
        assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
        events = [json.loads(part[len(b"data: "):]) for part in body.split(b"\n\n")[:-2]]
        assert len(events) == 120 and all(len(e["choices"]) == 1 for e in events)  # every chunk whole JSON, in order
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert len(body) > 16 * 1024  # sixteen windows' worth and more
    assert built == ([True] if ingress == "lean" else [])
    await client.aclose()


async def test_a_tls_client_with_a_closed_window_has_its_streams_reset_at_the_write_stall(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lean ingress over TLS bounds a client that credits nothing as it
    does over cleartext (tests/hardening/test_slow_readers.py): after
    ``write_stall_timeout`` its streams are reset (CANCEL), and the server
    goes on answering other connections."""
    built = _lean_connections(monkeypatch)
    files = Files(tmp_path)
    files.install()
    options = ServeOptions(certfile=str(files.certfile), keyfile=str(files.keyfile), graceful_timeout=0.1,
                           limits=Limits(write_stall_timeout=1.0))  # fmt: skip
    port = int((await nursery.start(serve, OpenAIServer(MockBackend()), options)).rsplit(":", 1)[1])
    stalled = await RawH2.open(port, window=0, tls=files.client("h2"))
    for sid in (1, 3):
        stalled.request(sid, body=completion(100))
    await stalled.flush()
    started = trio.current_time()
    await stalled.read_until(lambda events: len(of(events, h2.events.StreamReset)) == 2, 10)
    waited = trio.current_time() - started
    assert {e.error_code for e in of(stalled.events, h2.events.StreamReset)} == {h2.errors.ErrorCodes.CANCEL}
    assert 0.9 <= waited < 6, waited
    assert not of(stalled.events, h2.events.DataReceived)  # a closed window: nothing got through
    other = await RawH2.open(port, tls=files.client("h2"))
    other.request(1, body=completion(5))
    await other.flush()
    await other.read_until(lambda events: bool(of(events, h2.events.StreamEnded)), 10)
    assert body_of(other.events, 1).endswith(b"data: [DONE]\n\n")
    assert built == [True, True]
    for client in (stalled, other):
        await client.aclose()


@pytest.mark.parametrize("ingress", ["lean", "hypercorn"])
async def test_a_tls_client_that_stops_reading_the_socket_is_cut_off(nursery: trio.Nursery, tmp_path: Path, ingress: str) -> None:
    """A client whose window is wide open but who reads nothing from its
    TLS connection: the server's write blocks inside the TLS stream, and
    ``write_stall_timeout`` later the connection is closed (the client then
    reads what the sockets held, and an end); other connections are served."""
    files = Files(tmp_path)
    files.install()
    options = ServeOptions(certfile=str(files.certfile), keyfile=str(files.keyfile), graceful_timeout=0.1,
                           limits=Limits(write_stall_timeout=1.0), h2_ingress=ingress)  # fmt: skip
    backend = MockBackend(MockConfig(max_tokens=100_000, max_context=200_000))
    port = int((await nursery.start(serve, OpenAIServer(backend), options)).rsplit(":", 1)[1])
    stalled = await RawH2.open(port, window=2**31 - 1, tls=files.client("h2"))
    stalled.conn.increment_flow_control_window(2**30)
    for i in range(8):
        stalled.request(1 + 2 * i, body=completion(20_000))
    await stalled.flush()
    await trio.sleep(4)  # the sockets fill, then the write stalls past its timeout
    other = await RawH2.open(port, tls=files.client("h2"))
    other.request(1, body=completion(5))
    await other.flush()
    await other.read_until(lambda events: bool(of(events, h2.events.StreamEnded)), 10)
    assert body_of(other.events, 1).endswith(b"data: [DONE]\n\n")
    await stalled.read(15)  # what the sockets held, then the end
    assert stalled.closed, "the stalled connection was not closed"
    answered = {e.stream_id for e in of(stalled.events, h2.events.StreamEnded)}
    assert len(answered) < 8, "every answer fitted in the sockets: nothing stalled"
    for client in (stalled, other):
        await client.aclose()

"""Shared helpers for the backend tests: collect a stream, serve the mock on
loopback (plain, or TLS with a trustme CA)."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme

from backends.base import Backend, Event, GenerateRequest
from backends.mock import Fault, MockBackend, MockConfig
from backends.mock_server import FaultInjector, build_app
from frontend.serving import ServeOptions, serve


async def collect(backend: Backend, request: GenerateRequest) -> list[Event]:
    async with aclosing(backend.stream(request)) as events:  # type: ignore[type-var]
        return [e async for e in events]


async def collect_until_error(
    backend: Backend, request: GenerateRequest
) -> tuple[list[Event], BaseException]:
    """The events before the stream failed, and the error (the test fails if
    the stream ends cleanly)."""
    got: list[Event] = []
    try:
        async with aclosing(backend.stream(request)) as events:  # type: ignore[type-var]
            async for e in events:
                got.append(e)
    except Exception as exc:
        return got, exc
    raise AssertionError(f"stream ended cleanly after {len(got)} events")


def ids_of(events: Sequence[Event]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def text_of(events: Sequence[Event]) -> str:
    return "".join(e.text for e in events)


@dataclass
class Served:
    url: str
    backend: MockBackend
    injector: FaultInjector


async def serve_mock(
    nursery: trio.Nursery,
    config: MockConfig | None = None,
    faults: Sequence[Fault] = (),
    *,
    fault_rate: float = 1.0,
    certs: TLSFiles | None = None,
) -> Served:
    backend = MockBackend(config)
    app = build_app(backend, faults, fault_rate=fault_rate)
    options = ServeOptions(
        certfile=certs.certfile if certs else None,
        keyfile=certs.keyfile if certs else None,
        graceful_timeout=0.5,
    )
    url = await nursery.start(serve, app, options)
    return Served(url, backend, app)


@dataclass
class TLSFiles:
    certfile: str
    keyfile: str
    client_context: ssl.SSLContext


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    root: Path = tmp_path_factory.mktemp("tls")
    certfile, keyfile = root / "cert.pem", root / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return TLSFiles(str(certfile), str(keyfile), context)


async def eventually(predicate: Callable[[], bool], within: float, poll: float = 0.002) -> float:
    """Wait until ``predicate()`` holds (polling state owned by another
    task); return how long it took. Fails the test after ``within`` seconds."""
    start = trio.current_time()
    with trio.fail_after(within):
        while True:
            if predicate():
                return trio.current_time() - start
            await trio.sleep(poll)

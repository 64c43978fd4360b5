"""What the resistance battery is made of: a real ``headrace serve`` process
(measured from outside: RSS, descriptors, CPU) in front of in-process mock
servers (whose generations are counted), raw ``h2`` and socket clients, and a
well-behaved neighbour on another source address (127.0.0.2, so that per
address caps never count it with the attacker)."""

from __future__ import annotations

import json
import math
import os
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import psutil
import trio

from backends.base import Event, GenerateRequest
from backends.mock import MockBackend, MockConfig
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve

REPO = Path(__file__).resolve().parents[2]
NEIGHBOUR_ADDRESS = "127.0.0.2"


ATTACK_PROMPT = "attack"


class CountingMock(MockBackend):
    """A mock that counts the events it has generated for the attacker
    (requests whose prompt is :data:`ATTACK_PROMPT`)."""

    events = 0

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        counted = request.prompt == ATTACK_PROMPT
        async for event in super().stream(request):
            self.events += counted
            yield event


async def start_mocks(nursery: trio.Nursery, n: int = 2, **config: Any) -> tuple[list[str], list[CountingMock]]:
    mocks = [CountingMock(MockConfig(name=f"m{i}", models=("mock",), **config)) for i in range(n)]
    urls = [await nursery.start(serve, OpenAIServer(m), ServeOptions(graceful_timeout=0.1)) for m in mocks]
    return urls, mocks


@dataclass
class RouterProcess:
    """``headrace serve`` (one process unless ``workers``) with ``--set``
    overrides; stderr goes to ``log`` (read it with :meth:`log_text`)."""

    process: trio.Process
    url: str
    log: Path
    admin_url: str  # /metrics and /admin/* (127.0.0.1, its own listener)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def usage(self) -> tuple[float, int, float]:
        """(RSS in MiB, open descriptors, CPU seconds)."""
        p = psutil.Process(self.process.pid)
        cpu = p.cpu_times()
        return p.memory_info().rss / 2**20, p.num_fds(), cpu.user + cpu.system

    async def memory(self) -> dict[str, Any]:
        """The router's ``GET /admin/memory``: resident, C heap in use and free, Python blocks."""
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=5) as client:
            report: dict[str, Any] = (await client.get("/admin/memory")).json()
            return report

    def log_text(self) -> str:
        """stderr and stdout (the access log) so far."""
        out = self.log.with_name("router.out")
        return self.log.read_text(errors="replace") + (out.read_text(errors="replace") if out.exists() else "")

    async def backends(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=5) as client:
            r = await client.get("/admin/backends")
            data: list[dict[str, Any]] = r.json()["data"]
            return data


async def start_router(
    nursery: trio.Nursery,
    tmp: Path,
    backends: list[str],
    settings: dict[str, Any] | None = None,
    *,
    nofile: int | None = None,
    log_level: str = "WARNING",
    workers: int = 1,
) -> RouterProcess:
    """Start the router; it is killed when ``nursery`` is cancelled."""
    command = [sys.executable, "-m", "router.cli", "serve", "--workers", str(workers), "--port", "0", "--log-level", log_level]
    for url in backends:
        command += ["--backend", url]
    if os.environ.get("HEADRACE_HARDENING_BEFORE"):  # measuring a checkout without the new settings
        settings = {}
    if os.environ.get("HEADRACE_H2_INGRESS"):  # the battery against another HTTP/2 ingress (conftest.py)
        settings = {"server.h2_ingress": os.environ["HEADRACE_H2_INGRESS"], **(settings or {})}
    for key, value in (settings or {}).items():
        command += ["--set", f"{key}={_toml(value)}"]
    if nofile is not None:
        command = ["sh", "-c", f'ulimit -n {nofile} && exec "$@"', "sh", *command]
    log = tmp / "router.log"
    stderr = log.open("wb")
    process: trio.Process = await nursery.start(
        lambda task_status: trio.run_process(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, task_status=task_status, deliver_cancel=_kill,
        )
    )  # fmt: skip
    stderr.close()
    assert process.stdout is not None
    out = b""
    with trio.fail_after(30):
        while out.count(b"\n") < 2:
            chunk = await process.stdout.receive_some(4096)
            assert chunk, f"the router exited: {log.read_text()}"
            out += chunk
    listening, admin = out.decode().splitlines()[:2]
    assert listening.startswith("headrace listening on "), listening
    assert admin.startswith("headrace admin on "), admin
    nursery.start_soon(_drain, process.stdout, tmp / "router.out", out)
    return RouterProcess(process, listening.rsplit(" ", 1)[1], log, admin.rsplit(" ", 1)[1])


async def _drain(stdout: trio.abc.ReceiveStream, path: Path, first: bytes) -> None:
    """Keep reading the router's stdout (its access log goes there) into ``path``."""
    with path.open("wb", buffering=0) as f:
        f.write(first)
        while chunk := await stdout.receive_some(65536):
            f.write(chunk)


def _toml(value: Any) -> str:
    """A TOML value (what ``--set`` takes): JSON spells scalars the same way."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


async def _kill(process: trio.Process) -> None:
    process.kill()


def completion(max_tokens: int, *, stream: bool = True, prompt: str = "x") -> bytes:
    return json.dumps({"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}).encode()


class RawH2:
    """A raw HTTP/2 client: one socket, one h2 state machine, no reader task."""

    def __init__(self, sock: trio.abc.Stream, conn: h2.connection.H2Connection, scheme: str = "http") -> None:
        self.sock, self.conn, self.scheme = sock, conn, scheme
        self.events: list[h2.events.Event] = []
        self.closed = False

    @classmethod
    async def open(cls, port: int, *, window: int | None = None, validate: bool = True,
                   local_address: str | None = None, tls: ssl.SSLContext | None = None) -> RawH2:  # fmt: skip
        """``tls``: over TLS with this context (its ALPN should offer ``h2``)."""
        sock: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=local_address)
        if tls is not None:
            sock = trio.SSLStream(sock, tls, server_hostname="127.0.0.1", https_compatible=True)
            await sock.do_handshake()
            assert sock.selected_alpn_protocol() == "h2", sock.selected_alpn_protocol()
        config = h2.config.H2Configuration(client_side=True, validate_outbound_headers=validate,
                                           normalize_outbound_headers=validate)  # fmt: skip
        conn = h2.connection.H2Connection(config)
        if window is not None:
            conn.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
            )
        conn.initiate_connection()
        client = cls(sock, conn, "http" if tls is None else "https")
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.sock.send_all(data)

    def headers(self, path: str = "/v1/completions", body: bytes = b"", extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        method = "POST" if body else "GET"
        base = [(":method", method), (":path", path), (":scheme", self.scheme), (":authority", "router")]
        if body:
            base += [("content-type", "application/json"), ("content-length", str(len(body)))]
        return base + list(extra)

    def request(self, sid: int, path: str = "/v1/completions", body: bytes = b"",
                extra: Sequence[tuple[str, str]] = ()) -> None:  # fmt: skip
        """Queue HEADERS (and the body, in the same write) for stream ``sid``."""
        self.conn.send_headers(sid, self.headers(path, body, extra), end_stream=not body)
        if body:
            self.conn.send_data(sid, body, end_stream=True)

    async def read(self, seconds: float, *, ack: bool = True) -> list[h2.events.Event]:
        """Events received within ``seconds`` (or until the server closes)."""
        got: list[h2.events.Event] = []
        with trio.move_on_after(seconds):
            while not self.closed:
                try:
                    data = await self.sock.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.closed = True
                    break
                for event in self.conn.receive_data(data):
                    got.append(event)
                    if ack and isinstance(event, h2.events.DataReceived):
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                try:
                    # A TLS stream's write cut short is a broken stream: over TLS
                    # the read's time limit waits for the write (bounded itself).
                    tls = self.scheme == "https"
                    with trio.CancelScope(shield=tls, deadline=trio.current_time() + 10 if tls else math.inf):
                        await self.flush()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.closed = True
        self.events += got
        return got

    async def read_until(self, done: Any, seconds: float) -> list[h2.events.Event]:
        """Read until ``done(all events so far)``; fails after ``seconds``."""
        with trio.fail_after(seconds):
            while not done(self.events):
                await self.read(0.05)
                if self.closed and not done(self.events):
                    raise AssertionError(f"closed before done: {self.events[-5:]}")
        return self.events

    async def aclose(self) -> None:
        await self.sock.aclose()


def of(events: list[h2.events.Event], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def body_of(events: list[h2.events.Event], sid: int) -> bytes:
    """The DATA stream ``sid`` received, in order."""
    return b"".join(e.data for e in of(events, h2.events.DataReceived) if e.stream_id == sid)


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else float("nan")


@dataclass
class Neighbour:
    """A well-behaved client on its own connection from another address:
    short streamed completions one after another; latencies and errors, and
    when each request began (``time.monotonic()``, one clock for every
    process on the machine)."""

    url: str
    max_tokens: int = 4
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)

    async def run(self, until: trio.Event) -> None:
        transport = httpx.AsyncHTTPTransport(local_address=NEIGHBOUR_ADDRESS)
        async with httpx.AsyncClient(base_url=self.url, transport=transport, timeout=10) as client:
            while not until.is_set():
                start = trio.current_time()
                self.starts.append(time.monotonic())
                try:
                    r = await client.post("/v1/completions", content=completion(self.max_tokens))
                    if r.status_code != 200 or not r.text.rstrip().endswith("data: [DONE]"):
                        self.errors.append(f"{r.status_code} {r.text[-200:]}")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self.latencies.append(trio.current_time() - start)
                await trio.sleep(0.02)

    def p99(self) -> float:
        return p99(self.latencies)

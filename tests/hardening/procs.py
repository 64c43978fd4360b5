"""The battery's mocks and its neighbour, each in a process of its own.

In one test process, the mocks generating for an attacker's 100 streams (some
20,000 events/s) and the neighbour's client share one event loop: the
neighbour then measures that loop's lag, not the router's. Here each mock
is ``python -m tests.hardening.procs mock CONFIG`` (a :class:`CountingMock`
served over HTTP/2 like the in-process ones, its counters at ``GET /counts``),
and the neighbour ``python -m tests.hardening.procs neighbour URL OUT``: the
harness's :class:`Neighbour` until SIGTERM, then what it measured (each
request's start and latency, and the errors) to ``OUT`` as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from backends.mock import MockConfig
from frontend.server import HTTPRequest, OpenAIServer, Response, json_response
from frontend.serving import ServeOptions, serve, wait_for_signal
from tests.hardening.harness import REPO, CountingMock, Neighbour

__all__ = ["MockProcess", "NeighbourProcess", "start_mock_processes", "start_neighbour_process"]


# ----------------------------------------------------------- in the child


async def _mock(config: dict[str, Any]) -> None:
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    mock = CountingMock(MockConfig(name="m", models=("mock",), **config))

    async def counts(request: HTTPRequest) -> Response:
        return json_response({"events": mock.events, "cancelled": mock.statistics().cancelled})

    app = OpenAIServer(mock, extra_routes={("GET", "/counts"): counts})
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_signal, shutdown)
        url = await nursery.start(lambda task_status: serve(
            app, ServeOptions(graceful_timeout=0.1), shutdown=shutdown, task_status=task_status))
        print(f"mock listening on {url}", flush=True)


async def _neighbour(url: str, max_tokens: int) -> dict[str, Any]:
    neighbour, stop = Neighbour(url, max_tokens), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(neighbour.run, stop)
        print("neighbour running", flush=True)
        await wait_for_signal(stop)
    return {"starts": neighbour.starts, "latencies": neighbour.latencies, "errors": neighbour.errors}


def main(argv: list[str]) -> None:
    if argv[0] == "mock":
        trio.run(_mock, json.loads(argv[1]))
    elif argv[0] == "neighbour":
        done = trio.run(_neighbour, argv[1], int(argv[3]) if len(argv) > 3 else 4)
        Path(argv[2]).write_text(json.dumps(done))
    else:
        raise SystemExit(f"unknown role {argv[0]!r}")


# ---------------------------------------------------------- in the test


async def _child(nursery: trio.Nursery, argv: list[str], ready: bytes) -> tuple[trio.Process, str]:
    process: trio.Process = await nursery.start(
        lambda task_status: trio.run_process(
            [sys.executable, "-m", "tests.hardening.procs", *argv], cwd=REPO,
            stdout=subprocess.PIPE, check=False, task_status=task_status))
    assert process.stdout is not None
    line = b""
    with trio.fail_after(30):
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(1)
            assert chunk, f"{argv[0]} exited before it was ready"
            line += chunk
    assert line.startswith(ready), line
    return process, line.decode().strip().rsplit(" ", 1)[-1]


@dataclass
class MockProcess:
    url: str
    process: trio.Process

    async def counts(self) -> dict[str, int]:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
            r = await http.get("/counts")
            r.raise_for_status()
            return r.json()  # type: ignore[no-any-return]


async def start_mock_processes(nursery: trio.Nursery, n: int = 2, **config: Any) -> list[MockProcess]:
    """``n`` mock processes, each a :class:`CountingMock` with ``config``;
    killed when ``nursery`` is cancelled."""
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    mocks = []
    for _ in range(n):
        process, url = await _child(nursery, ["mock", json.dumps(cfg)], b"mock listening on ")
        mocks.append(MockProcess(url, process))
    return mocks


@dataclass
class NeighbourProcess:
    """The neighbour's process; :meth:`finish` stops it and reads what it measured."""

    process: trio.Process
    out: Path
    runs: list[tuple[float, float]] = field(default_factory=list)  # (start, latency)
    failures: list[str] = field(default_factory=list)

    async def finish(self) -> None:
        self.process.terminate()
        with trio.fail_after(15):
            await self.process.wait()
        done = json.loads(self.out.read_text())
        self.runs = list(zip(done["starts"], done["latencies"], strict=True))
        self.failures = done["errors"]

    def latencies(self, since: float = float("-inf"), until: float = float("inf")) -> list[float]:
        return [s for at, s in self.runs if since <= at < until]

    def errors(self) -> list[str]:
        return self.failures


async def start_neighbour_process(nursery: trio.Nursery, url: str, tmp: Path) -> NeighbourProcess:
    out = tmp / "neighbour.json"
    process, _ = await _child(nursery, ["neighbour", url, str(out)], b"neighbour running")
    return NeighbourProcess(process, out)


if __name__ == "__main__":
    main(sys.argv[1:])

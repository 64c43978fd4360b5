"""``headrace serve --workers N``: N router processes on one port.

::

    headrace serve (supervisor: no HTTP, no actors)
      ├─ engine replicas        only when no backend is configured: started once,
      │                         here, and given to every worker as [[backends]]
      ├─ the port               bound with SO_REUSEPORT, not listening: --port 0
      │                         is resolved once, and the port stays ours
      ├─ a temporary directory  the workers' config, PROMETHEUS_MULTIPROC_DIR
      │                         (router/metrics.py) and the workers' private admin
      │                         URLs (router/admin_fanout.py); removed at exit
      └─ worker i = headrace serve --worker-config <dir>/worker.json --worker-index i
                                its own Router and actors, listening with
                                SO_REUSEPORT on the port; the kernel spreads
                                connections across the workers

Every worker gets the same config, so placement agrees across them without
talking (the routing policies are deterministic over the same backend set).
The supervisor prints ``headrace listening on <url>`` once all workers listen.
A worker that exits is restarted with backoff (its connections are lost, the
others keep serving). SIGTERM or SIGINT: each worker gets SIGTERM and drains
as a single router does; the supervisor exits when all have exited (a worker
still alive ``drain_timeout`` + :data:`KILL_GRACE` seconds later is killed).

Workers run in their own session, so a terminal's Ctrl-C reaches the
supervisor only (which forwards SIGTERM once), and read their stdin, a pipe
from the supervisor: end of file means the supervisor is gone, and they drain.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path

import msgspec
import trio
from prometheus_client import multiprocess

from frontend.serving import reserve_port
from router.admin_fanout import PEERS_ENV
from router.config import BackendSpec, RouterConfig, with_overrides
from router.factory import default_backends
from router.replicas import echo_until, relay, terminate

__all__ = ["KILL_GRACE", "LISTENING", "Worker", "WorkerFailed", "serve_workers", "watch_parent"]

log = logging.getLogger(__name__)

LISTENING = "headrace listening on "
KILL_GRACE = 10.0  # seconds past drain_timeout before a worker is killed

StartBackends = Callable[[trio.Nursery], Awaitable[Sequence[str | BackendSpec]]]  # URLs, or specs (router/engines.py)


class WorkerFailed(Exception):
    """A worker exited before it was listening."""


class Worker:
    """One ``headrace serve`` worker process: reports its URL once it
    listens, restarts it when it exits, drains it when ``shutdown`` is set."""

    def __init__(
        self,
        index: int,
        command: list[str],
        env: dict[str, str],
        *,
        drain_timeout: float,
        on_exit: Callable[[int], None] = lambda pid: None,
        backoff: float = 0.5,
        backoff_max: float = 30.0,
        startup_timeout: float = 120.0,
    ) -> None:
        self.index = index
        self.command = command
        self.env = env
        self.drain_timeout = drain_timeout
        self.on_exit = on_exit
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.startup_timeout = startup_timeout
        self.pid: int | None = None
        self.restarts = 0

    async def run(self, shutdown: trio.Event, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until ``shutdown`` is set and the worker has drained."""
        url = await self._run_once(shutdown, task_status)
        delay = self.backoff
        while not shutdown.is_set():
            self.restarts += 1
            log.error("router worker %d (%s) exited; restarting in %.1f s", self.index, url, delay)
            with trio.move_on_after(delay):
                await shutdown.wait()
            if shutdown.is_set():
                return
            started = trio.current_time()
            await self._run_once(shutdown, None)
            ran = trio.current_time() - started
            delay = self.backoff if ran > self.backoff_max else min(delay * 2, self.backoff_max)

    async def _run_once(self, shutdown: trio.Event, task_status: trio.TaskStatus[str] | None) -> str:
        url = ""
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    self.command,
                    stdin=subprocess.PIPE,  # never written: its end of file tells the worker we are gone
                    stdout=subprocess.PIPE,
                    check=False,
                    env=self.env,
                    start_new_session=True,
                    deliver_cancel=terminate,
                )
            )
            self.pid = process.pid
            try:
                url = await self._wait_listening(process)
            except WorkerFailed:
                if task_status is not None:
                    raise
                url = "not listening"
            else:
                if task_status is not None:
                    task_status.started(url)
                nursery.start_soon(relay, process)
                # Only now: a worker has installed its SIGTERM handler before it listens.
                nursery.start_soon(self._drain_on, shutdown, process)
            await process.wait()
            nursery.cancel_scope.cancel()
        self.on_exit(process.pid)
        return url

    async def _wait_listening(self, process: trio.Process) -> str:
        assert process.stdout is not None
        with trio.move_on_after(self.startup_timeout):
            # Not echoed: the supervisor prints its own line once all listen.
            url = await echo_until(process.stdout, LISTENING, echo_match=False)
            if url is not None:
                return url.strip()
        process.kill()
        raise WorkerFailed(f"router worker {self.index} exited before listening (exit status {process.returncode})")

    async def _drain_on(self, shutdown: trio.Event, process: trio.Process) -> None:
        await shutdown.wait()
        await terminate(process, grace=self.drain_timeout + KILL_GRACE)


async def serve_workers(
    config: RouterConfig,
    workers: int,
    *,
    start_backends: StartBackends,
    shutdown: trio.Event,
    log_level: str = "INFO",
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``workers`` router processes for ``config`` until ``shutdown`` is
    set and they have drained; ``task_status.started`` gets the URL once all
    listen. ``start_backends(nursery)`` starts the engine replicas (their
    URLs), called only when ``config`` names no backend."""
    with tempfile.TemporaryDirectory(prefix="headrace-workers-") as tmp:
        async with trio.open_nursery() as nursery:
            if not config.backends:
                config = with_overrides(config, backends=default_backends(await start_backends(nursery)))
            reserved = reserve_port(config.server.host, config.server.port)
            try:
                config = with_overrides(config, port=reserved.getsockname()[1], workers=1)
                path, metrics_dir = _write_worker_files(Path(tmp), config)
                env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONUNBUFFERED": "1",
                       PEERS_ENV: str(Path(tmp) / "admin-peers")}  # router/admin_fanout.py  # fmt: skip
                children = [
                    Worker(
                        i,
                        worker_command(path, i, log_level),
                        env,
                        drain_timeout=config.server.drain_timeout,
                        on_exit=partial(multiprocess.mark_process_dead, path=str(metrics_dir)),
                    )
                    for i in range(workers)
                ]
                urls = [""] * workers
                async with trio.open_nursery() as running:

                    async def start(i: int) -> None:
                        urls[i] = await running.start(children[i].run, shutdown)

                    async with trio.open_nursery() as starting:
                        for i in range(workers):
                            starting.start_soon(start, i)
                    task_status.started(urls[0])
            finally:
                reserved.close()
            nursery.cancel_scope.cancel()  # the engine replicas


def _write_worker_files(tmp: Path, config: RouterConfig) -> tuple[Path, Path]:
    """The workers' config file and their multiprocess metrics directory."""
    (metrics := tmp / "metrics").mkdir()
    (path := tmp / "worker.json").write_bytes(msgspec.json.encode(config))
    return path, metrics


def worker_command(config_path: Path, index: int, log_level: str) -> list[str]:
    return [
        sys.executable, "-m", "router.cli", "serve",
        "--worker-config", str(config_path), "--worker-index", str(index), "--log-level", log_level,
    ]  # fmt: skip


async def watch_parent(shutdown: trio.Event) -> None:
    """Set ``shutdown`` when stdin (the supervisor's pipe) reaches end of file."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    log.warning("the worker supervisor is gone: draining")
    shutdown.set()

"""Local engine replicas: ``headrace serve`` with nothing configured runs the
built-in engine as child processes and routes to them over HTTP.

Each replica is an actor: a task that owns one ``headrace engine`` process,
reports its URL once the engine says it is serving, restarts it with backoff
if it dies, and kills it when cancelled. The processes are real servers, so
the router talks to them exactly as it would to a remote vLLM.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial

import trio

__all__ = ["EngineReplica"]

log = logging.getLogger(__name__)

_READY_PREFIX = "engine serving "


class EngineReplica:
    """One ``headrace engine`` child process on 127.0.0.1 (a free port)."""

    def __init__(
        self,
        name: str,
        args: Sequence[str] = (),
        *,
        startup_timeout: float = 300.0,
        restart_backoff: float = 1.0,
        restart_backoff_max: float = 30.0,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self.restart_backoff = restart_backoff
        self.restart_backoff_max = restart_backoff_max
        self.port: int | None = None  # fixed after the first start, so the URL stays valid
        self.restarts = 0

    def command(self) -> list[str]:
        port = str(self.port if self.port is not None else 0)
        return [sys.executable, "-m", "router.cli", "engine", "--host", "127.0.0.1", "--port", port, *self.args]

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine, report its URL, keep it running until cancelled."""
        delay = self.restart_backoff
        started = False
        while True:
            url = await self._run_once(task_status if not started else None)
            started = True
            self.restarts += 1
            log.error("engine replica %s (%s) exited; restarting in %.1f s", self.name, url, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, self.restart_backoff_max)

    async def _run_once(self, task_status: trio.TaskStatus[str] | None) -> str:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    self.command(),
                    stdout=subprocess.PIPE,
                    check=False,
                    env=env,
                    deliver_cancel=_terminate,
                )
            )
            assert process.stdout is not None
            url = await self._wait_ready(process)
            if task_status is not None:
                task_status.started(url)
            # Keep relaying stdout so the child never blocks on a full pipe.
            async for chunk in process.stdout:
                _echo(chunk)
            await process.wait()
        return url

    async def _wait_ready(self, process: trio.Process) -> str:
        assert process.stdout is not None
        buffer = b""
        with trio.fail_after(self.startup_timeout):
            async for chunk in process.stdout:
                _echo(chunk)
                buffer += bytes(chunk)
                for line in buffer.decode(errors="replace").splitlines():
                    if line.startswith(_READY_PREFIX) and " on " in line:
                        url = line.rsplit(" on ", 1)[1].strip()
                        self.port = int(url.rsplit(":", 1)[1])
                        return url
        raise RuntimeError(f"engine replica {self.name} exited before serving (exit code {process.returncode})")


def _echo(chunk: bytes | bytearray) -> None:
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()


async def _terminate(process: trio.Process) -> None:
    """SIGTERM, then SIGKILL after 5 s."""
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(5):
        await process.wait()
        return
    process.kill()

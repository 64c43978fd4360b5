"""Local engine replicas: ``headrace serve`` with nothing configured runs the
built-in engine as child processes and routes to them over HTTP.

Each replica is an actor: a task that owns one ``headrace engine`` process,
reports its URL once the engine says it is serving, restarts it with backoff
if it dies, and kills it when cancelled. The processes are real servers, so
the router talks to them exactly as it would to a remote vLLM.

Once it serves, the actor reads the engine's ``footprint`` from its
``/v1/models`` (load time, weights, KV cache, RSS; backends/engine/footprint.py)
and times its cold start, process start to serving (``cold_start_seconds``):
router/engines.py places the next replica of the model on these numbers.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial

import httpx
import msgspec
import trio

__all__ = ["EngineReplica", "echo_until", "read_footprint", "relay", "terminate"]

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
        program: Sequence[str] | None = None,
        ready_prefix: str = _READY_PREFIX,
    ) -> None:
        self.name = name
        self.args = list(args)
        # The command before --host/--port/args (default: this Python's headrace engine), and
        # what its serving line starts with (the rest: "... on <url>"): tests run mocks.
        self.program = list(program) if program is not None else [sys.executable, "-m", "router.cli", "engine"]
        self.ready_prefix = ready_prefix
        self.startup_timeout = startup_timeout
        self.restart_backoff = restart_backoff
        self.restart_backoff_max = restart_backoff_max
        self.port: int | None = None  # fixed after the first start, so the URL stays valid
        self.restarts = 0
        self.footprint: dict[str, object] | None = None  # the engine's own report, once serving
        self.cold_start_seconds: float | None = None  # the last start: process start to serving
        self.served: str | None = None  # the model name in its serving line

    def command(self) -> list[str]:
        port = str(self.port if self.port is not None else 0)
        return [*self.program, "--host", "127.0.0.1", "--port", port, *self.args]

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
        began = trio.current_time()
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    self.command(),
                    stdout=subprocess.PIPE,
                    check=False,
                    env=env,
                    deliver_cancel=terminate,
                )
            )
            url = await self._wait_ready(process)
            self.cold_start_seconds = trio.current_time() - began
            self.footprint = await read_footprint(url)
            if task_status is not None:
                task_status.started(url)
            await relay(process)
            await process.wait()
        return url

    async def _wait_ready(self, process: trio.Process) -> str:
        assert process.stdout is not None
        with trio.fail_after(self.startup_timeout):
            line = await echo_until(process.stdout, self.ready_prefix)
        if line is None or " on " not in line:
            raise RuntimeError(f"engine replica {self.name} exited before serving (exit code {process.returncode})")
        self.served, url = (part.strip() for part in line.rsplit(" on ", 1))
        self.port = int(url.rsplit(":", 1)[1])
        return url


async def read_footprint(url: str, wait: float = 10.0) -> dict[str, object] | None:
    """The first model's ``footprint`` in ``url``'s /v1/models; None when it
    reports none (another server) or cannot be read (logged)."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=wait) as client:
            response = await client.get("/v1/models")
        data = msgspec.json.decode(response.content).get("data") or [{}]
    except (httpx.HTTPError, msgspec.DecodeError, AttributeError) as exc:
        log.warning("cannot read the footprint of %s: %s", url, exc)
        return None
    footprint = data[0].get("footprint") if isinstance(data[0], dict) else None
    return footprint if isinstance(footprint, dict) else None


# Shared with router/workers.py: a supervisor's child processes, their output and their end.


async def echo_until(stdout: trio.abc.ReceiveStream, prefix: str, *, echo_match: bool = True) -> str | None:
    """Copy a child's ``stdout`` to ours, line by line, until a line starts
    with ``prefix``: the rest of that line (None at end of file). Only whole
    lines are matched, so a line split across reads is never taken half."""
    buffer = b""
    async for chunk in stdout:
        buffer += bytes(chunk)
        *lines, buffer = buffer.split(b"\n")
        for i, line in enumerate(lines):
            text = line.decode(errors="replace")
            if text.startswith(prefix):
                after = lines[i + 1 :] if not echo_match else lines[i:]
                _echo(b"".join(rest + b"\n" for rest in after) + buffer)
                return text[len(prefix) :]
            _echo(line + b"\n")
    _echo(buffer)
    return None


async def relay(process: trio.Process) -> None:
    """Keep copying the child's stdout, so it never blocks on a full pipe."""
    assert process.stdout is not None
    async for chunk in process.stdout:
        _echo(chunk)


def _echo(chunk: bytes | bytearray) -> None:
    if chunk:
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()


async def terminate(process: trio.Process, *, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace):
        await process.wait()
        return
    log.error("child process %d still running %.0f s after SIGTERM: killing it", process.pid, grace)
    process.kill()

"""Server processes a benchmark starts, and the CPU time they spend.

A server is started with its output in a log file (a pipe nobody reads would
fill and stall it) and is ready once it prints ``... listening on URL``; its
CPU time is its own plus its descendants' (a supervisor's workers), read with
psutil, so that CPU per request is measured in the process that spent it.
Each one is stopped with SIGTERM, then SIGKILL for it and its descendants.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import trio

from backends.errors import BackendUnavailable

__all__ = ["Server", "admin_url", "cpu_info", "cpu_seconds", "start_server"]

_LISTENING = re.compile(rb"(?:listening|engine serving \S+) on (http://\S+)")  # servers; the engine
_ADMIN = re.compile(rb"headrace admin on (https?://\S+)\n")


class Server:
    """A started server: its process, base URL and log."""

    def __init__(self, name: str, process: trio.Process, url: str, log: Path) -> None:
        self.name, self.process, self.url, self.log = name, process, url, log

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, and SIGKILL for what is still alive after ``grace`` s."""
        family = _family(self.pid)
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await self.process.wait()
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
        with trio.move_on_after(grace):
            await self.process.wait()


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    total = 0.0
    for p in _family(pid):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def start_server(name: str, argv: list[str], logdir: Path, *,
                       patience: float = 60.0, cwd: Path | None = None,
                       env: dict[str, str] | None = None) -> Server:
    """Start ``argv`` (in ``cwd``: ``python -m`` then imports that checkout; ``env``:
    variables set beside this process's) and wait (``patience`` s at most) for its
    ``listening on URL`` line."""
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches the bench; it stops these
            cwd=cwd,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    server = Server(name, process, "", log)
    try:
        with trio.move_on_after(patience):
            while process.returncode is None:
                found = _LISTENING.search(log.read_bytes())
                if found:
                    server.url = found.group(1).decode()
                    return server
                await trio.sleep(0.05)
        raise BackendUnavailable(f"{name} did not start ({' '.join(argv)}):\n{tail(log)}")
    except BaseException:  # not started, or the start was cancelled: do not leave it behind
        with trio.CancelScope(shield=True):
            await server.stop(grace=2.0)
        raise


async def admin_url(server: Server, patience: float = 10.0) -> str:
    """A router's admin listener (/metrics, /admin/*): the ``headrace admin on
    URL`` line it prints right after its listening line."""
    with trio.move_on_after(patience):
        while server.process.returncode is None:
            found = _ADMIN.search(server.log.read_bytes())
            if found:
                return found.group(1).decode()
            await trio.sleep(0.05)
    raise BackendUnavailable(f"{server.name} named no admin listener:\n{tail(server.log)}")


def cpu_info() -> dict[str, object]:
    """The CPU model, its core count and the features a reader compares by."""
    model, flags = "", list[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    notable = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
               "sha_ni", "aes", "neon", "asimd")
    return {"model": model or os.uname().machine, "cores": os.cpu_count(),
            "features": [f for f in notable if f in flags], "flags": flags}

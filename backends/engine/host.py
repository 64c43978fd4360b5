"""Run the model step on the process's main thread, and Trio beside it.

Measured on this project's CPU machines with torch 2.13: the same forward
pass is 1.6-2.5x slower from any thread but the main one (a 1x576 @ 576x1536
linear: 70 us on the main thread, 180 us on a worker, whatever
``torch.set_num_threads``, ``OMP_*`` or ``MKL_*`` say: the BLAS runs single
threaded off the main thread). ``trio.to_thread`` would put every step on a
worker; so ``headrace engine`` inverts the usual layout: Trio (HTTP, the
engine loop's bookkeeping) runs in a thread, and the main thread does nothing
but execute the steps Trio hands it::

    trio thread                         main thread
    -----------                         -----------
    EngineBackend._step
      await host.run_sync(engine.step) ──job──▶ queue.get()
      (waits, event loop keeps serving)          engine.step()  (torch, full speed)
      ◀──────────── token.run_sync_soon(done.set)
    deliver outputs

Signals arrive on the main thread too; :meth:`MainThreadHost.serve` turns
SIGTERM/SIGINT into a call that Trio runs (the graceful drain).
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

__all__ = ["MainThreadHost"]

T = TypeVar("T")


class MainThreadHost:
    """A one-thread executor whose thread is the caller of :meth:`serve`."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._done = threading.Event()

    async def run_sync(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the host thread; like ``trio.to_thread.run_sync``
        without abandoning: a cancelled caller still waits for a step that
        already started (the engine's state must stay consistent)."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            try:
                token.run_sync_soon(finished.set)
            except trio.RunFinishedError:
                pass

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await finished.wait()
        if "error" in box:
            raise box["error"]
        result: T = box["value"]
        return result

    def serve(self, trio_main: Callable[[], None], on_signal: Callable[[], None]) -> None:
        """Start ``trio_main()`` in a thread and execute jobs here until it
        returns. ``on_signal`` runs (in this thread) on SIGTERM/SIGINT; it
        should hand the shutdown to Trio with ``token.run_sync_soon``."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                trio_main()
            except BaseException as exc:
                errors.append(exc)
            finally:
                self._done.set()

        previous = {s: signal.signal(s, lambda *_: on_signal()) for s in (signal.SIGTERM, signal.SIGINT)}
        thread = threading.Thread(target=run, name="trio", daemon=True)
        thread.start()
        try:
            while not self._done.is_set():
                try:
                    job = self._jobs.get(timeout=0.1)  # wakes up for signals
                except queue.Empty:
                    continue
                job()
            thread.join()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if errors:
            raise errors[0]

"""How late this process's event loop runs its tasks.

A router whose loop is saturated (thousands of events a second on one
core) reads its backends' sockets late; a backend that sent on time then
looks silent, and a stall watchdog at 1 s declared healthy streams stalled
and migrated them (100 zero-window streams did it: issue 17). So a stall
verdict is stretched by the loop's own recent lateness:
:meth:`LoopLag.recent`, the largest oversleep of a ticker over the last
``window`` seconds. The router runs one as a supervised service, which is
:func:`current` while it runs; with none running, the lag is 0 and nothing
changes.
"""

from __future__ import annotations

from collections import deque

import trio

__all__ = ["LoopLag", "current", "install"]


class LoopLag:
    """A ticker that sleeps ``interval`` and records how much longer it took."""

    name = "loop-lag"

    def __init__(self, interval: float = 0.05, window: float = 5.0) -> None:
        self.interval, self.window = interval, window
        self._late: deque[tuple[float, float]] = deque(maxlen=max(1, int(window / interval)))

    def note(self, now: float, late: float) -> None:
        self._late.append((now, late))

    def recent(self, now: float | None = None) -> float:
        """The largest lateness seen in the last ``window`` seconds (0: none)."""
        if not self._late:
            return 0.0
        now = trio.current_time() if now is None else now
        return max((late for t, late in self._late if now - t <= self.window), default=0.0)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick until cancelled, as the process's :func:`current` monitor meanwhile."""
        install(self)
        task_status.started()
        try:
            while True:
                began = trio.current_time()
                await trio.sleep(self.interval)
                now = trio.current_time()
                self.note(now, max(0.0, now - began - self.interval))
        finally:
            if _current is self:
                install(None)

    def crashed(self, exc: BaseException) -> None:
        self._late.clear()


_current: LoopLag | None = None


def install(monitor: LoopLag | None) -> None:
    """Make ``monitor`` the one :func:`current` returns (the router's)."""
    global _current
    _current = monitor


def current() -> float:
    """The installed monitor's recent lag, in seconds (0 when none runs)."""
    return _current.recent() if _current is not None else 0.0

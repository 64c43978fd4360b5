"""A plain-text progress line on stderr, for every run that takes a while.

On a terminal the line redraws in place (``\\r``); in a log file (CI) it is
printed at most every ``log_every`` seconds so logs stay short.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

import trio

__all__ = ["ProgressBar", "bar", "run_progress"]


def bar(fraction: float, width: int = 24) -> str:
    """``[#########.......]`` for a fraction clamped to [0, 1]."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ProgressBar:
    def __init__(self, label: str, *, stream: TextIO | None = None, log_every: float = 5.0) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.log_every = log_every
        self._last_log = -float("inf")
        self._width = 0

    def update(self, fraction: float, text: str, now: float) -> None:
        line = f"{self.label} {bar(fraction)} {fraction * 100:3.0f}% {text}"
        if self.tty:
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        elif now - self._last_log >= self.log_every:
            self.stream.write(line + "\n")
            self._last_log = now
        self.stream.flush()

    def close(self, text: str) -> None:
        """Final state, always printed, ending the line."""
        line = f"{self.label} {bar(1.0)} 100% {text}"
        prefix = "\r" if self.tty else ""
        self.stream.write(prefix + line + " " * max(0, self._width - len(line)) + "\n")
        self.stream.flush()


async def run_progress(progress: ProgressBar, status: Callable[[float], tuple[float, str]],
                       interval: float = 0.25) -> None:
    """Redraw from ``status(now) -> (fraction, text)`` until cancelled."""
    while True:
        now = trio.current_time()
        fraction, text = status(now)
        progress.update(fraction, text, now)
        await trio.sleep(interval)

"""Incremental stop-string matching over streamed text.

Text arrives in pieces (one detokenized delta per step) and a stop string may
straddle pieces, so the matcher holds back the longest tail that could still be
the start of a stop string and releases it once it cannot. The stop string
itself is never emitted (OpenAI semantics). Of several stop strings, the one that
completes first ends the stream, so the result does not depend on how the text was
cut into pieces. Pure and synchronous::

    m = StopMatcher(["\\n\\n", "END"])
    m.feed("Hello EN")   -> ("Hello ", False)   # "EN" held back
    m.feed("D more")     -> ("", True)          # "END" matched; stream ends
    m.flush()            -> ""                  # (only when not stopped)
"""

from __future__ import annotations

from collections.abc import Iterable

from backends.errors import BadRequest

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        if any(not s for s in self.stops):
            raise BadRequest("stop strings must not be empty", param="stop")
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return (text safe to emit now, whether a stop matched).
        After a match, further input is ignored."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        cut, matched = _first_match(text, self.stops)
        if matched is not None:
            self.stopped, self.matched, self._held = True, matched, ""
            return text[:cut], True
        keep = _partial_tail(text, self.stops)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, at the end of the stream when no stop matched."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _first_match(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """The stop string that completes first in ``text`` (the smallest end; of those
    ending together, the longest): ``(where it starts, it)``, else ``(len + 1, None)``.
    First completion, not first start: generation stops as soon as a stop string is
    complete, so a longer stop that starts earlier but would complete later never gets
    the chance, however the text was cut into pieces."""
    best: tuple[int, int] | None = None
    which = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), i) < best):
            best, which = (i + len(s), i), s
    return (best[1], which) if best is not None else (len(text) + 1, None)


def _partial_tail(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best

"""A backend's concurrency limit, learned from its 429s: AIMD. Sans-I/O.

The router sends a backend at most ``limit`` streams at once (admission
counts the slots, the dispatcher passes over a backend at its limit while
another has room). The configured ``max_concurrency`` is the ceiling; a
backend that answers 429 says it has less room than that, so the limit moves
the way TCP's congestion window does::

    429, from a request sent after the last decrease   limit = max(minimum, limit x backoff)
    429, from one sent before it                        nothing: that burst was already answered
    an answer, while the backend ran at its limit       limit += 1 / limit  (about +1 per round trip)
    an answer, below its limit                          nothing: no evidence there is more room

Only one decrease per burst: the 429s of requests that were already in
flight when the limit was cut say nothing new (the ``sent_at`` rule), so a
burst of them does not collapse the limit to its minimum. Increase only when
limited (the backend had ``limit`` streams when one finished), so an idle
spell does not inflate it back past what was learned.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["AIMDLimit", "ConcurrencyStatistics"]


class ConcurrencyStatistics(msgspec.Struct, frozen=True, kw_only=True):
    limit: int  # streams at once now
    maximum: int  # the configured ceiling
    decreases: int  # times a 429 cut the limit
    increases: int  # times an answer at the limit raised it by a whole stream


class AIMDLimit:
    """Additive increase, multiplicative decrease, within ``[minimum, maximum]``."""

    def __init__(self, maximum: int, *, minimum: int = 1, backoff: float = 0.5) -> None:
        if maximum < 1 or not 1 <= minimum <= maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, not {minimum}, {maximum}")
        if not 0 < backoff <= 1:
            raise ValueError(f"backoff must be in (0, 1], not {backoff}")
        self.maximum, self.minimum, self.backoff = maximum, minimum, backoff
        self.value = float(maximum)
        self.cut_at = -math.inf  # when the limit was last decreased
        self.decreases = 0
        self.increases = 0

    @property
    def limit(self) -> int:
        return max(self.minimum, math.floor(self.value))

    def on_success(self, busy: int, now: float) -> None:
        """An answer from the backend, which had ``busy`` streams (this one
        included) when it finished."""
        if busy < self.limit or self.value >= self.maximum:
            return
        before = self.limit
        self.value = min(float(self.maximum), self.value + 1.0 / self.value)
        if self.limit > before:
            self.increases += 1

    def on_rate_limited(self, sent_at: float, now: float) -> bool:
        """A 429 to a request sent at ``sent_at``; True if it cut the limit."""
        if sent_at < self.cut_at:
            return False
        self.value = max(float(self.minimum), self.value * self.backoff)
        self.cut_at = now
        self.decreases += 1
        return True

    def statistics(self) -> ConcurrencyStatistics:
        return ConcurrencyStatistics(
            limit=self.limit, maximum=self.maximum, decreases=self.decreases, increases=self.increases
        )

"""Per-tenant and per-key rate limits: token buckets, sans-I/O.

A subject (``tenant:<name>``, ``key:<id>``) has up to three limits, each its
own bucket or counter::

    requests per minute   bucket of burst R, refilled R/60 per second; 1 per request
    tokens per minute     bucket of burst T, refilled T/60 per second;
                          prompt tokens on admission, generated tokens as they stream
    concurrent requests   a count, taken on admission, given back at the end

:meth:`TokenBuckets.acquire` checks every limit of every subject the request
falls under and takes from all of them, or from none (a key that has room
does not lose a request because its tenant has none). Streamed tokens are
charged with :meth:`TokenBuckets.charge` and may drive a token bucket into
debt: the next request waits until the debt is paid, so over a window ``W``
a subject is admitted at most ``T/60 * W + T`` tokens plus what its last
admitted request generated (the overshoot any charge-as-you-go limiter has,
bounded by one request).

The router passes ``now`` and the limits with each call, so a plugin never
reads config; buckets are made on first use and follow a change of limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

__all__ = ["Limits", "RateDecision", "RateLimitPolicy", "TokenBucket", "TokenBuckets"]

LimitName = Literal["requests", "tokens", "concurrent"]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One subject's limits; ``None`` is unlimited."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    concurrent: int | None = None


class RateDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`RateLimitPolicy.acquire` decided. ``retry_after`` (seconds)
    and ``limited`` (which limit, of which subject) are set on refusal; the
    ``remaining``/``reset`` pairs describe the tightest subject, for the
    ``x-ratelimit-*`` headers."""

    allowed: bool
    retry_after: float = 0.0
    limited: tuple[str, LimitName] | None = None
    limit_requests: float | None = None
    remaining_requests: float | None = None
    reset_requests: float | None = None  # seconds until the bucket is full again
    limit_tokens: float | None = None
    remaining_tokens: float | None = None
    reset_tokens: float | None = None


@runtime_checkable
class RateLimitPolicy(Protocol):
    """Admit a request of ``tokens`` prompt tokens under every subject's
    limits, or say how long to wait; then hear of its streamed tokens and its end."""

    def acquire(self, subjects: Sequence[tuple[str, Limits]], tokens: int, now: float) -> RateDecision: ...

    def charge(self, subjects: Sequence[str], tokens: int, now: float) -> None: ...

    def release(self, subjects: Sequence[str], now: float) -> None: ...


class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate`` per second from ``now``.
    The level may go below zero (debt from charges after admission)."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs a positive rate and burst, not {rate}, {burst}")
        self.rate, self.burst = rate, burst
        self.level, self.stamp = burst, now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.level

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0: now). More than the burst
        needs only a full bucket (it then runs into debt), or it could never pass."""
        need = min(amount, self.burst) - self.refill(now)
        return max(0.0, need / self.rate)

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount

    def reset_in(self, now: float) -> float:
        """Seconds until the bucket is full."""
        return (self.burst - self.refill(now)) / self.rate


class _Subject:
    __slots__ = ("concurrent", "limits", "requests", "tokens")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = TokenBucket(rpm / 60, rpm, now) if rpm else None
        self.tokens = TokenBucket(tpm / 60, tpm, now) if tpm else None
        self.concurrent = 0


class TokenBuckets:
    """In-memory token buckets per subject: requests and tokens per minute,
    and concurrent requests (the embedded default)."""

    def __init__(self, max_subjects: int = 100_000) -> None:
        self.max_subjects = max_subjects
        self._subjects: dict[str, _Subject] = {}

    def _subject(self, name: str, limits: Limits, now: float) -> _Subject:
        found = self._subjects.get(name)
        if found is None or found.limits != limits:
            fresh = _Subject(limits, now)
            if found is not None:
                fresh.concurrent = found.concurrent
            elif len(self._subjects) >= self.max_subjects:
                self._forget_idle(now)
            self._subjects[name] = found = fresh
        return found

    def _forget_idle(self, now: float) -> None:
        """Drop subjects whose buckets are full and that hold nothing: they
        would be made again identical."""
        for name, s in list(self._subjects.items()):
            full = all(b is None or b.reset_in(now) == 0 for b in (s.requests, s.tokens))
            if full and s.concurrent == 0:
                del self._subjects[name]

    def acquire(self, subjects: Sequence[tuple[str, Limits]], tokens: int, now: float) -> RateDecision:
        states = [(name, self._subject(name, limits, now)) for name, limits in subjects]
        worst: tuple[float, str, LimitName] | None = None
        for name, s in states:
            for what, wait in _waits(s, tokens, now):
                if wait > 0 and (worst is None or wait > worst[0]):
                    worst = (wait, name, what)
        if worst is not None:
            return _decision(states, now, allowed=False, retry_after=worst[0], limited=(worst[1], worst[2]))
        for _, s in states:
            if s.requests is not None:
                s.requests.take(1, now)
            if s.tokens is not None:
                s.tokens.take(tokens, now)
            s.concurrent += 1
        return _decision(states, now, allowed=True)

    def charge(self, subjects: Sequence[str], tokens: int, now: float) -> None:
        for name in subjects:
            s = self._subjects.get(name)
            if s is not None and s.tokens is not None:
                s.tokens.take(tokens, now)

    def release(self, subjects: Sequence[str], now: float) -> None:
        for name in subjects:
            s = self._subjects.get(name)
            if s is not None and s.concurrent > 0:
                s.concurrent -= 1


def _waits(s: _Subject, tokens: int, now: float) -> list[tuple[LimitName, float]]:
    waits: list[tuple[LimitName, float]] = []
    if s.requests is not None:
        waits.append(("requests", s.requests.wait(1, now)))
    if s.tokens is not None:
        waits.append(("tokens", s.tokens.wait(max(tokens, 1), now)))
    cap = s.limits.concurrent
    if cap is not None and s.concurrent >= cap:
        # No clock says when a slot frees; a second is what SMG suggests.
        waits.append(("concurrent", 1.0))
    return waits


def _decision(
    states: Sequence[tuple[str, _Subject]], now: float, *, allowed: bool, retry_after: float = 0.0,
    limited: tuple[str, LimitName] | None = None,
) -> RateDecision:
    """The decision, with header figures from the subject with the fewest
    remaining requests (and tokens) among those that limit them."""
    reqs = [s.requests for _, s in states if s.requests is not None]
    toks = [s.tokens for _, s in states if s.tokens is not None]
    r = min(reqs, key=lambda b: b.refill(now) / b.burst, default=None)
    t = min(toks, key=lambda b: b.refill(now) / b.burst, default=None)
    return RateDecision(
        allowed=allowed,
        retry_after=retry_after,
        limited=limited,
        limit_requests=r.burst if r else None,
        remaining_requests=max(0.0, math.floor(r.level)) if r else None,
        reset_requests=r.reset_in(now) if r else None,
        limit_tokens=t.burst if t else None,
        remaining_tokens=max(0.0, math.floor(t.level)) if t else None,
        reset_tokens=t.reset_in(now) if t else None,
    )

"""Percentiles and summaries for latency samples.

Latency distributions are long-tailed, so the report quotes p50/p95/p99 rather
than a mean. Percentiles use linear interpolation between order statistics
(numpy's default, Hyndman and Fan type 7), so a p99 of 50 samples is a real
interpolated value rather than "the largest sample" or "the 49th sample"
depending on rounding. No numpy needed: the samples are sorted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from backends.errors import BadRequest

__all__ = ["QUANTILES", "Summary", "percentile", "percentiles", "summarize"]

QUANTILES: tuple[float, ...] = (50.0, 95.0, 99.0)


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """A distribution in a few numbers; all ``None`` when there were no samples."""

    n: int
    mean: float | None
    min: float | None
    max: float | None
    p50: float | None
    p95: float | None
    p99: float | None


def _check_q(q: float) -> None:
    if not (0.0 <= q <= 100.0) or math.isnan(q):
        raise BadRequest(f"percentile must be within [0, 100], got {q!r}", param="q")


def _interpolate(ordered: Sequence[float], q: float) -> float:
    """Type-7 percentile of already sorted, non-empty samples."""
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    frac = rank - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def percentile(samples: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``samples``; ``None`` when empty."""
    _check_q(q)
    ordered = sorted(samples)
    return _interpolate(ordered, q) if ordered else None


def percentiles(samples: Iterable[float], qs: Sequence[float] = QUANTILES) -> list[float | None]:
    """Several percentiles of one sample set, sorting it once."""
    for q in qs:
        _check_q(q)
    ordered = sorted(samples)
    if not ordered:
        return [None for _ in qs]
    return [_interpolate(ordered, q) for q in qs]


def summarize(samples: Iterable[float], *, scale: float = 1.0) -> Summary:
    """Count, mean, extremes and p50/p95/p99, each multiplied by ``scale``
    (1000.0 turns seconds into milliseconds)."""
    ordered = sorted(s * scale for s in samples)
    if not ordered:
        return Summary(n=0, mean=None, min=None, max=None, p50=None, p95=None, p99=None)
    p50, p95, p99 = (_interpolate(ordered, q) for q in QUANTILES)
    return Summary(
        n=len(ordered),
        mean=math.fsum(ordered) / len(ordered),
        min=ordered[0],
        max=ordered[-1],
        p50=p50,
        p95=p95,
        p99=p99,
    )

"""The live latency breakdown per backend, for ``GET /admin/breakdown``
and ``headrace top``: the last requests' phases (router/logs.py), their
rate and errors, and quantiles computed when asked, not per request (a
request costs one append to its backend's ring)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

from frontend.metric_names import PHASES

__all__ = ["PHASES", "Breakdown"]

# A sample is one row of doubles: its time, 1.0 if it failed, then each phase
# (NaN where the request did not reach it). A ring's rows live in one array,
# not as a tuple, a dict and eight floats per request: those, kept for the
# last 2048 requests of each backend while every other allocation of those
# requests is freed, pinned allocator pages all over the heap (the router's
# idle RSS grew with the rings' fill long after the load had gone).
_STRIDE = 2 + len(PHASES)


class _Ring:
    __slots__ = ("data", "errors", "next", "requests", "size")

    def __init__(self, size: int) -> None:
        self.data = array("d")  # grows to size rows, then each new row overwrites the oldest
        self.size, self.next = size, 0
        self.requests = self.errors = 0

    def append(self, now: float, phases: Mapping[str, float], error: bool) -> None:
        row = [now, 1.0 if error else 0.0, *(phases.get(p, math.nan) for p in PHASES)]
        if len(self.data) < self.size * _STRIDE:
            self.data.extend(row)
        else:
            at = self.next * _STRIDE
            self.data[at : at + _STRIDE] = array("d", row)
        self.next = (self.next + 1) % self.size

    def since(self, start: float) -> Iterator[int]:
        """The offsets of the rows at or after ``start`` (in no order)."""
        data = self.data
        return (at for at in range(0, len(data), _STRIDE) if data[at] >= start)


class Breakdown:
    """Per backend ("none": refused before any backend), the last
    ``samples`` requests; rates and quantiles over those within ``window``
    seconds of now."""

    def __init__(self, *, samples: int = 2048, window: float = 60.0, rate_window: float = 10.0) -> None:
        self.size, self.window, self.rate_window = samples, window, rate_window
        self._rings: dict[str, _Ring] = {}

    def add(self, backend: str, now: float, phases: Mapping[str, float], error: bool) -> None:
        ring = self._rings.get(backend)
        if ring is None:
            ring = self._rings[backend] = _Ring(self.size)
        ring.append(now, phases, error)
        ring.requests += 1
        ring.errors += error

    def snapshot(self, now: float, in_flight: Mapping[str, int]) -> dict[str, Any]:
        """``{"window_s", "phases", "backends": [{backend, in_flight, rps,
        error_rate, requests, errors, phases: {phase: {p50, p99, n}} (ms)}]}``."""
        rows = []
        for name in sorted(set(self._rings) | set(in_flight)):
            ring = self._rings.get(name)
            data = ring.data if ring is not None else array("d")
            recent = list(ring.since(now - self.window)) if ring is not None else []
            lately = [at for at in recent if now - data[at] <= self.rate_window]
            phases: dict[str, dict[str, float | int]] = {}
            for i, phase in enumerate(PHASES, start=2):
                values = sorted(v for v in (data[at + i] for at in recent) if v == v)  # NaN: not reached
                if values:
                    phases[phase] = {"p50": _ms(values, 0.5), "p99": _ms(values, 0.99), "n": len(values)}
            rows.append({
                "backend": name,
                "in_flight": in_flight.get(name, 0),
                "rps": round(len(lately) / self.rate_window, 3),
                "error_rate": round(sum(data[at + 1] for at in lately) / len(lately), 4) if lately else 0.0,
                "requests": ring.requests if ring is not None else 0,
                "errors": ring.errors if ring is not None else 0,
                "phases": phases,
            })  # fmt: skip
        return {"object": "breakdown", "window_s": self.window, "phases": list(PHASES), "backends": rows}


def _ms(ordered: list[float], q: float) -> float:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

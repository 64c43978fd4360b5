"""The live latency breakdown per backend, for ``GET /admin/breakdown``
and ``headrace top``: the last requests' phases (router/logs.py), their
rate and errors, and quantiles computed when asked, not per request (a
request costs one append to its backend's ring)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from frontend.metric_names import PHASES

__all__ = ["PHASES", "Breakdown"]


class _Ring:
    __slots__ = ("errors", "requests", "samples")

    def __init__(self, size: int) -> None:
        self.samples: deque[tuple[float, Mapping[str, float], bool]] = deque(maxlen=size)
        self.requests = self.errors = 0


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
        ring.samples.append((now, phases, error))
        ring.requests += 1
        ring.errors += error

    def snapshot(self, now: float, in_flight: Mapping[str, int]) -> dict[str, Any]:
        """``{"window_s", "phases", "backends": [{backend, in_flight, rps,
        error_rate, requests, errors, phases: {phase: {p50, p99, n}} (ms)}]}``."""
        rows = []
        for name in sorted(set(self._rings) | set(in_flight)):
            ring = self._rings.get(name)
            recent = [s for s in ring.samples if now - s[0] <= self.window] if ring is not None else []
            lately = [s for s in recent if now - s[0] <= self.rate_window]
            phases: dict[str, dict[str, float | int]] = {}
            for phase in PHASES:
                values = sorted(p[phase] for _, p, _ in recent if phase in p)
                if values:
                    phases[phase] = {"p50": _ms(values, 0.5), "p99": _ms(values, 0.99), "n": len(values)}
            rows.append({
                "backend": name,
                "in_flight": in_flight.get(name, 0),
                "rps": round(len(lately) / self.rate_window, 3),
                "error_rate": round(sum(e for _, _, e in lately) / len(lately), 4) if lately else 0.0,
                "requests": ring.requests if ring is not None else 0,
                "errors": ring.errors if ring is not None else 0,
                "phases": phases,
            })  # fmt: skip
        return {"object": "breakdown", "window_s": self.window, "phases": list(PHASES), "backends": rows}


def _ms(ordered: list[float], q: float) -> float:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

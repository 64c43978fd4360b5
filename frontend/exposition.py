"""Prometheus text exposition without stalling the event loop.

``prometheus_client.generate_latest`` formats every sample in Python, about
11 us each: a router's /metrics with some 1,500 samples (histograms per
tenant, route, backend and phase) held the loop for 17 ms idle and up to 55
ms on a loaded box, during which no request of any client made progress
(the refusal p99 in ``headrace bench overload`` followed its scrapes). A
worker thread does not help: it holds the GIL, and the loop waited up to
180 ms for it. So :func:`render_cooperatively` formats with the library's
own code, a family at a time and a large family :data:`SLICE` samples at a
time, yielding to the loop between (the same text as ``generate_latest``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import trio
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["SLICE", "render_cooperatively"]

SLICE = 200  # samples formatted between two checkpoints (~2 ms)


class _Collected(Collector):
    """Families already collected, as a registry ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


async def render_cooperatively(registry: Collector, *, slice_size: int = SLICE) -> bytes:
    """``generate_latest(registry)``, yielding to the loop every ``slice_size`` samples."""
    out: list[bytes] = []
    for family in registry.collect():
        seen: set[bytes] = set()  # the HELP and TYPE lines already out, once per family
        for samples in _slices(family, slice_size):
            part = Metric(family.name, family.documentation, family.type, family.unit)
            part.samples = samples
            for line in generate_latest(_Collected([part])).splitlines(keepends=True):
                if line.startswith(b"# "):
                    if line in seen:
                        continue
                    seen.add(line)
                out.append(line)
            await trio.lowlevel.checkpoint()
    return b"".join(out)


def _slices(family: Metric, size: int) -> Iterator[list[Any]]:
    """The family's samples in generate_latest's order (its own, then each
    OpenMetrics-only suffix's, which it puts in a gauge of their own after
    them, sorted by suffix), at most ``size`` at a time."""
    own: list[Any] = []
    extra: dict[str, list[Any]] = {}
    for sample in family.samples:
        suffix = next((x for x in _OM_SUFFIXES if sample.name == family.name + x), None)
        (own if suffix is None else extra.setdefault(suffix, [])).append(sample)
    groups = [own, *(extra[k] for k in sorted(extra))]
    yield own[:size]  # the first slice: the family's header even without samples
    for i, group in enumerate(groups):
        for start in range(size if i == 0 else 0, len(group), size):
            yield group[start : start + size]


_OM_SUFFIXES = ("_created", "_gsum", "_gcount")  # as generate_latest checks them

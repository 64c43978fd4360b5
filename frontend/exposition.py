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

Collecting is sliced too. A labelled metric's ``collect()`` builds every
child's samples in one go: the router's request-phase histogram (572
samples under ``headrace bench overload``) took 5 ms on average, 24 ms at
worst, in one step, every scrape; the bench scrapes twice a second, and
refusals waited behind it. So a labelled metric of prometheus_client's own
(``MetricWrapperBase``) is collected here a few children at a time, as its
``collect`` and ``_multi_samples`` do (prometheus_client 0.2x: the
internals used are checked by tests/frontend/test_exposition.py); a child
is never split, so each series' buckets, sum and count are read together.
Other collectors are collected whole, as before.

Observing is batched where it is per token: :func:`observe_many` adds a
list of values to a histogram child with one lock round per bucket touched
and one for the sum, where ``observe`` takes two per value (the
inter-token histograms took about 4% of the router's CPU per streamed
request, observed per event).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["SLICE", "observe_many", "observe_one", "render_cooperatively"]

SLICE = 50  # samples formatted (or collected) between two checkpoints (~0.5 ms)


def observe_one(histogram: Histogram, value: float) -> None:
    """``histogram.observe(value)`` (``histogram`` a child, or a histogram
    without labels), its bucket found by bisection: ``observe`` walks the
    bounds in Python, and the router observes about a dozen values a
    request. The same bucket, sum and count (the internals used,
    prometheus_client 0.2x, are checked by tests/frontend/test_exposition.py)."""
    histogram._sum.inc(value)
    if value == value:  # a NaN falls in no bucket, as with observe
        histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(1)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """``for v in values: histogram.observe(v)``, in one update per bucket
    touched. ``histogram`` is a child (or a histogram without labels). The
    same buckets, sum and count as observing one at a time (the internals
    used, prometheus_client 0.2x, are checked by
    tests/frontend/test_exposition.py)."""
    if not values:
        return
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]
    total = sum(values)
    histogram._sum.inc(total)
    bounds, buckets = histogram._upper_bounds, histogram._buckets
    if total == total and max(values) <= bounds[0]:
        # No NaN (it would make the sum NaN) and all in the first bucket: a
        # read's inter-token gaps (0) usually are.
        buckets[0].inc(len(values))
        return
    # a NaN falls in no bucket, as with observe
    for i, n in Counter(bisect_left(bounds, v) for v in values if v == v).items():
        buckets[i].inc(n)


class _Collected(Collector):
    """Families already collected, as a registry ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


async def render_cooperatively(registry: Collector, *, slice_size: int = SLICE) -> bytes:
    """``generate_latest(registry)``, yielding to the loop every ``slice_size`` samples."""
    out: list[bytes] = []
    async for family in _families(registry, slice_size):
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


async def _families(registry: Collector, size: int) -> AsyncIterator[Metric]:
    """``registry.collect()``'s families, in its order, a labelled metric's
    collected about ``size`` samples at a time between checkpoints."""
    collectors = _collectors(registry)
    if collectors is None:
        for family in registry.collect():
            yield family
        return
    for collector in collectors:
        if isinstance(collector, MetricWrapperBase) and collector._is_parent():  # type: ignore[no-untyped-call]
            yield await _collect_children(collector, size)
        else:
            for family in collector.collect():
                yield family


def _collectors(registry: Collector) -> list[Collector] | None:
    """A plain ``CollectorRegistry``'s collectors, as its ``collect`` copies
    them (None: anything else, collected through its own ``collect``)."""
    if type(registry) is not CollectorRegistry or registry._target_info:
        return None
    with registry._lock:
        return list(registry._collector_to_names)


async def _collect_children(wrapper: Any, size: int) -> Metric:
    """``wrapper.collect()``'s one family (``_multi_samples`` over its
    children), with a checkpoint after each ``size`` samples' worth of children."""
    metric: Metric = wrapper._get_metric()
    with wrapper._lock:
        children = wrapper._metrics.copy()
    since = 0
    for values, child in children.items():
        series = list(zip(wrapper._labelnames, values, strict=True))
        for suffix, labels, value, timestamp, exemplar, native in child._samples():
            metric.add_sample(wrapper._name + suffix, dict(series + list(labels.items())), value, timestamp, exemplar, native)
            since += 1
        if since >= size:
            since = 0
            await trio.lowlevel.checkpoint()
    return metric


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

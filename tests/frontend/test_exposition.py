"""/metrics text is formatted a slice at a time, yielding to the event loop
between slices, and is the same text as ``generate_latest``."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from frontend import exposition


def _registry(children: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    c = Counter("t_requests", "requests", ["tenant"], registry=registry)
    g = Gauge("t_depth", "depth", registry=registry)
    h = Histogram("t_latency_seconds", "latency", ["tenant"], registry=registry, buckets=(0.01, 0.1, 1.0))
    Counter("t_never", "never incremented", ["x"], registry=registry)  # a family with no samples
    g.set(3)
    for i in range(children):
        c.labels(f"t{i}").inc(i)
        h.labels(f"t{i}").observe(i / 100)
    return registry


@settings(max_examples=25, deadline=None)
@given(children=st.integers(0, 60), slice_size=st.integers(1, 50))
def test_the_text_is_generate_latests_whatever_the_slices(children: int, slice_size: int) -> None:
    registry = _registry(children)
    text = trio.run(lambda: exposition.render_cooperatively(registry, slice_size=slice_size))
    assert text == generate_latest(registry)
    assert text.count(b"# TYPE t_latency_seconds histogram") == 1


@pytest.mark.parametrize("slice_size", [7, 200])
async def test_the_loop_runs_between_slices(slice_size: int) -> None:
    """Another task runs once per slice (a synchronous generate_latest would
    let it run only after all of them)."""
    registry = _registry(100)  # the histogram alone: 100 children x 6 samples
    samples = sum(len(f.samples) for f in registry.collect())
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        await trio.lowlevel.checkpoint()
        before = ticks
        await exposition.render_cooperatively(registry, slice_size=slice_size)
        assert ticks - before >= samples // slice_size
        nursery.cancel_scope.cancel()

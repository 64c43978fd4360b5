"""/metrics text is formatted a slice at a time, yielding to the event loop
between slices, and is the same text as ``generate_latest``."""

from __future__ import annotations

import math

import pytest
import trio
from hypothesis import example, given, settings
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


async def test_a_labelled_metric_is_collected_a_slice_of_children_at_a_time() -> None:
    """Collecting a labelled metric reads every child; here each child's
    value is a function that counts its reads, and another task notes how
    many were read between two of its turns: about a slice's worth (the
    library's own collect() read all 1,000 in one step)."""
    registry = CollectorRegistry()
    gauge = Gauge("t_children", "children", ["i"], registry=registry)
    reads = 0

    def value() -> float:
        nonlocal reads
        reads += 1
        return 1.0

    for i in range(1000):
        gauge.labels(str(i)).set_function(value)
    most = 0

    async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal most
        last = reads
        task_status.started()
        while True:
            await trio.lowlevel.checkpoint()
            most, last = max(most, reads - last), reads

    async with trio.open_nursery() as nursery:
        await nursery.start(watch)
        text = await exposition.render_cooperatively(registry, slice_size=50)
        await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert reads == 1000
    assert 0 < most <= 2 * 50  # trio may run the two tasks in either order in a batch: two slices between turns
    assert text == generate_latest(registry)  # (which reads them all again)


def test_the_prometheus_client_internals_the_sliced_collection_uses_are_unchanged() -> None:
    """If this fails, prometheus_client changed how a labelled metric is
    collected: re-read MetricWrapperBase.collect and _multi_samples, and
    frontend/exposition.py's _collect_children, which does what they do."""
    import inspect

    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.registry import CollectorRegistry as Registry

    collect = inspect.getsource(MetricWrapperBase.collect)
    assert "metric = self._get_metric()" in collect
    assert "metric.add_sample(self._name + suffix, labels, value, timestamp, exemplar, native_histogram_value)" in collect
    multi = inspect.getsource(MetricWrapperBase._multi_samples)
    for line in ("with self._lock:", "metrics = self._metrics.copy()", "series_labels = list(zip(self._labelnames, labels))",
                 "in metric._samples():", "dict(series_labels + list(sample_labels.items()))"):  # fmt: skip
        assert line in multi, line
    assert "return self._labelnames and not self._labelvalues" in inspect.getsource(MetricWrapperBase._is_parent)
    registry_collect = inspect.getsource(Registry.collect)
    for line in ("collectors = copy.copy(self._collector_to_names)", "if self._target_info:", "yield from collector.collect()"):
        assert line in registry_collect, line


@settings(max_examples=60, deadline=None)
@example(values=[0.0] * 19)  # a read's gaps: all in the first bucket at once
@example(values=[0.0, 0.01, -1.0, -math.inf])
@example(values=[0.0, math.nan, 0.0])  # NaN in no bucket
@example(values=[0.0, math.inf, -math.inf])  # a NaN sum with no NaN in it
@given(values=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.01, 0.1, 1.0])), max_size=40))
def test_observe_many_and_observe_one_give_the_samples_of_prometheus_observe(values: list[float]) -> None:
    """Bucket edges included (a value equal to a bound is in that bound's
    bucket), infinities and NaN too; the sum is compared as text, NaN and all."""
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("t_gap_seconds", "gap", ["backend"], registry=one, buckets=(0.01, 0.1, 1.0))
    hm = Histogram("t_gap_seconds", "gap", ["backend"], registry=many, buckets=(0.01, 0.1, 1.0))
    h1b = Histogram("t_one_seconds", "one", ["backend"], registry=one, buckets=(0.01, 0.1, 1.0))
    hmb = Histogram("t_one_seconds", "one", ["backend"], registry=many, buckets=(0.01, 0.1, 1.0))
    child = h1.labels("b")
    for v in values:
        child.observe(v)
        h1b.labels("b").observe(v)
        exposition.observe_one(hmb.labels("b"), v)  # and observe_one, value by value
    exposition.observe_many(hm.labels("b"), values)
    exposition.observe_many(hm.labels("b"), [])

    def text(r: CollectorRegistry) -> list[bytes]:
        return [line for line in generate_latest(r).splitlines() if not line.startswith((b"t_gap_seconds_created", b"t_one_seconds_created"))]

    assert text(many) == text(one)


def test_the_prometheus_client_internals_observe_many_uses_are_unchanged() -> None:
    """If this fails, re-read Histogram.observe and _metric_init, and
    frontend/exposition.py's observe_many and observe_one, which do what observe does."""
    import inspect

    observe = inspect.getsource(Histogram.observe)
    for line in ("self._raise_if_not_observable()", "self._sum.inc(amount)",
                 "for i, bound in enumerate(self._upper_bounds):", "if amount <= bound:", "self._buckets[i].inc(1)"):  # fmt: skip
        assert line in observe, line

"""The router's Prometheus metrics, built from :mod:`frontend.metric_names`
(the one table of names, types, help, labels and buckets, shared with the engine).

Per-request observations (status, latency, time to first token, inter-token
latency, queue time) go into histograms as they happen; state (in-flight per
backend, up/down, counters) is read from each component's ``statistics()``
at scrape time by :class:`StatisticsCollector`, so components never import
prometheus. Each router owns its own :class:`~prometheus_client.CollectorRegistry`
(no global registry), so tests can build several routers in one process.

Several worker processes (``headrace serve --workers N``): prometheus-client's
multiprocess mode. The supervisor creates a temporary directory and starts
every worker with ``PROMETHEUS_MULTIPROC_DIR`` set to it, so each metric value
lives in a per-process file there, and whichever worker a scrape lands on
reports the aggregate of all of them::

    worker 0: Counter.inc / Histogram.observe ──> counter_<pid0>.db ─┐
              statistics() ──mirror, every 1 s and on scrape──> ...  ├─> /metrics on any worker:
    worker 1: ...                              ──> counter_<pid1>.db ─┘   MultiProcessCollector sums

Per-request metrics (``headrace_requests``, the histograms) are written as
they happen. The live state read by :class:`StatisticsCollector` exists only
inside its own worker, so each worker *mirrors* it into multiprocess metrics
(:class:`Mirror`): counters by their increase since the last mirror, summed
across workers (a dead worker's count is kept); ``headrace_backend_in_flight``
summed over live workers; the other gauges (``up``, ``draining``: each worker
probes and drains on its own) one series per live worker, labelled ``pid``.
Mirrored values from other workers are at most :data:`MIRROR_INTERVAL` old.
The supervisor calls ``mark_process_dead`` for a worker that exits.
``headrace_worker_requests`` counts requests per worker index (stable across
restarts), which shows how the kernel spreads connections.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from frontend import metric_names as N
from frontend.call import Call
from frontend.context import HeldStage, RequestContext
from frontend.exposition import observe_many, observe_one, render_cooperatively
from frontend.metric_names import REQUEST_BUCKETS, TOKEN_BUCKETS  # noqa: F401  (re-exported: older imports)
from frontend.sli import ROUTE_OF_KIND, CallTimer
from policies.capacity import ReplicaEstimator
from router.actors import ActorStatistics, BackendActor
from router.admission import QueueStatistics
from router.config import CapacityConfig
from router.dispatch import DispatchStatistics
from router.migration import STANDBY_OUTCOMES
from router.pipeline import PipelineStatistics

__all__ = ["CONTENT_TYPE", "MIRROR_INTERVAL", "Arrivals", "CapacityCollector", "LabelBounds", "Mirror", "RouterMetrics", "StatisticsCollector", "TaskCollector", "count_tasks", "fleet_of", "replica_estimator"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

MIRROR_INTERVAL = 1.0  # seconds between two mirrors of a worker's live state (multiprocess mode)
# How a mirrored gauge aggregates across workers; any other gauge: "liveall" (one series per worker).
GAUGE_MODES = {
    f.name: "livesum"
    for f in (N.BACKEND_IN_FLIGHT, N.PIPELINE_IN_FLIGHT, N.QUEUE_DEPTH, N.QUEUE_BUSY, N.QUEUE_GROUP_BUSY, N.QUEUE_GROUP_DEPTH, N.RETRY_ACTIVE,
              N.ARRIVAL_RATE)
}
# headrace_backend_breaker_state's values, worst last.
BREAKER_STATES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class StatisticsCollector(Collector):
    """Maps actor, dispatcher, pipeline and queue statistics to metrics on each scrape."""

    def __init__(
        self,
        actors: Callable[[], Sequence[ActorStatistics]],
        dispatch: Callable[[], DispatchStatistics],
        *,
        pipeline: Callable[[], PipelineStatistics] | None = None,
        queue: Callable[[], QueueStatistics] | None = None,
    ) -> None:
        self._actors = actors
        self._dispatch = dispatch
        self._pipeline = pipeline
        self._queue = queue

    def collect(self) -> Iterable[Metric]:
        stats = self._actors()
        limit, cuts = N.BACKEND_LIMIT.collected(), N.BACKEND_CUTS.collected()
        for s in stats:
            limit.add_metric([s.name], s.limit)
            cuts.add_metric([s.name], s.concurrency.decreases if s.concurrency is not None else 0)
        yield from (limit, cuts)
        in_flight, up, draining = N.BACKEND_IN_FLIGHT.collected(), N.BACKEND_UP.collected(), N.BACKEND_DRAINING.collected()
        counters = {field: family.collected() for field, family in N.BACKEND_COUNTERS.items()}
        for s in stats:
            in_flight.add_metric([s.name], s.in_flight)
            up.add_metric([s.name], 1.0 if s.up else 0.0)
            draining.add_metric([s.name], 1.0 if s.draining else 0.0)
            for field, metric in counters.items():
                metric.add_metric([s.name], getattr(s, field))
        yield from (in_flight, up, draining)
        yield from counters.values()
        d = self._dispatch()
        for field in ("retries", "unavailable", "fallbacks", "rate_limited"):
            yield N.DISPATCH_COUNTERS[field].collected(getattr(d, field))
        cooling = N.BACKEND_COOLING.collected()
        for s in stats:
            cooling.add_metric([s.name], 1.0 if s.name in d.cooling else 0.0)
        yield cooling
        weight, requests, failed = N.VERSION_WEIGHT.collected(), N.VERSION_REQUESTS.collected(), N.VERSION_FAILED.collected()
        for v in d.versions:
            weight.add_metric([v.route, v.version], v.weight)
            requests.add_metric([v.route, v.version], v.requests)
            failed.add_metric([v.route, v.version], v.failed)
        yield from (weight, requests, failed)
        yield from _breakers(d)
        yield from _migrations(d)
        if self._pipeline is not None:
            yield from _pipeline(self._pipeline())
        if self._queue is not None:
            yield from _queue(self._queue())


def count_tasks() -> int:
    """The Trio tasks alive in this run, from the root task down through every
    nursery (trio itself keeps no count); raises RuntimeError outside ``trio.run``."""
    count, stack = 0, [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        if task is None:
            continue
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


class TaskCollector(Collector):
    """``headrace_router_tasks`` at each scrape (and each mirror): a walk of the
    task tree, about 0.4 ms per thousand tasks. Nothing outside Trio."""

    def collect(self) -> Iterable[Metric]:
        try:
            tasks = count_tasks()
        except RuntimeError:  # a render from outside trio.run: no tasks to count
            return
        yield N.ROUTER_TASKS.collected(tasks)


def _migrations(d: DispatchStatistics) -> Iterable[Metric]:
    m = d.migration
    family = N.MIGRATIONS.collected()
    for key, count in sorted(m.migrations.items()):
        reason, _, outcome = key.partition(":")
        family.add_metric([reason, outcome], count)
    yield family
    yield N.MIGRATION_DIVERGENCES.collected(m.divergences)
    yield N.MIGRATION_INEXACT.collected(m.inexact)
    syncs = N.MIGRATION_STANDBY.collected()
    for outcome in STANDBY_OUTCOMES:
        syncs.add_metric([outcome], m.standby_syncs.get(outcome, 0))
    yield syncs
    yield N.MIGRATION_STANDBY_TOKENS.collected(m.standby_tokens)


def _breakers(d: DispatchStatistics) -> Iterable[Metric]:
    yield N.DISPATCH_COUNTERS["retries_refused"].collected(d.retries_refused)
    retries, broken = N.BACKEND_RETRIES.collected(), N.BACKEND_MIGRATIONS.collected()
    for name, count in sorted(d.retries_from.items()):
        retries.add_metric([name], count)
    for name, count in sorted(d.broken_on.items()):
        broken.add_metric([name], count)
    yield from (retries, broken)
    state, ejections, refused = N.BREAKER_STATE.collected(), N.EJECTIONS.collected(), N.REFUSED_EJECTIONS.collected()
    for b in d.breakers:
        state.add_metric([b.name], BREAKER_STATES.get(b.state, 2.0))
        ejections.add_metric([b.name], b.ejections)
        refused.add_metric([b.name], b.refused_trips)
    yield from (state, ejections, refused)
    if d.retry_budget is not None:
        r = d.retry_budget
        yield N.RETRY_ACTIVE.collected(r.active)
        yield N.RETRY_GRANTED.collected(r.granted)
        yield N.RETRY_REFUSED.collected(r.refused)


def _pipeline(p: PipelineStatistics) -> Iterable[Metric]:
    yield N.PIPELINE_ADMITTED.collected(p.admitted)
    yield N.PIPELINE_IN_FLIGHT.collected(p.in_flight)
    rejected = N.PIPELINE_REJECTED.collected()
    for code, count in sorted(p.rejected.items()):
        rejected.add_metric([code], count)
    yield rejected
    latency = N.PIPELINE_REJECTION_SECONDS.collected()
    for q, value in (("0.5", p.rejection_p50), ("0.99", p.rejection_p99)):
        if value is not None:
            latency.add_metric([q], value)
    yield latency


def _queue(q: QueueStatistics) -> Iterable[Metric]:
    depth = N.QUEUE_DEPTH.collected()
    for cls, count in q.queued.items():
        depth.add_metric([cls], count)
    yield depth
    yield N.QUEUE_CAPACITY.collected(q.capacity)
    yield N.QUEUE_BUSY.collected(q.busy)
    group_capacity, group_busy, group_queued = (
        N.QUEUE_GROUP_CAPACITY.collected(), N.QUEUE_GROUP_BUSY.collected(), N.QUEUE_GROUP_DEPTH.collected()
    )
    for g in q.groups:
        name = ",".join(g.backends) or "*"  # *: every backend
        group_capacity.add_metric([name], g.capacity)
        group_busy.add_metric([name], g.busy)
        group_queued.add_metric([name], g.queued)
    yield from (group_capacity, group_busy, group_queued)
    admitted = N.QUEUE_ADMITTED.collected()
    admitted.add_metric(["at_once"], q.admitted_at_once)
    admitted.add_metric(["after_wait"], q.admitted_after_wait)
    yield admitted
    if q.service_rate is not None:
        yield N.QUEUE_SERVICE_RATE.collected(q.service_rate)


class Mirror:
    """Copies what collectors report into multiprocess-mode metrics of the
    same names: counters by increase (a count that went down restarted from
    zero), gauges by value, in the mode :data:`GAUGE_MODES` names."""

    def __init__(self) -> None:
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def copy(self, families: Iterable[Metric]) -> None:
        for family in families:
            if family.type not in ("counter", "gauge"):
                continue
            for sample in family.samples:
                if family.type == "counter" and not sample.name.endswith("_total"):
                    continue  # _created
                names = tuple(sample.labels)
                values = tuple(sample.labels.values())
                if family.type == "counter":
                    last = self._last.get((sample.name, values), 0.0)
                    self._last[sample.name, values] = sample.value
                    increase = sample.value - last if sample.value >= last else sample.value
                    if increase:
                        counter = self._counter(family, names)
                        (counter.labels(*values) if names else counter).inc(increase)
                else:
                    gauge = self._gauge(family, names)
                    (gauge.labels(*values) if names else gauge).set(sample.value)

    def _counter(self, family: Metric, names: tuple[str, ...]) -> Counter:
        if family.name not in self._counters:
            self._counters[family.name] = Counter(family.name, family.documentation, names, registry=None)
        return self._counters[family.name]

    def _gauge(self, family: Metric, names: tuple[str, ...]) -> Gauge:
        if family.name not in self._gauges:
            mode = GAUGE_MODES.get(family.name, "liveall")
            self._gauges[family.name] = Gauge(
                family.name, family.documentation, names, registry=None, multiprocess_mode=mode  # type: ignore[arg-type]
            )
        return self._gauges[family.name]


class LabelBounds:
    """Bounded ``tenant`` and ``model`` label values: a configured tenant (or
    an API key's, or the built-in ``default`` / ``anonymous``) and a
    configured or served model keep their names; any other is ``other``, so
    a client cannot grow the series count by sending made-up names."""

    def __init__(self, tenants: Iterable[str], models: Callable[[], Iterable[str]]) -> None:
        self.tenants = frozenset(tenants) | {"default", "anonymous"}
        self._models = models
        self._known: frozenset[str] = frozenset()

    def tenant(self, name: str) -> str:
        return name if name in self.tenants else N.OTHER

    def models(self) -> set[str]:
        """The configured and served models (each a ``model`` label value)."""
        self._known = frozenset(self._models())
        return set(self._known)

    def model(self, name: str) -> str:
        if name not in self._known:
            self._known = frozenset(self._models())  # a backend may have come up with new models
        return name if name in self._known else N.OTHER

    def of_call(self, context: RequestContext, call: Call) -> tuple[str, str, str, str]:
        """(route, model, tenant, priority) of a call: the SLI histograms' labels."""
        return (ROUTE_OF_KIND.get(call.kind, N.OTHER), self.model(call.model), self.tenant(context.tenant), context.priority)


class Arrivals(HeldStage):
    """A pipeline stage that counts each call's arrival for its model."""

    def __init__(self, estimator: ReplicaEstimator, bounds: LabelBounds) -> None:
        self.estimator, self.bounds = estimator, bounds

    async def _admit(self, context: RequestContext, call: Call) -> None:
        model = self.bounds.model(call.model)
        if model != N.OTHER:
            self.estimator.arrive(model, context.arrival)


class CapacityCollector(Collector):
    """``headrace_desired_replicas{model}`` and its inputs, estimated on each
    scrape (``now`` is trio's clock, like the arrivals'). ``fleet(model)``:
    the backends serving it that take requests now, and their mean slots."""

    def __init__(self, estimator: ReplicaEstimator, bounds: LabelBounds, fleet: Callable[[str], tuple[int, int]]) -> None:
        self.estimator, self.bounds, self.fleet = estimator, bounds, fleet

    def collect(self) -> Iterable[Metric]:
        now = trio.current_time()
        desired, arrivals, service, replicas = (
            N.DESIRED_REPLICAS.collected(), N.ARRIVAL_RATE.collected(), N.REPLICA_SERVICE_RATE.collected(), N.MODEL_REPLICAS.collected()
        )
        for model in sorted(self.bounds.models() | set(self.estimator.models())):
            n, slots = self.fleet(model)
            e = self.estimator.estimate(model, now, replicas=n, slots=slots)
            desired.add_metric([model], e.desired)
            arrivals.add_metric([model], e.arrival_rate)
            replicas.add_metric([model], n)
            if e.service_rate is not None:  # unmeasured: no sample rather than a zero
                service.add_metric([model], e.service_rate)
        yield from (desired, arrivals, service, replicas)


def replica_estimator(c: CapacityConfig) -> ReplicaEstimator:
    """``[capacity]``'s estimator (targets in seconds)."""
    return ReplicaEstimator(c.p99_ms / 1000, targets={m: ms / 1000 for m, ms in c.models.items()}, window=c.window,
                            min_replicas=c.min_replicas, max_replicas=c.max_replicas, max_utilisation=c.max_utilisation,
                            share=c.traffic_share, fixed=c.service == "fixed")  # fmt: skip


def fleet_of(actors: Sequence[BackendActor], group_of: Callable[[str], tuple[str, ...]]) -> Callable[[str], tuple[int, int]]:
    """``fleet(model)`` over the router's actors: how many of the model's group
    take requests now, and their mean concurrency limit (at least 1)."""

    def fleet(model: str) -> tuple[int, int]:
        group = set(group_of(model))
        up = [a for a in actors if (not group or a.name in group) and a.eligible(None)]
        return len(up), max(1, round(sum(a.limit for a in up) / len(up))) if up else 1

    return fleet


def _child(cache: dict[str, Histogram], family: Histogram, label: str) -> Histogram:
    child = cache.get(label)
    if child is None:
        child = cache[label] = family.labels(label)
    return child


def _child2(cache: dict[tuple[str, str], Histogram], family: Histogram, a: str, b: str) -> Histogram:
    """:func:`_child` for a family with two labels."""
    child = cache.get((a, b))
    if child is None:
        child = cache[a, b] = family.labels(a, b)
    return child


class RouterMetrics:
    """The router's registry; also the dispatcher's :class:`~router.dispatch.Recorder`
    and the frontend's ``observe`` hook.

    In multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before
    prometheus_client was imported, as the worker supervisor does), ``render``
    reports all workers and ``run_mirror`` must run beside the router."""

    def __init__(self) -> None:
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self._collectors: list[Collector] = []
        self._mirror = Mirror()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = cast(Counter, N.REQUESTS.instrument(r))
        self.latency = cast(Histogram, N.REQUEST_DURATION.instrument(r))
        self.ttft = cast(Histogram, N.TTFT.instrument(r))
        self.itl = cast(Histogram, N.ITL.instrument(r))
        self.resume = cast(Histogram, N.RESUME_GAP.instrument(r))
        self.queue = cast(Histogram, N.QUEUE_TIME.instrument(r))
        self.worker_requests = cast(Counter, N.WORKER_REQUESTS.instrument(r))
        self._this_worker = self.worker_requests.labels("0")
        self.bounds: LabelBounds | None = None  # set by call_timer
        self.estimator: ReplicaEstimator | None = None  # set by capacity
        self._requests: dict[tuple[str, int, str], Counter] = {}
        self._latency: dict[str, Histogram] = {}
        self._queue: dict[str, Histogram] = {}
        self._ttft: dict[str, Histogram] = {}
        self._itl: dict[str, Histogram] = {}
        self._resume: dict[tuple[str, str], Histogram] = {}
        self._init_phases()
        self.add_collector(TaskCollector())

    def call_timer(self, bounds: LabelBounds) -> CallTimer:
        """The pipeline's last stage: per-call SLIs by route, model, tenant and priority."""
        self.bounds = bounds
        r = self.registry
        h = {f.name: cast(Histogram, f.instrument(r)) for f in (N.REQUEST_TTFT, N.REQUEST_ITL, N.E2E_LATENCY, N.REQUEST_QUEUE, N.REQUEST_INFERENCE)}
        estimator = self.estimator
        done = (lambda labels, seconds: estimator.served(labels[1], seconds) if labels[1] != N.OTHER else None) if estimator else None
        return CallTimer(bounds.of_call, ttft=h[N.REQUEST_TTFT.name], itl=h[N.REQUEST_ITL.name], e2e=h[N.E2E_LATENCY.name],
                         queue=h[N.REQUEST_QUEUE.name], inference=h[N.REQUEST_INFERENCE.name], done=done)  # fmt: skip

    def capacity(self, bounds: LabelBounds, estimator: ReplicaEstimator, fleet: Callable[[str], tuple[int, int]]) -> Arrivals:
        """The stage after the rate limits (every arrival admission sees,
        queued, shed or refused for want of capacity, is demand; one over its
        tenant's own limit is not) and ``headrace_desired_replicas``; call
        before :meth:`call_timer`, which feeds the estimator service times."""
        self.estimator = estimator
        self.add_collector(CapacityCollector(estimator, bounds, fleet))
        return Arrivals(estimator, bounds)

    def set_worker(self, index: int) -> None:
        """Count this process's requests as worker ``index``'s."""
        self._this_worker = self.worker_requests.labels(str(index))

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)
        self._collectors.append(collector)

    # observe(route, status, tenant, seconds): OpenAIServer's hook
    def observe(self, route: str, status: int, tenant: str, seconds: float) -> None:
        if self.bounds is not None:
            tenant = self.bounds.tenant(tenant)
        key = (route, status, tenant)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(route, str(status), tenant)
        child.inc()
        observe_one(_child(self._latency, self.latency, route), seconds)
        self._this_worker.inc()

    # Recorder: per event on the hot path, so the labelled children are
    # looked up once per label value, not once per token.
    def queue_time(self, backend: str, seconds: float) -> None:
        observe_one(_child(self._queue, self.queue, backend), seconds)

    def time_to_first_token(self, backend: str, seconds: float) -> None:
        observe_one(_child(self._ttft, self.ttft, backend), seconds)

    def inter_token_latencies(self, backend: str, seconds: Sequence[float]) -> None:
        observe_many(_child(self._itl, self.itl, backend), seconds)

    def resume_gap(self, backend: str, seconds: float, prefix: str) -> None:
        observe_one(_child2(self._resume, self.resume, backend, prefix), seconds)

    # ------------------------------------------------------------ latency breakdown (issue 18; router/logs.py)

    def _init_phases(self) -> None:
        self.phase = cast(Histogram, N.REQUEST_PHASE.instrument(self.registry))
        self._phase: dict[tuple[str, str], Histogram] = {}

    def phase_times(self, backend: str, phases: Mapping[str, float]) -> None:
        """A request's phases (RequestLog's ``observe_phases``), in one call,
        not one a phase."""
        for phase, seconds in phases.items():
            observe_one(_child2(self._phase, self.phase, phase, backend), seconds)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.mirror()
        return self._render_files()

    async def render_async(self) -> bytes:
        """:meth:`render` for /metrics, yielding to the event loop as it
        formats (frontend/exposition.py)."""
        if self.multiprocess_dir is None:
            return await render_cooperatively(self.registry)
        self.mirror()
        return await render_cooperatively(self._files())

    def _render_files(self) -> bytes:
        return generate_latest(self._files())

    def _files(self) -> CollectorRegistry:
        """Every worker's metrics, from the multiprocess files."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return registry

    # ------------------------------------------------------------ multiprocess mode

    def mirror(self) -> None:
        """Copy the collectors' live state into the multiprocess files."""
        for collector in self._collectors:
            self._mirror.copy(collector.collect())

    async def run_mirror(self, interval: float = MIRROR_INTERVAL) -> None:
        """Mirror every ``interval`` seconds until cancelled (multiprocess mode only)."""
        if self.multiprocess_dir is None:
            return
        while True:
            self.mirror()
            await trio.sleep(interval)

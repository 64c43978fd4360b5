"""Every Prometheus metric the router exports, named in this one file.

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
from collections.abc import Callable, Iterable, Sequence

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from router.actors import ActorStatistics
from router.admission import QueueStatistics
from router.dispatch import DispatchStatistics
from router.pipeline import PipelineStatistics

__all__ = ["CONTENT_TYPE", "MIRROR_INTERVAL", "Mirror", "RouterMetrics", "StatisticsCollector"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: token latencies are small, request latencies can be minutes.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

MIRROR_INTERVAL = 1.0  # seconds between two mirrors of a worker's live state (multiprocess mode)
# How a mirrored gauge aggregates across workers; any other gauge: "liveall" (one series per worker).
GAUGE_MODES = {
    "headrace_backend_in_flight": "livesum",
    "headrace_pipeline_in_flight": "livesum",
    "headrace_queue_depth": "livesum",
    "headrace_queue_busy": "livesum",
    "headrace_queue_group_busy": "livesum",
    "headrace_queue_group_depth": "livesum",
    "headrace_retry_budget_active": "livesum",
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
        gauges = {
            "in_flight": GaugeMetricFamily("headrace_backend_in_flight", "Requests in flight per backend", labels=["backend"]),
            "up": GaugeMetricFamily("headrace_backend_up", "1 when the backend takes requests (up, or suspect after a failure)", labels=["backend"]),
            "draining": GaugeMetricFamily("headrace_backend_draining", "1 when an operator drained the backend", labels=["backend"]),
        }
        counters = {
            field: CounterMetricFamily(f"headrace_backend_{field}", help_, labels=["backend"])
            for field, help_ in (
                ("requests", "Streams started on the backend"),
                ("failures", "Streams ended by an upstream error"),
                ("cancelled", "Streams abandoned by the client"),
                ("tokens", "Tokens relayed from the backend"),
                ("probe_failures", "Failed health probes"),
                ("restarts", "Actor restarts after a crash"),
            )
        }
        limit = GaugeMetricFamily("headrace_backend_concurrency_limit", "Streams at once the backend is given (learned from its 429s, at most its max_concurrency)", labels=["backend"])
        cuts = CounterMetricFamily("headrace_backend_concurrency_decreases", "Times a 429 cut the backend's concurrency limit", labels=["backend"])
        for s in stats:
            limit.add_metric([s.name], s.limit)
            cuts.add_metric([s.name], s.concurrency.decreases if s.concurrency is not None else 0)
        yield from (limit, cuts)
        for s in stats:
            gauges["in_flight"].add_metric([s.name], s.in_flight)
            gauges["up"].add_metric([s.name], 1.0 if s.up else 0.0)
            gauges["draining"].add_metric([s.name], 1.0 if s.draining else 0.0)
            for field, family in counters.items():
                family.add_metric([s.name], getattr(s, field))
        yield from gauges.values()
        yield from counters.values()
        d = self._dispatch()
        for field, help_ in (
            ("retries", "Attempts moved to another backend before the first token"),
            ("unavailable", "Requests refused because no backend was eligible"),
            ("fallbacks", "Requests answered by a fallback model of their route"),
            ("rate_limited", "429s from backends (each cooled that backend down)"),
        ):
            yield CounterMetricFamily(f"headrace_dispatch_{field}", help_, value=getattr(d, field))
        cooling = GaugeMetricFamily("headrace_backend_cooling", "1 while a backend rests after a 429", labels=["backend"])
        for s in stats:
            cooling.add_metric([s.name], 1.0 if s.name in d.cooling else 0.0)
        yield cooling
        labels = ["route", "version"]
        weight = GaugeMetricFamily("headrace_model_version_weight", "Traffic weight of a version of a split route", labels=labels)
        requests = CounterMetricFamily("headrace_model_version_requests", "Requests a split route sent to a version", labels=labels)
        failed = CounterMetricFamily("headrace_model_version_failed", "Of those, ended by an error", labels=labels)
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


def _migrations(d: DispatchStatistics) -> Iterable[Metric]:
    m = d.migration
    family = CounterMetricFamily(
        "headrace_migrations",
        "Streams that broke after their first token, by why and how it ended (resumed by token ids, replayed and verified, failed)",
        labels=["reason", "outcome"],
    )
    for key, count in sorted(m.migrations.items()):
        reason, _, outcome = key.partition(":")
        family.add_metric([reason, outcome], count)
    yield family
    yield CounterMetricFamily("headrace_migration_replay_divergences", "Replays whose text differed from what the client had", value=m.divergences)
    yield CounterMetricFamily("headrace_migration_inexact", "Resumes on a backend that does not promise exact resume", value=m.inexact)


def _breakers(d: DispatchStatistics) -> Iterable[Metric]:
    yield CounterMetricFamily("headrace_dispatch_retries_refused", "Retries the retry budget refused (the request got the upstream error)", value=d.retries_refused)
    state = GaugeMetricFamily("headrace_backend_breaker_state", "The backend's circuit breaker: 0 closed, 1 half-open, 2 open (ejected)", labels=["backend"])
    ejections = CounterMetricFamily("headrace_backend_ejections", "Times the backend's breaker opened", labels=["backend"])
    refused = CounterMetricFamily("headrace_backend_refused_ejections", "Ejections refused by the fleet rule (too many ejected already)", labels=["backend"])
    for b in d.breakers:
        state.add_metric([b.name], BREAKER_STATES.get(b.state, 2.0))
        ejections.add_metric([b.name], b.ejections)
        refused.add_metric([b.name], b.refused_trips)
    yield from (state, ejections, refused)
    if d.retry_budget is not None:
        r = d.retry_budget
        yield GaugeMetricFamily("headrace_retry_budget_active", "Retries in flight", value=r.active)
        yield CounterMetricFamily("headrace_retry_budget_granted", "Retries the budget let through", value=r.granted)
        yield CounterMetricFamily("headrace_retry_budget_refused", "Retries the budget refused", value=r.refused)


def _pipeline(p: PipelineStatistics) -> Iterable[Metric]:
    yield CounterMetricFamily("headrace_pipeline_admitted", "Client requests the pipeline let through", value=p.admitted)
    yield GaugeMetricFamily("headrace_pipeline_in_flight", "Admitted client requests not finished yet", value=p.in_flight)
    rejected = CounterMetricFamily("headrace_pipeline_rejected", "Client requests refused by the pipeline, by error code", labels=["code"])
    for code, count in sorted(p.rejected.items()):
        rejected.add_metric([code], count)
    yield rejected
    latency = GaugeMetricFamily("headrace_pipeline_rejection_seconds", "Arrival to refusal of the last 1024 requests refused at arrival (not queue_timeout), by quantile", labels=["quantile"])
    for q, value in (("0.5", p.rejection_p50), ("0.99", p.rejection_p99)):
        if value is not None:
            latency.add_metric([q], value)
    yield latency


def _queue(q: QueueStatistics) -> Iterable[Metric]:
    depth = GaugeMetricFamily("headrace_queue_depth", "Requests waiting for a backend slot, per priority class", labels=["class"])
    for cls, count in q.queued.items():
        depth.add_metric([cls], count)
    yield depth
    yield GaugeMetricFamily("headrace_queue_capacity", "Admission slots of the backends that take requests now", value=q.capacity)
    yield GaugeMetricFamily("headrace_queue_busy", "Admission slots held", value=q.busy)
    labels = ["group"]
    group_capacity = GaugeMetricFamily("headrace_queue_group_capacity", "Admission slots of a model group's backends that take requests now", labels=labels)
    group_busy = GaugeMetricFamily("headrace_queue_group_busy", "Admission slots a model group's requests hold", labels=labels)
    group_queued = GaugeMetricFamily("headrace_queue_group_depth", "Requests waiting for a slot of a model group", labels=labels)
    for g in q.groups:
        name = ",".join(g.backends) or "*"  # *: every backend
        group_capacity.add_metric([name], g.capacity)
        group_busy.add_metric([name], g.busy)
        group_queued.add_metric([name], g.queued)
    yield from (group_capacity, group_busy, group_queued)
    admitted = CounterMetricFamily("headrace_queue_admitted", "Requests given a slot, at once or after waiting", labels=["how"])
    admitted.add_metric(["at_once"], q.admitted_at_once)
    admitted.add_metric(["after_wait"], q.admitted_after_wait)
    yield admitted
    if q.service_rate is not None:
        yield GaugeMetricFamily("headrace_queue_service_rate", "Measured completions per second per slot", value=q.service_rate)


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


def _child(cache: dict[str, Histogram], family: Histogram, label: str) -> Histogram:
    child = cache.get(label)
    if child is None:
        child = cache[label] = family.labels(label)
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
        self.requests = Counter("headrace_requests", "HTTP requests by route, status and tenant", ["route", "status", "tenant"], registry=r)
        self.latency = Histogram("headrace_request_duration_seconds", "Request latency, to the last byte", ["route"], buckets=REQUEST_BUCKETS, registry=r)
        self.ttft = Histogram("headrace_time_to_first_token_seconds", "From arrival to the backend's first event", ["backend"], buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("headrace_inter_token_latency_seconds", "Between consecutive token events", ["backend"], buckets=TOKEN_BUCKETS, registry=r)
        self.resume = Histogram("headrace_resume_gap_seconds", "From a stream breaking mid-answer to its next token from the backend it migrated to", ["backend"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue = Histogram("headrace_queue_time_seconds", "From arrival to the backend being chosen", ["backend"], buckets=TOKEN_BUCKETS, registry=r)
        self.worker_requests = Counter("headrace_worker_requests", "HTTP requests served, by router worker process", ["worker"], registry=r)
        self._this_worker = self.worker_requests.labels("0")
        self._requests: dict[tuple[str, int, str], Counter] = {}
        self._latency: dict[str, Histogram] = {}
        self._queue: dict[str, Histogram] = {}
        self._ttft: dict[str, Histogram] = {}
        self._itl: dict[str, Histogram] = {}
        self._resume: dict[str, Histogram] = {}

    def set_worker(self, index: int) -> None:
        """Count this process's requests as worker ``index``'s."""
        self._this_worker = self.worker_requests.labels(str(index))

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)
        self._collectors.append(collector)

    # observe(route, status, tenant, seconds): OpenAIServer's hook
    def observe(self, route: str, status: int, tenant: str, seconds: float) -> None:
        key = (route, status, tenant)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(route, str(status), tenant)
        child.inc()
        _child(self._latency, self.latency, route).observe(seconds)
        self._this_worker.inc()

    # Recorder: per event on the hot path, so the labelled children are
    # looked up once per label value, not once per token.
    def queue_time(self, backend: str, seconds: float) -> None:
        _child(self._queue, self.queue, backend).observe(seconds)

    def time_to_first_token(self, backend: str, seconds: float) -> None:
        _child(self._ttft, self.ttft, backend).observe(seconds)

    def inter_token_latency(self, backend: str, seconds: float) -> None:
        _child(self._itl, self.itl, backend).observe(seconds)

    def resume_gap(self, backend: str, seconds: float) -> None:
        _child(self._resume, self.resume, backend).observe(seconds)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.mirror()
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

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

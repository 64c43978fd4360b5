"""Every Prometheus metric the router exports, named in this one file.

Per-request observations (status, latency, time to first token, inter-token
latency, queue time) go into histograms as they happen; state (in-flight per
backend, up/down, counters) is read from each component's ``statistics()``
at scrape time by :class:`StatisticsCollector`, so components never import
prometheus. Each router owns its own :class:`~prometheus_client.CollectorRegistry`
(no global registry), so tests can build several routers in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.actors import ActorStatistics
from router.dispatch import DispatchStatistics

__all__ = ["CONTENT_TYPE", "RouterMetrics", "StatisticsCollector"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: token latencies are small, request latencies can be minutes.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class StatisticsCollector(Collector):
    """Maps actor and dispatcher statistics to metrics on each scrape."""

    def __init__(
        self,
        actors: Callable[[], Sequence[ActorStatistics]],
        dispatch: Callable[[], DispatchStatistics],
    ) -> None:
        self._actors = actors
        self._dispatch = dispatch

    def collect(self) -> Iterable[Metric]:
        stats = self._actors()
        gauges = {
            "in_flight": GaugeMetricFamily("headrace_backend_in_flight", "Requests in flight per backend", labels=["backend"]),
            "up": GaugeMetricFamily("headrace_backend_up", "1 when the backend's last probe passed", labels=["backend"]),
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
        for s in stats:
            gauges["in_flight"].add_metric([s.name], s.in_flight)
            gauges["up"].add_metric([s.name], 1.0 if s.state == "up" else 0.0)
            gauges["draining"].add_metric([s.name], 1.0 if s.draining else 0.0)
            for field, family in counters.items():
                family.add_metric([s.name], getattr(s, field))
        yield from gauges.values()
        yield from counters.values()
        d = self._dispatch()
        for field, help_ in (
            ("retries", "Attempts moved to another backend before the first token"),
            ("unavailable", "Requests refused because no backend was eligible"),
        ):
            yield CounterMetricFamily(f"headrace_dispatch_{field}", help_, value=getattr(d, field))


class RouterMetrics:
    """The router's registry; also the dispatcher's :class:`~router.dispatch.Recorder`
    and the frontend's ``observe`` hook."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("headrace_requests", "HTTP requests by route, status and tenant", ["route", "status", "tenant"], registry=r)
        self.latency = Histogram("headrace_request_duration_seconds", "Request latency, to the last byte", ["route"], buckets=REQUEST_BUCKETS, registry=r)
        self.ttft = Histogram("headrace_time_to_first_token_seconds", "From arrival to the backend's first event", ["backend"], buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("headrace_inter_token_latency_seconds", "Between consecutive token events", ["backend"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue = Histogram("headrace_queue_time_seconds", "From arrival to the backend being chosen", ["backend"], buckets=TOKEN_BUCKETS, registry=r)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    # observe(route, status, tenant, seconds): OpenAIServer's hook
    def observe(self, route: str, status: int, tenant: str, seconds: float) -> None:
        self.requests.labels(route, str(status), tenant).inc()
        self.latency.labels(route).observe(seconds)

    # Recorder
    def queue_time(self, backend: str, seconds: float) -> None:
        self.queue.labels(backend).observe(seconds)

    def time_to_first_token(self, backend: str, seconds: float) -> None:
        self.ttft.labels(backend).observe(seconds)

    def inter_token_latency(self, backend: str, seconds: float) -> None:
        self.itl.labels(backend).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

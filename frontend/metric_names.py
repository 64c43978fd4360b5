"""Every Prometheus metric family headrace exports, declared once.

The router (router/metrics.py), the engine server (backends/engine/server.py)
and the GPU collector (backends/engine/gpu_metrics.py) build their families
from these declarations and never spell a metric name themselves; the
Grafana dashboard and the HPA in deploy/ are checked against this table
(tests/deploy), and so are a live router's and a live engine's /metrics
(tests/router/test_metric_names.py). It lives in frontend/ because the
router and the backends both import it, and backends never import router.

::

    Family(name, type, help, labels, buckets, exporters, when)
        ├─ .collected(): a CounterMetricFamily / GaugeMetricFamily (collectors,
        │                filled from statistics() records on each scrape)
        └─ .instrument(registry): a Counter / Gauge / Histogram (observed as
                                  things happen)

``name`` is the family name: a counter's samples end in ``_total`` (and
``_created`` for instruments), a histogram's in ``_bucket``/``_sum``/``_count``.
``when`` says when a family is exported only under some condition (empty:
always, possibly with no samples yet). In multiprocess mode (``headrace
serve --workers N``) mirrored gauges of the ``liveall`` mode also carry a
``pid`` label (router/metrics.py).

Label cardinality: ``backend`` is bounded by the configured backends,
``tenant`` by the configured tenants and API keys (any other is ``other``),
``model`` by the configured routes and the models backends list (any other
is ``other``), ``priority`` and ``class`` by the three classes, ``route`` by
the server's route templates, ``gpu`` by the devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = [
    "FAMILIES",
    "FIRST_TOKEN_BUCKETS",
    "OTHER",
    "REQUEST_BUCKETS",
    "TOKEN_BUCKETS",
    "Family",
    "declare",
    "exported_by",
    "get",
]

Type = Literal["counter", "gauge", "histogram"]
Exporter = Literal["router", "engine"]

OTHER = "other"  # the label value of a tenant or model outside the configured set

# Seconds: token latencies are small, request latencies can be minutes.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A first token (and a resumed stream's next one): TTFT SLOs sit between 50 ms
# and 1 s, where TOKEN_BUCKETS' 100 -> 250 -> 500 ms steps leave a quantile to
# linear interpolation across 150-250 ms; here no step there exceeds 1.5x. And
# a queued first token can wait up to the 60 s first-token timeout, past
# TOKEN_BUCKETS' 10 s.
FIRST_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # sequences per engine step


class Family(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    type: Type
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only
    exporters: tuple[Exporter, ...] = ("router",)
    when: str = ""  # the condition under which it is exported; "": always

    def collected(self, value: float | None = None) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family for a collector (or one unlabelled sample, ``value``)."""
        labels = list(self.labels) if value is None else None
        if self.type == "counter":
            return CounterMetricFamily(self.name, self.help, value=value, labels=labels)
        if self.type == "gauge":
            return GaugeMetricFamily(self.name, self.help, value=value, labels=labels)
        raise TypeError(f"{self.name} is a {self.type}: build it with HistogramMetricFamily")

    def instrument(self, registry: CollectorRegistry | None) -> Counter | Gauge | Histogram:
        """A live instrument registered in ``registry`` (None: unregistered)."""
        if self.type == "counter":
            return Counter(self.name, self.help, self.labels, registry=registry)
        if self.type == "gauge":
            return Gauge(self.name, self.help, self.labels, registry=registry)
        return Histogram(self.name, self.help, self.labels, buckets=self.buckets, registry=registry)


FAMILIES: dict[str, Family] = {}


def declare(name: str, type: Type, help: str, labels: tuple[str, ...] = (), **fields: object) -> Family:
    """Add a family to :data:`FAMILIES` (a name declared twice is an error)."""
    if name in FAMILIES:
        raise ValueError(f"metric family {name} declared twice")
    if type == "histogram" and not fields.get("buckets"):
        raise ValueError(f"histogram {name} needs buckets")
    family = msgspec.convert({"name": name, "type": type, "help": help, "labels": labels, **fields}, Family)
    FAMILIES[name] = family
    return family


def get(name: str) -> Family:
    return FAMILIES[name]


def exported_by(exporter: Exporter, *, conditional: bool = True) -> Iterator[Family]:
    """The families ``exporter`` exports (``conditional=False``: only those it always exports)."""
    for family in FAMILIES.values():
        if exporter in family.exporters and (conditional or not family.when):
            yield family


ROUTER: tuple[Exporter, ...] = ("router",)
ENGINE: tuple[Exporter, ...] = ("engine",)
BOTH: tuple[Exporter, ...] = ("router", "engine")
_B = ("backend",)
_SLI = ("route", "model", "tenant", "priority")

# ------------------------------------------------------------ router: per HTTP request

REQUESTS = declare("headrace_requests", "counter", "HTTP requests by route, status and tenant", ("route", "status", "tenant"))
REQUEST_DURATION = declare("headrace_request_duration_seconds", "histogram", "Request latency, to the last byte", ("route",), buckets=REQUEST_BUCKETS)
WORKER_REQUESTS = declare("headrace_worker_requests", "counter", "HTTP requests served, by router worker process", ("worker",))

# ------------------------------------------------------------ router: SLIs per call (route, model, tenant, priority)

E2E_LATENCY = declare("headrace_e2e_request_latency_seconds", "histogram", "Generation call latency: arrival to the last event of its last choice", _SLI, buckets=REQUEST_BUCKETS)
REQUEST_TTFT = declare("headrace_request_time_to_first_token_seconds", "histogram", "Arrival to a choice's first event from the backends (a streamed answer's first token to the client)", _SLI, buckets=FIRST_TOKEN_BUCKETS)
REQUEST_ITL = declare("headrace_request_inter_token_latency_seconds", "histogram", "Between consecutive token events of a choice", _SLI, buckets=TOKEN_BUCKETS)
REQUEST_QUEUE = declare("headrace_request_queue_time_seconds", "histogram", "Arrival to admission (rate limits and the admission queue)", _SLI, buckets=REQUEST_BUCKETS)
REQUEST_INFERENCE = declare("headrace_request_inference_time_seconds", "histogram", "Admission to the last event (backends, retries, migrations)", _SLI, buckets=REQUEST_BUCKETS)

# ------------------------------------------------------------ router: per backend, as the dispatcher sees it

TTFT = declare("headrace_time_to_first_token_seconds", "histogram", "From the dispatcher's start to the backend's first event", _B, buckets=FIRST_TOKEN_BUCKETS)
ITL = declare("headrace_inter_token_latency_seconds", "histogram", "Between consecutive token events", _B, buckets=TOKEN_BUCKETS)
RESUME_GAP = declare("headrace_resume_gap_seconds", "histogram", "From a stream breaking mid-answer to its next token from the backend it migrated to; prefix: held if that backend served at least 90% of the original prompt from its cache (by its usage), missed if less, unknown without usage", ("backend", "prefix"), buckets=FIRST_TOKEN_BUCKETS)
QUEUE_TIME = declare("headrace_queue_time_seconds", "histogram", "From the dispatcher's start to the backend being chosen", _B, buckets=TOKEN_BUCKETS)
# The latency breakdown (router/logs.py): each request's time by phase, which add up to its duration.
PHASES = ("ingress", "queue", "connect", "prefill", "decode", "egress")
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, *REQUEST_BUCKETS)  # router-side phases are often under a millisecond
REQUEST_PHASE = declare("headrace_request_phase_seconds", "histogram", "Each request's time by phase (ingress, queue, connect, prefill, decode, egress) and the backend that answered (none: refused before one)", ("phase", "backend"), buckets=PHASE_BUCKETS)

BACKEND_IN_FLIGHT = declare("headrace_backend_in_flight", "gauge", "Requests in flight per backend", _B)
BACKEND_UP = declare("headrace_backend_up", "gauge", "1 when the backend takes requests (up, or suspect after a failure)", _B)
BACKEND_DRAINING = declare("headrace_backend_draining", "gauge", "1 when an operator drained the backend", _B)
BACKEND_COUNTERS = {
    field: declare(f"headrace_backend_{field}", "counter", help_, _B)
    for field, help_ in (
        ("requests", "Streams started on the backend"),
        ("failures", "Streams ended by an upstream error"),
        ("cancelled", "Streams abandoned by the client"),
        ("tokens", "Tokens relayed from the backend"),
        ("probe_failures", "Failed health probes"),
        ("restarts", "Actor restarts after a crash"),
    )
}
BACKEND_LIMIT = declare("headrace_backend_concurrency_limit", "gauge", "Streams at once the backend is given (learned from its 429s, at most its max_concurrency)", _B)
BACKEND_CUTS = declare("headrace_backend_concurrency_decreases", "counter", "Times a 429 cut the backend's concurrency limit", _B)
BACKEND_COOLING = declare("headrace_backend_cooling", "gauge", "1 while a backend rests after a 429", _B)
DISPATCH_COUNTERS = {
    field: declare(f"headrace_dispatch_{field}", "counter", help_)
    for field, help_ in (
        ("retries", "Attempts moved to another backend before the first token"),
        ("unavailable", "Requests refused because no backend was eligible"),
        ("fallbacks", "Requests answered by a fallback model of their route"),
        ("rate_limited", "429s from backends (each cooled that backend down)"),
        ("retries_refused", "Retries the retry budget refused (the request got the upstream error)"),
    )
}
_V = ("route", "version")
VERSION_WEIGHT = declare("headrace_model_version_weight", "gauge", "Traffic weight of a version of a split route", _V)
VERSION_REQUESTS = declare("headrace_model_version_requests", "counter", "Requests a split route sent to a version", _V)
VERSION_FAILED = declare("headrace_model_version_failed", "counter", "Of those, ended by an error", _V)
BREAKER_STATE = declare("headrace_backend_breaker_state", "gauge", "The backend's circuit breaker: 0 closed, 1 half-open, 2 open (ejected)", _B)
EJECTIONS = declare("headrace_backend_ejections", "counter", "Times the backend's breaker opened", _B)
REFUSED_EJECTIONS = declare("headrace_backend_refused_ejections", "counter", "Ejections refused by the fleet rule (too many ejected already)", _B)
_BUDGET = "[retry] budget configured"
RETRY_ACTIVE = declare("headrace_retry_budget_active", "gauge", "Retries in flight", when=_BUDGET)
RETRY_GRANTED = declare("headrace_retry_budget_granted", "counter", "Retries the budget let through", when=_BUDGET)
RETRY_REFUSED = declare("headrace_retry_budget_refused", "counter", "Retries the budget refused", when=_BUDGET)
MIGRATIONS = declare("headrace_migrations", "counter", "Streams that broke after their first token, by why and how it ended (resumed by token ids, replayed and verified, failed)", ("reason", "outcome"))
MIGRATION_DIVERGENCES = declare("headrace_migration_replay_divergences", "counter", "Replays whose text differed from what the client had")
BACKEND_RETRIES = declare("headrace_backend_retries", "counter", "Attempts that failed on the backend before the first token and moved on (a retry elsewhere)", _B)
BACKEND_MIGRATIONS = declare("headrace_backend_migrations", "counter", "Streams that broke on the backend after their first token (then migrated, or failed)", _B)
MIGRATION_STANDBY = declare("headrace_migration_standby_syncs", "counter", "Warm standby syncs ([migration] standby_tokens) by outcome: synced, failed, skipped (no other backend held the prompt)", ("outcome",))
MIGRATION_STANDBY_TOKENS = declare("headrace_migration_standby_tokens", "counter", "Tokens the warm standby syncs sent, less what their backends reported serving from cache (at most the original prompt's: an upper bound of what they prefilled)")
MIGRATION_INEXACT = declare("headrace_migration_inexact", "counter", "Resumes on a backend that does not promise exact resume")

# ------------------------------------------------------------ router: pipeline and admission queue

ROUTER_TASKS = declare("headrace_router_tasks", "gauge", "Trio tasks alive in this router process, its own and the HTTP server's (back to its idle count once load drains; one that keeps growing is a leak)")
PIPELINE_ADMITTED = declare("headrace_pipeline_admitted", "counter", "Client requests the pipeline let through")
PIPELINE_IN_FLIGHT = declare("headrace_pipeline_in_flight", "gauge", "Admitted client requests not finished yet")
PIPELINE_REJECTED = declare("headrace_pipeline_rejected", "counter", "Client requests refused by the pipeline, by error code", ("code",))
PIPELINE_REJECTION_SECONDS = declare("headrace_pipeline_rejection_seconds", "gauge", "Arrival to refusal of the last 1024 requests refused at arrival (not queue_timeout), by quantile", ("quantile",))
_ADMISSION = "[admission] enabled"
QUEUE_DEPTH = declare("headrace_queue_depth", "gauge", "Requests waiting for a backend slot, per priority class", ("class",), when=_ADMISSION)
QUEUE_CAPACITY = declare("headrace_queue_capacity", "gauge", "Admission slots of the backends that take requests now", when=_ADMISSION)
QUEUE_BUSY = declare("headrace_queue_busy", "gauge", "Admission slots held", when=_ADMISSION)
_G = ("group",)
QUEUE_GROUP_CAPACITY = declare("headrace_queue_group_capacity", "gauge", "Admission slots of a model group's backends that take requests now", _G, when=_ADMISSION)
QUEUE_GROUP_BUSY = declare("headrace_queue_group_busy", "gauge", "Admission slots a model group's requests hold", _G, when=_ADMISSION)
QUEUE_GROUP_DEPTH = declare("headrace_queue_group_depth", "gauge", "Requests waiting for a slot of a model group", _G, when=_ADMISSION)
QUEUE_ADMITTED = declare("headrace_queue_admitted", "counter", "Requests given a slot, at once or after waiting", ("how",), when=_ADMISSION)
QUEUE_SERVICE_RATE = declare("headrace_queue_service_rate", "gauge", "Measured completions per second per slot", when="[admission] enabled and a request has finished")

# ------------------------------------------------------------ router: autoscaling signal (sim/plan.py's M/M/c model)

_M = ("model",)
DESIRED_REPLICAS = declare("headrace_desired_replicas", "gauge", "Replicas an M/M/c model says the model needs for its target p99 at the fleet's live arrival rate ([capacity] traffic_share scales this process's); policies/capacity.py", _M)
ARRIVAL_RATE = declare("headrace_model_arrival_rate", "gauge", "Smoothed arrival rate of a model's requests at this router, per second (past the rate limits; refused by admission too)", _M)
REPLICA_SERVICE_RATE = declare("headrace_model_replica_service_rate", "gauge", "Measured completions per second one replica of the model gives at its concurrency", _M)
MODEL_REPLICAS = declare("headrace_model_replicas", "gauge", "Backends serving the model that take requests now", _M)

# ------------------------------------------------------------ router: local engine replicas and their warm pools (router/engines.py)

_LOCAL = "headrace serve runs engine replicas ([[engines]], or no backend configured)"
LOCAL_REPLICAS = declare("headrace_local_replicas", "gauge", "Engine replicas of an [[engines]] entry (pool: its name) by state: serving (in rotation), warm (loaded, out of rotation), starting, stopping", ("pool", "state"), when=_LOCAL)
LOCAL_FOOTPRINT = declare("headrace_local_replica_footprint_bytes", "gauge", "Memory one replica of the entry holds: a running replica's report (source=report) or the estimate from its files (source=estimate)", ("pool", "source"), when=_LOCAL)
LOCAL_COLD_START = declare("headrace_local_replica_cold_start_seconds", "gauge", "The entry's last replica start, process start to serving", ("pool",), when=_LOCAL)

# ------------------------------------------------------------ engine

_E = "headrace_engine_"
ENGINE_TOKENS_PER_SECOND = declare(_E + "tokens_per_second", "gauge", "Generated tokens per second (last 10 s)", exporters=ENGINE)
ENGINE_RUNNING = declare(_E + "num_requests_running", "gauge", "Sequences in the running batch", exporters=ENGINE)
ENGINE_WAITING = declare(_E + "num_requests_waiting", "gauge", "Sequences waiting for admission", exporters=ENGINE)
ENGINE_KV_USAGE = declare(_E + "kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use", exporters=ENGINE)
ENGINE_PREFIX_HIT_RATE = declare(_E + "prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache", exporters=ENGINE)
ENGINE_GENERATED = declare(_E + "generated_tokens", "counter", "Tokens generated", exporters=ENGINE)
ENGINE_PREEMPTIONS = declare(_E + "preemptions", "counter", "Sequences preempted (recompute)", exporters=ENGINE)
ENGINE_STEPS = declare(_E + "steps", "counter", "Engine steps", exporters=ENGINE)
ENGINE_STEP_ERRORS = declare(_E + "step_errors", "counter", "Engine steps that failed", exporters=ENGINE)
ENGINE_FINISHED = declare(_E + "requests_finished", "counter", "Requests finished", exporters=ENGINE)
ENGINE_BATCH_SIZE = declare(_E + "batch_size", "histogram", "Sequences per engine step", buckets=BATCH_BUCKETS, exporters=ENGINE)
_SPEC = "speculative decoding on"
ENGINE_SPEC_DRAFT = declare(_E + "spec_draft_tokens", "counter", "Draft tokens proposed", exporters=ENGINE, when=_SPEC)
ENGINE_SPEC_ACCEPTED = declare(_E + "spec_accepted_tokens", "counter", "Draft tokens accepted", exporters=ENGINE, when=_SPEC)
ENGINE_SPEC_VERIFY = declare(_E + "spec_verify_steps", "counter", "Request-steps that verified drafts", exporters=ENGINE, when=_SPEC)
ENGINE_SPEC_ACCEPTANCE = declare(_E + "spec_acceptance_rate", "gauge", "Accepted / drafted tokens", exporters=ENGINE, when=_SPEC)
ENGINE_SPEC_PER_VERIFY = declare(_E + "spec_tokens_per_verify", "gauge", "Tokens emitted per verifying request-step", exporters=ENGINE, when=_SPEC)
ENGINE_SPEC_CUTOFFS = declare(_E + "spec_batch_cutoffs", "counter", "Steps with speculation off because the batch was large", exporters=ENGINE, when=_SPEC)
_RM = ("route", "model")
ENGINE_E2E = declare(_E + "e2e_request_latency_seconds", "histogram", "Arrival at the engine server to a choice's last event", _RM, buckets=REQUEST_BUCKETS, exporters=ENGINE)
ENGINE_TTFT = declare(_E + "time_to_first_token_seconds", "histogram", "Arrival at the engine server to a choice's first event (the engine's queue and prefill)", _RM, buckets=FIRST_TOKEN_BUCKETS, exporters=ENGINE)
ENGINE_ITL = declare(_E + "inter_token_latency_seconds", "histogram", "Between consecutive token events of a choice", _RM, buckets=TOKEN_BUCKETS, exporters=ENGINE)

# ------------------------------------------------------------ GPUs (pynvml), in the engine's /metrics (and a router's with an in-process engine)

_GPU = "an NVIDIA device and its driver are present (pynvml initialises)"
_D = ("gpu", "uuid")
GPU_COLLECTOR_UP = declare("headrace_gpu_collector_up", "gauge", "1 when pynvml found NVIDIA devices; 0 (and no other headrace_gpu_* family) when there are none or no driver", exporters=ENGINE)
GPU_INFO = declare("headrace_gpu_info", "gauge", "1 per device, labelled with its name", ("gpu", "uuid", "name"), exporters=ENGINE, when=_GPU)
GPU_UTILIZATION = declare("headrace_gpu_utilization_ratio", "gauge", "Fraction of the last sample period a kernel ran on the device", _D, exporters=ENGINE, when=_GPU)
GPU_MEMORY_USED = declare("headrace_gpu_memory_used_bytes", "gauge", "Device memory in use", _D, exporters=ENGINE, when=_GPU)
GPU_MEMORY_TOTAL = declare("headrace_gpu_memory_total_bytes", "gauge", "Device memory in all", _D, exporters=ENGINE, when=_GPU)
GPU_POWER = declare("headrace_gpu_power_watts", "gauge", "Power drawn by the device", _D, exporters=ENGINE, when=_GPU)
GPU_TEMPERATURE = declare("headrace_gpu_temperature_celsius", "gauge", "Device (GPU die) temperature", _D, exporters=ENGINE, when=_GPU)

# ------------------------------------------------------------ cost accounting (backends/engine/accounting.py, router/usage.py)

# The engine's tenant is the router's (x-headrace-tenant); it keeps at most 256 apart (then: other).
_TM = ("tenant", "model")
ENGINE_GPU_SECONDS = declare(_E + "gpu_seconds", "counter", "Engine step time attributed to a tenant: each step's wall time split across its sequences by their share of the tokens computed in it", _TM, exporters=ENGINE)
ENGINE_BUSY_SECONDS = declare(_E + "busy_seconds", "counter", "Wall time of the engine's steps (what the tenants' GPU-seconds add up to)", exporters=ENGINE)
ENGINE_TENANT_COMPUTED = declare(_E + "tenant_computed_tokens", "counter", "Tokens computed for a tenant: prefill not served from the prefix cache, and decode", _TM, exporters=ENGINE)
ENGINE_TENANT_GENERATED = declare(_E + "tenant_generated_tokens", "counter", "Tokens generated for a tenant", _TM, exporters=ENGINE)
USAGE_REQUESTS = declare("headrace_usage_requests", "counter", "Generation calls that finished with usage, by tenant and model", _TM)
USAGE_PROMPT = declare("headrace_usage_prompt_tokens", "counter", "Prompt tokens of finished calls, by tenant and model", _TM)
USAGE_GENERATED = declare("headrace_usage_generated_tokens", "counter", "Generated tokens of finished calls, by tenant and model", _TM)
USAGE_GPU = declare("headrace_usage_gpu_seconds", "counter", "GPU-seconds the backends reported for finished calls (headrace's engine does), by tenant and model", _TM)
USAGE_FLUSH_ERRORS = declare("headrace_usage_flush_errors", "counter", "Usage batches the job store could not take (kept and sent with the next)")

"""The router assembled: actors, supervisor, dispatcher, metrics, HTTP app.

::

    client ─h2─> main listener ─> Router.public
                                   ├─ /health /ready ──────> ops app (no auth)
                                   └─ everything else ─────> api app (auth -> Principal)
                                        OpenAIServer: RequestContext, decode once (Call)
                                        Pipeline.admit(context, call): once per request
                                          RateLimits (429) -> Queue (admit / wait / 503)
                                        Dispatcher.stream per choice: RouteTable.plan (model routes)
                                        -> breakers.allows -> group policy.pick -> BackendActor.stream
                                        -> Backend.stream; outcome -> breakers.record
                                        ; before the first token: next backend, next model
                                          (within the retry budget, after a full-jitter backoff)
    127.0.0.1 ──> admin listener ─> Router.admin
                                   ├─ /health /ready /metrics ─> ops app (no auth)
                                   └─ /admin/* ────────────> admin app (the admin key, if set)
    in-process ─> Router (ASGI): every route on one app (tests, embedding)

The apps are :class:`~frontend.server.OpenAIServer` over the same
dispatcher; they differ in routes and authentication, so that probes and
scrapers need no key while every API call needs an API key and every admin
call the admin key (when keys are configured). ``headrace serve`` serves
``Router.public`` on its main listener and ``Router.admin`` on a second one
bound to 127.0.0.1 (router/server.py), so /metrics (tenant names) and
/admin/* are never reachable from the network by default. Without an admin
key (``[auth] admin_sha256``) /admin/* takes no key, which the loopback-only
admin listener makes safe; a non-loopback admin listener needs the key. The
in-process all-in-one app keeps the older rule for /admin/* without an admin
key: an API key when API keys are configured.

API keys are held as SHA-256 digests only (``[[auth.api_keys]] sha256``;
plain ``[auth] keys`` are digested at startup): a presented key is digested
and compared with every known digest in constant time (``hmac.compare_digest``,
no early exit), and only a 12-hex-digit prefix of the digest (the key id)
is ever logged or labelled. The admin key is held and compared the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import msgspec
import trio

from backends.base import Backend
from backends.errors import NotFound, Unauthorized
from frontend.context import Principal
from frontend.heap import HeapTrimmer
from frontend.loop_lag import LoopLag
from frontend.server import (
    Authenticate,
    Handler,
    HTTPRequest,
    OpenAIServer,
    Response,
    json_response,
)
from policies.base import KVEventSink, KVEventView, RoutingPolicy
from policies.breaker import BreakerPolicy, RetryBudget
from policies.placement import Placement
from policies.ratelimit import Limits
from policies.registry import create, create_policy
from policies.shared_limits import SharedRateLimitPolicy
from router.actors import BackendActor, Supervisor
from router.admin import AdminAPI
from router.admission import LocalLimiter, Queue, RateLimits, Tenants
from router.breakdown import Breakdown
from router.config import ConfigError, MigrationConfig, ModelRoute, RouterConfig, TracingConfig
from router.data import open_data
from router.dispatch import Dispatcher
from router.health import HealthState
from router.jobs import JobRunner
from router.logs import Journal, RequestLog
from router.metrics import (
    CONTENT_TYPE,
    LabelBounds,
    RouterMetrics,
    StatisticsCollector,
    fleet_of,
    replica_estimator,
)
from router.migration import Settings as MigrationSettings
from router.pipeline import Pipeline
from router.prefix_keys import PrefixKeys, TokenizerLoadError, load_encoder
from router.ratelimit_redis import RedisLimiter
from router.routes import RouteTable
from router.services import Service
from router.store import JobStore
from router.tracing import Tracer
from router.usage import UsageLedger, open_usage_store

log = logging.getLogger(__name__)

__all__ = ["OPS_PATHS", "PROBE_PATHS", "KVFanOut", "KnownKey", "NamedBackend", "Router", "key_digest", "kv_sink_for"]

OPS_PATHS = frozenset({"/health", "/ready", "/metrics"})
PROBE_PATHS = frozenset({"/health", "/ready"})  # the ops paths the main listener serves too


class NamedBackend(msgspec.Struct, frozen=True):
    """A backend client with the name and weight the router knows it by."""

    name: str
    backend: Backend
    weight: float = 1.0


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key: what config stores and requests are compared by."""
    return hashlib.sha256(key.encode()).hexdigest()


class KnownKey(msgspec.Struct, frozen=True):
    digest: bytes  # the raw SHA-256
    tenant: str
    key_id: str  # the digest's first 12 hex digits: safe to log and label
    limits: Limits


def known_keys(config: RouterConfig) -> list[KnownKey]:
    """Every configured key, by digest; plain legacy keys are digested here."""
    keys = [KnownKey(bytes.fromhex(k.sha256), k.tenant, k.sha256[:12],
                     Limits(requests_per_minute=k.requests_per_minute, tokens_per_minute=k.tokens_per_minute,
                            concurrent=k.concurrent))
            for k in config.auth.api_keys]  # fmt: skip
    if config.auth.keys:
        log.warning("[auth] keys holds %d plain API keys; store their SHA-256 digests in [[auth.api_keys]] instead "
                    "(printf %%s KEY | sha256sum)", len(config.auth.keys))  # fmt: skip
    for key, tenant in config.auth.keys.items():
        digest = key_digest(key)
        keys.append(KnownKey(bytes.fromhex(digest), tenant, digest[:12], Limits()))
    return keys


def kv_sink_for(backend: str, policies: Sequence[tuple[RoutingPolicy, tuple[str, ...] | None]]) -> KVEventSink | None:
    """What ``backend``'s KV events feed: every policy instance whose group
    holds it and that indexes KV events (one, or a :class:`KVFanOut`)."""
    sinks = [p for p, group in policies if (group is None or backend in group) and hasattr(p, "on_kv_events")]
    if not sinks:
        return None
    return cast(KVEventSink, sinks[0]) if len(sinks) == 1 else KVFanOut([cast(KVEventSink, p) for p in sinks])


class KVFanOut:
    """One backend's KV event stream delivered to several policies (model
    groups that share the backend). They stay in step: a gap seen by any
    resets them all, so the resubscription from -1 serves every one."""

    def __init__(self, sinks: Sequence[KVEventSink]) -> None:
        self.sinks = list(sinks)

    def kv_since(self, backend: str) -> int:
        points = {s.kv_since(backend) for s in self.sinks}
        if len(points) == 1:
            return points.pop()
        self.on_kv_reset(backend)
        return -1

    def on_kv_events(self, backend: str, events: Sequence[KVEventView], now: float) -> bool:
        results = [s.on_kv_events(backend, events, now) for s in self.sinks]
        if all(results):
            return True
        self.on_kv_reset(backend)
        return False

    def on_kv_reset(self, backend: str) -> None:
        for s in self.sinks:
            s.on_kv_reset(backend)


class Router:
    """One router: call :meth:`run` in a nursery, serve ``router`` as ASGI."""

    def __init__(
        self,
        config: RouterConfig,
        backends: Sequence[NamedBackend],
        *,
        policy: RoutingPolicy | None = None,
        clock: Callable[[], float] = trio.current_time,
        tracer: Tracer | None = None,
    ) -> None:
        """``policy`` serves the models no ``[[models]]`` route names (default:
        ``[routing]``'s); each route's group gets its own instance. ``clock``
        is the router's time (cool-downs); tests pass a fake one."""
        self.config = config
        h = config.health
        r = config.routing
        default = policy if policy is not None else create_policy(r.policy, options=r.options)
        migration = migration_settings(config.migration)
        routes = RouteTable(config.models, default, self._route_policy, migration)
        a = config.admission
        limits = {name: spec.max_concurrency for name, spec in zip(config.backend_names(), config.backends, strict=True)}
        self.actors = [self.new_actor(b, limits.get(b.name), routes) for b in backends]
        self._models = {name: route for route in config.models for name in (route.name, *route.aliases)}
        self.metrics = RouterMetrics()
        self.tracer = tracer if tracer is not None else tracer_for(config.tracing)  # tests pass their own
        self.journal = Journal(tracer=self.tracer, log_prompts=config.logging.log_prompts)
        self.breakdown = Breakdown()
        lines = config.logging.requests if config.logging.requests is not None else config.logging.format == "json"
        self.request_log = RequestLog(breakdown=self.breakdown, observe_phases=self.metrics.phase_times, tracer=self.tracer, lines=lines)
        self.keys = PrefixKeys()
        b, retry = config.breaker, config.retry
        breakers: BreakerPolicy | None = create("breaker", b.policy, b.options) if b.enabled else None
        self.dispatcher = Dispatcher(
            self.actors,
            default,
            keys=self.keys,
            routes=routes,
            max_attempts=r.max_attempts,
            retry_after=r.retry_after,
            cooldown=r.cooldown,
            max_cooldown=r.max_cooldown,
            recorder=self.metrics,
            clock=clock,
            breakers=breakers,
            retry_budget=RetryBudget(retry.budget_ratio, retry.min_retries),
            backoff_base=retry.backoff_base,
            backoff_cap=retry.backoff_cap,
            migration=migration,
            journal=self.journal,
            placement=placement_of(config),
            spawn=self.spawn,
        )
        self.api_keys = known_keys(config)
        self.tenants = Tenants(config.tenants, {k.key_id: k.limits for k in self.api_keys if k.limits != Limits()})
        limits_policy = create("ratelimit", config.ratelimit.policy, config.ratelimit.options)
        # A shared policy's decisions are made in Redis; its limiter sends them (a supervised service).
        self.shared_limits: RedisLimiter | None = None
        if isinstance(limits_policy, SharedRateLimitPolicy) and config.ratelimit.url:
            self.shared_limits = RedisLimiter(limits_policy, config.ratelimit.url)
        stages: list[Any] = [RateLimits(self.tenants, self.shared_limits or LocalLimiter(limits_policy))]
        self.queue: Queue | None = None
        if a.enabled:
            self.queue = Queue(
                self.tenants,
                a,
                create("admission", a.policy, a.options),
                lambda: create("priority", config.priority.policy, config.priority.options),
                self.capacity,
                group=self.group_of,
                retry_after=r.retry_after,
                unavailable=lambda key: self.dispatcher.ejection_wait(key or [a.name for a in self.actors]),
            )
            stages.append(self.queue)
        # After the rate limits (a tenant over its own limit is not demand more replicas would serve):
        # arrivals for headrace_desired_replicas; last: per-call SLIs, timed from admission (router/metrics.py)
        served = lambda: [*self._models, *(m for a in self.actors if a.info is not None for m in a.info.models)]  # noqa: E731
        bounds = LabelBounds([*config.tenants, *(k.tenant for k in self.api_keys)], served)
        stages.insert(1, self.metrics.capacity(bounds, replica_estimator(config.capacity), fleet_of(self.actors, self.group_of)))
        stages.append(self.metrics.call_timer(bounds))
        self.usage = UsageLedger(self.metrics)  # tokens and GPU-seconds per tenant and model (router/usage.py)
        stages.append(self.usage)
        self.pipeline = Pipeline(stages, journal=self.journal)
        self.metrics.add_collector(
            StatisticsCollector(
                self.dispatcher.backend_statistics,
                self.dispatcher.statistics,
                pipeline=self.pipeline.statistics,
                queue=self.queue.statistics if self.queue is not None else None,
            )
        )
        # [jobs] path set: the jobs API and its runner, a supervised service beside the actors.
        self.job_store: JobStore | None = None
        self.jobs: JobRunner | None = None
        services: list[Service] = list(self.actors)
        self.loop_lag = LoopLag()  # stretches the HTTP adapters' stall verdicts (frontend/loop_lag.py)
        services.append(self.loop_lag)
        self.heap_trimmer = HeapTrimmer()  # RSS back down after buffers are freed (frontend/heap.py)
        services.append(self.heap_trimmer)
        if self.shared_limits is not None:
            services.append(self.shared_limits)
        if self.queue is not None:
            services.append(self.queue)
        job_routes = {}
        # The data directory (router/data.py): jobs, files, batches, Idempotency-Key.
        self.data = open_data(config.jobs, self.dispatcher, self.pipeline, ready=self.dispatcher.ready,
                              max_line_bytes=config.server.max_body_bytes)  # fmt: skip
        if self.data is not None:
            self.job_store, self.jobs = self.data.store, self.data.jobs
            services += [self.data.jobs, self.data.batches]
            job_routes = self.data.routes
        self.usage.attach(open_usage_store(self.job_store))
        if self.usage.store is not None:
            services.append(self.usage)
        self.supervisor = Supervisor(services, backoff=h.restart_backoff, backoff_max=h.restart_backoff_max)
        limit = config.server.max_body_bytes
        self.admin_handlers = AdminAPI(self)  # router/admin.py
        admin_routes: dict[tuple[str, str], Handler] = self.admin_handlers.routes()
        admin_routes["GET", "/admin/usage"] = self.usage.admin
        sha = config.auth.admin_sha256
        self.admin_key = bytes.fromhex(sha) if sha is not None else None
        self.api = OpenAIServer(
            self.dispatcher,
            extra_routes=job_routes,
            authenticate=self._authenticate if config.auth.enabled else None,
            max_body_bytes=limit,
            body_idle_timeout=config.server.body_idle_timeout,
            observe=self.metrics.observe,
            gate=self.pipeline,
            coalesce=True,
            finished=self.request_log.finish,
        )
        if self.data is not None:  # Idempotency-Key on the OpenAI POSTs too
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/generate"):
                self.api.routes.add("POST", path, self.data.idempotency.wrap(self.api.routes.resolve("POST", path).handler))
        self.ops = OpenAIServer(
            self.dispatcher,
            extra_routes={("GET", "/ready"): self._ready, ("GET", "/metrics"): self._metrics},
            max_body_bytes=limit,
            body_idle_timeout=config.server.body_idle_timeout,
            observe=self.metrics.observe,
        )

        def admin_app(authenticate: Authenticate | None) -> OpenAIServer:
            return OpenAIServer(self.dispatcher, extra_routes=admin_routes, authenticate=authenticate,
                                max_body_bytes=limit, body_idle_timeout=config.server.body_idle_timeout,
                                observe=self.metrics.observe, openai_routes=False)  # fmt: skip

        by_key: Authenticate | None = self._authenticate_admin if self.admin_key is not None else None
        self.admin_api = admin_app(by_key)
        self._admin_inline = self.admin_api if by_key is not None or not config.auth.enabled else admin_app(self._authenticate)
        self._nursery: trio.Nursery | None = None  # Router.run's, for spawn()
        self.admin_url: str | None = None  # set by router.server.run_router once the admin listener is bound

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors (and the tokenizer learner) until cancelled, then
        close every backend client."""
        try:
            async with trio.open_nursery() as nursery:

                async def supervise(*, task_status: trio.TaskStatus[None]) -> None:
                    await self.supervisor.run(task_status=task_status)
                    nursery.cancel_scope.cancel()  # every actor stopped for good: so does the rest

                await nursery.start(supervise)
                self._nursery = nursery
                nursery.start_soon(self._learn_keys)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self.dispatcher.aclose()
            if self.job_store is not None:
                self.job_store.close()
            if self.tracer is not None:
                await trio.to_thread.run_sync(self.tracer.shutdown)

    async def _learn_keys(self) -> None:
        """Learn each served model's tokenizer from its backends (once per
        model; a lookup afterwards), so routing keys are the engines' own
        block hashes; re-checked every probe interval for backends that come
        up later. A failure here only leaves that model on text blocks."""
        for route in self.config.models:  # configured tokenizers win over learned ones
            if route.tokenizer is not None:
                try:
                    encoder = await trio.to_thread.run_sync(load_encoder, route.tokenizer)
                except TokenizerLoadError as exc:
                    log.warning("model %s: %s; routing it by text blocks until one is learned", route.name, exc)
                    continue
                for model in dict.fromkeys((route.upstream_model or route.name, route.name)):
                    self.keys.set_encoder(model, encoder, source=f"config {route.tokenizer}")
        while True:
            for actor in self.actors:
                if actor.info is not None:
                    try:
                        await self.keys.learn(actor.backend, actor.info)
                    except Exception:
                        log.exception("learning the tokenizer of backend %s failed; its models route by text", actor.name)
            await trio.sleep(self.config.health.interval)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Every route on one app, for in-process use (tests, embedding)."""
        path = scope.get("path", "")
        app = self.ops if path in OPS_PATHS else self._admin_inline if path.startswith("/admin/") else self.api
        await app(scope, receive, send)

    async def public(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The main listener's app: the API and the probes; no /metrics, no /admin."""
        app = self.ops if scope.get("path") in PROBE_PATHS else self.api
        await app(scope, receive, send)

    async def admin(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The admin listener's app: the probes, /metrics and /admin/*; no API."""
        app = self.ops if scope.get("path") in OPS_PATHS else self.admin_api
        await app(scope, receive, send)

    def new_actor(self, b: NamedBackend, max_concurrency: int | None = None, routes: RouteTable | None = None) -> BackendActor:
        """The actor that owns backend ``b`` (at startup, or added at runtime)."""
        h, a = self.config.health, self.config.admission
        policies = (routes if routes is not None else self.dispatcher.routes).policies()
        return BackendActor(
            b.name,
            b.backend,
            weight=b.weight,
            probe_interval=h.interval,
            probe_timeout=h.timeout,
            unhealthy_threshold=h.unhealthy_threshold,
            kv_sink=kv_sink_for(b.name, policies),
            max_concurrency=max_concurrency or a.backend_concurrency,
            learn_concurrency=a.learn_concurrency,
            concurrency_backoff=a.concurrency_backoff,
        )

    async def add_actor(self, actor: BackendActor) -> None:
        """A backend joins at runtime: routed to once its first probe is in."""
        self.actors.append(actor)
        self.dispatcher.add(actor)
        await self.supervisor.add(actor)

    async def remove_actor(self, actor: BackendActor) -> None:
        """A backend leaves (the admin API drains it first): out of routing, its actor and client closed."""
        self.dispatcher.remove(actor.name)
        self.actors.remove(actor)
        with trio.CancelScope(shield=True):
            await actor.aclose()
        self.supervisor.forget(actor)

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn(*args)`` beside the actors until the router stops."""
        if self._nursery is None:
            raise RuntimeError("the router is not running")
        self._nursery.start_soon(fn, *args)

    def actor(self, name: str) -> BackendActor:
        for actor in self.actors:
            if actor.name == name:
                return actor
        raise NotFound(f"no backend named {name!r}", param="backend")

    def _route_policy(self, route: ModelRoute) -> RoutingPolicy:
        """A model group's own policy: its ``policy`` and ``options``, else
        a fresh one of ``[routing]``'s (config validation already built one)."""
        if route.policy is not None:
            return create_policy(route.policy, options=route.options)
        return create_policy(self.config.routing.policy, options=self.config.routing.options)

    # ------------------------------------------------------------ hooks and routes

    def capacity(self, group: tuple[str, ...] | None = None) -> int:
        """Admission slots of a model group (:meth:`group_of`; None or ():
        every backend): the concurrency limits (learned from 429s, at most
        max_concurrency) of its backends that take requests now. A
        half-open backend counts one slot: the breaker's trial."""
        self.dispatcher.sync()
        names = set(group) if group else None
        total = 0
        for actor in self.actors:
            if (names is None or actor.name in names) and actor.eligible(None) and not self.dispatcher.ejected(actor.name):
                total += 1 if actor.state is HealthState.HALF_OPEN else actor.limit
        return total

    def group_of(self, model: str | None) -> tuple[str, ...]:
        """The backends a request for ``model`` may go to first, sorted (its
        route's group; a split's, every version's; else every backend that
        lists the model); () when that is every backend. Admission counts
        slots and queues per group: a model whose backends are full does not
        hold up another's."""
        names = self._members(model, set()) if model else None
        if names is None or len(names) == len(self.actors):
            return ()
        return tuple(sorted(names))

    def _members(self, model: str, seen: set[str]) -> set[str]:
        route = self._models.get(model)
        if route is not None and route.name in seen:
            return set()  # config validation refuses cycles; this only guards
        if route is not None and route.versions:
            seen.add(route.name)
            return set().union(*(self._members(v.model, seen) for v in route.versions))
        if route is not None and route.backends is not None:
            return set(route.backends)
        upstream = (route.upstream_model or route.name) if route is not None else model
        return {a.name for a in self.actors if not a.models or upstream in a.models}

    def _authenticate(self, headers: dict[str, str]) -> Principal:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key:
            digest = hashlib.sha256(key.strip().encode()).digest()
            found: KnownKey | None = None
            for known in self.api_keys:  # every one, no early exit: the time says nothing
                if hmac.compare_digest(known.digest, digest):
                    found = known
            if found is not None:
                return Principal(found.tenant, found.key_id)
        raise Unauthorized("Incorrect or missing API key; send Authorization: Bearer <key>.")

    def _authenticate_admin(self, headers: dict[str, str]) -> Principal:
        """The admin key (``[auth] admin_sha256``), compared in constant time."""
        scheme, _, key = headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        if scheme.lower() == "bearer" and key and self.admin_key is not None and hmac.compare_digest(self.admin_key, digest):
            return Principal("admin")
        raise Unauthorized("Incorrect or missing admin key; send Authorization: Bearer <admin key>.")

    async def _ready(self, request: HTTPRequest) -> Response:
        ready = self.dispatcher.ready()
        up = [a.name for a in self.actors if a.eligible(None)]
        return json_response({"ready": ready, "backends_up": up}, 200 if ready else 503)

    async def _metrics(self, request: HTTPRequest) -> Response:
        return Response(200, await self.metrics.render_async(), content_type=CONTENT_TYPE)

def tracer_for(t: TracingConfig) -> Tracer | None:
    """The span exporter ``[tracing]`` asks for; None (the default) when no
    OTLP endpoint is set, and then nothing of OpenTelemetry is imported."""
    if t.otlp_endpoint is None:
        return None
    try:
        return Tracer(endpoint=t.otlp_endpoint, sample_ratio=t.sample_ratio, respect_parent=t.respect_parent,
                      service_name=t.service_name, headers=t.headers)  # fmt: skip
    except ImportError as exc:
        raise ConfigError(f"[tracing] otlp_endpoint needs OpenTelemetry: pip install 'headrace[otel]' ({exc})") from None


def migration_settings(m: MigrationConfig) -> MigrationSettings:
    """The dispatcher's migration settings from ``[migration]``."""
    fields = msgspec.structs.asdict(m)
    if fields["stall_timeout"] == "auto":
        fields["stall_timeout"] = None
    return MigrationSettings(**fields)


def placement_of(config: RouterConfig) -> Placement | None:
    """Cost-aware placement over the backends tagged ``preemptible`` or ``pool = "batch"``; None when none is."""
    names = config.backend_names()
    tagged = [names[i] for i, spec in enumerate(config.backends) if spec.preemptible or spec.pool == "batch"]
    if not tagged:
        return None
    return Placement(tagged, interactive_avoids=config.routing.interactive_avoids_preemptible)

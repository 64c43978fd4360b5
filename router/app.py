"""The router assembled: actors, supervisor, dispatcher, metrics, HTTP app.

::

    client ─h2─> hypercorn ─> Router (ASGI)
                               ├─ /health /ready /metrics ─> ops app (no auth)
                               └─ everything else ────────> api app (auth -> Principal)
                                    OpenAIServer: RequestContext, decode once (Call)
                                    Pipeline.admit(context, call): once per request
                                    Dispatcher.stream per choice: RouteTable.plan (model routes)
                                    -> group policy.pick -> BackendActor.stream -> Backend.stream
                                    ; before the first token: next backend, next model

Both apps are :class:`~frontend.server.OpenAIServer` over the same
dispatcher; they differ in authentication, so that probes and scrapers need
no API key while every API and admin call does (when keys are configured).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import trio

from backends.base import Backend
from backends.errors import BadRequest, NotFound, Unauthorized
from frontend.context import Principal
from frontend.server import HTTPRequest, OpenAIServer, Response, json_response
from policies.base import RoutingPolicy
from policies.registry import create_policy
from router.actors import BackendActor, Supervisor
from router.config import ModelRoute, RouterConfig
from router.dispatch import Dispatcher
from router.metrics import CONTENT_TYPE, RouterMetrics, StatisticsCollector
from router.pipeline import Pipeline
from router.routes import RouteTable

__all__ = ["OPS_PATHS", "NamedBackend", "Router"]

OPS_PATHS = frozenset({"/health", "/ready", "/metrics"})


class NamedBackend(msgspec.Struct, frozen=True):
    """A backend client with the name and weight the router knows it by."""

    name: str
    backend: Backend
    weight: float = 1.0


class AdminAction(msgspec.Struct, forbid_unknown_fields=True):
    backend: str
    action: str


class AdminWeight(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    weight: float


class AdminWeights(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /admin/models``: new weights for some versions of a split."""

    model: str
    versions: list[AdminWeight]


class Router:
    """One router: call :meth:`run` in a nursery, serve ``router`` as ASGI."""

    def __init__(
        self,
        config: RouterConfig,
        backends: Sequence[NamedBackend],
        *,
        policy: RoutingPolicy | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """``policy`` serves the models no ``[[models]]`` route names (default:
        ``[routing]``'s); each route's group gets its own instance. ``clock``
        is the router's time (cool-downs); tests pass a fake one."""
        self.config = config
        h = config.health
        self.actors = [
            BackendActor(
                b.name,
                b.backend,
                weight=b.weight,
                probe_interval=h.interval,
                probe_timeout=h.timeout,
                unhealthy_threshold=h.unhealthy_threshold,
            )
            for b in backends
        ]
        self.metrics = RouterMetrics()
        r = config.routing
        default = policy if policy is not None else create_policy(r.policy, options=r.options)
        self.dispatcher = Dispatcher(
            self.actors,
            default,
            routes=RouteTable(config.models, default, self._route_policy),
            max_attempts=r.max_attempts,
            retry_after=r.retry_after,
            cooldown=r.cooldown,
            max_cooldown=r.max_cooldown,
            recorder=self.metrics,
            clock=clock,
        )
        self.metrics.add_collector(
            StatisticsCollector(lambda: [a.statistics() for a in self.actors], self.dispatcher.statistics)
        )
        self.pipeline = Pipeline()
        self.supervisor = Supervisor(self.actors, backoff=h.restart_backoff, backoff_max=h.restart_backoff_max)
        limit = config.server.max_body_bytes
        self.api = OpenAIServer(
            self.dispatcher,
            extra_routes={
                ("GET", "/admin/backends"): self._list_backends,
                ("POST", "/admin/backends"): self._admin,
                ("GET", "/admin/models"): self._list_models,
                ("POST", "/admin/models"): self._admin_models,
            },
            authenticate=self._authenticate if config.auth.keys else None,
            max_body_bytes=limit,
            observe=self.metrics.observe,
            gate=self.pipeline,
            coalesce=True,
        )
        self.ops = OpenAIServer(
            self.dispatcher,
            extra_routes={("GET", "/ready"): self._ready, ("GET", "/metrics"): self._metrics},
            max_body_bytes=limit,
            observe=self.metrics.observe,
        )

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until cancelled, then close every backend client."""
        try:
            await self.supervisor.run(task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.dispatcher.aclose()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        app = self.ops if scope.get("path") in OPS_PATHS else self.api
        await app(scope, receive, send)

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

    def _authenticate(self, headers: dict[str, str]) -> Principal:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key:
            for known, tenant in self.config.auth.keys.items():
                if hmac.compare_digest(known.encode(), key.strip().encode()):
                    # The key's id: a digest prefix, safe to log and label.
                    return Principal(tenant, hashlib.sha256(known.encode()).hexdigest()[:12])
        raise Unauthorized("Incorrect or missing API key; send Authorization: Bearer <key>.")

    async def _ready(self, request: HTTPRequest) -> Response:
        ready = self.dispatcher.ready()
        up = [a.name for a in self.actors if a.eligible(None)]
        return json_response({"ready": ready, "backends_up": up}, 200 if ready else 503)

    async def _metrics(self, request: HTTPRequest) -> Response:
        return Response(200, self.metrics.render(), content_type=CONTENT_TYPE)

    async def _list_backends(self, request: HTTPRequest) -> Response:
        data = [msgspec.to_builtins(a.statistics()) for a in self.actors]
        return json_response({"object": "list", "data": data})

    async def _admin(self, request: HTTPRequest) -> Response:
        """``{"backend": name, "action": "drain" | "undrain"}``."""
        try:
            action = msgspec.json.decode(request.body, type=AdminAction)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"expected {{\"backend\": name, \"action\": \"drain\"|\"undrain\"}}: {exc}") from None
        actor = self.actor(action.backend)
        if action.action == "drain":
            actor.drain()
        elif action.action == "undrain":
            actor.undrain()
        else:
            raise BadRequest(f"unknown action {action.action!r}; use drain or undrain", param="action")
        return json_response(msgspec.to_builtins(actor.statistics()))

    async def _list_models(self, request: HTTPRequest) -> Response:
        """Every split's versions: weight and counters."""
        data = [msgspec.to_builtins(v) for v in self.dispatcher.routes.statistics()]
        return json_response({"object": "list", "data": data})

    async def _admin_models(self, request: HTTPRequest) -> Response:
        """``{"model": split, "versions": [{"model": version, "weight": w}]}``:
        new weights for the requests planned from now on; streams in flight
        keep their version."""
        try:
            change = msgspec.json.decode(request.body, type=AdminWeights)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"expected {{\"model\": name, \"versions\": [{{\"model\": name, \"weight\": w}}]}}: {exc}") from None
        weights = {v.model: v.weight for v in change.versions}
        data = self.dispatcher.routes.set_weights(change.model, weights)
        return json_response({"object": "list", "data": [msgspec.to_builtins(v) for v in data]})

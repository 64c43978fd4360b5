"""The router assembled: actors, supervisor, dispatcher, metrics, HTTP app.

::

    client ─h2─> hypercorn ─> Router (ASGI)
                               ├─ /health /ready /metrics ─> ops app (no auth)
                               └─ everything else ────────> api app (auth -> Principal)
                                    OpenAIServer: RequestContext, decode once (Call)
                                    Pipeline.admit(context, call): once per request
                                    Dispatcher.stream per choice: policy.pick -> BackendActor.stream
                                    -> Backend.stream ; retry before first token

Both apps are :class:`~frontend.server.OpenAIServer` over the same
dispatcher; they differ in authentication, so that probes and scrapers need
no API key while every API and admin call does (when keys are configured).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
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
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.metrics import CONTENT_TYPE, RouterMetrics, StatisticsCollector
from router.pipeline import Pipeline

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


class Router:
    """One router: call :meth:`run` in a nursery, serve ``router`` as ASGI."""

    def __init__(
        self,
        config: RouterConfig,
        backends: Sequence[NamedBackend],
        *,
        policy: RoutingPolicy | None = None,
    ) -> None:
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
        self.dispatcher = Dispatcher(
            self.actors,
            policy if policy is not None else create_policy(config.routing.policy, options=config.routing.options),
            max_attempts=config.routing.max_attempts,
            retry_after=config.routing.retry_after,
            recorder=self.metrics,
        )
        self.metrics.add_collector(
            StatisticsCollector(lambda: [a.statistics() for a in self.actors], self.dispatcher.statistics)
        )
        self.pipeline = Pipeline()
        self.supervisor = Supervisor(self.actors, backoff=h.restart_backoff, backoff_max=h.restart_backoff_max)
        limit = config.server.max_body_bytes
        self.api = OpenAIServer(
            self.dispatcher,
            extra_routes={("GET", "/admin/backends"): self._list_backends, ("POST", "/admin/backends"): self._admin},
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


"""The admin API, served on the admin listener only (router/app.py): the
backends at runtime, model weights, what policies are active, the
latency breakdown.

::

    GET    /admin/backends                  every backend's statistics (and its breaker's)
    POST   /admin/backends                  {"action": "add", "url", "name"?, "kind"?, "weight"?,
                                             "max_concurrency"?, "model"?, "options"?}
                                            {"action": "drain" | "undrain" | "remove", "backend": name}
    POST   /admin/backends/{name}/drain     no new streams; those in flight finish
    POST   /admin/backends/{name}/undrain
    DELETE /admin/backends/{name}           drain, then remove once its streams are done
    GET    /admin/models  POST /admin/models    split routes' versions and their weights
    GET    /admin/routing                   routing policy instances, their groups and statistics
    GET    /admin/policies                  the policy of every extension point, per model group, with its options
    GET    /admin/breakdown                 the latency breakdown per backend (``headrace top``)
    GET    /admin/memory                    the router process's memory: resident, C heap in use and free,
                                            Python's allocated blocks, the heap trimmer's trims

A backend added at runtime is built as one from ``[[backends]]`` would be
(router/factory.py: the same validation, a 400 naming what is wrong), gets
an actor of its own under the supervisor (probed at once; it takes requests
when its first probe says it is up), and joins every model group that lists
no backends by name (configured groups are the config's). Removing one
drains it first: the answer is 202 ``"removing"`` while streams are in flight,
and it leaves the router (actor closed, client closed, out of /metrics) when
the last ends; the last backend cannot be removed (a router with none would
stop). Runtime changes are not written back to the config file.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import trio

from backends.errors import BadRequest, ClientError
from frontend.heap import heap_bytes, resident_bytes
from frontend.server import Handler, HTTPRequest, Response, json_response
from router.actors import BackendActor
from router.config import BackendSpec, ConfigError

if TYPE_CHECKING:
    from router.app import Router

__all__ = ["AdminAPI", "BackendConflict"]

log = logging.getLogger(__name__)


class BackendConflict(ClientError):
    status = 409
    code = "backend_conflict"


class AdminAction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/backends``: an action on one backend, or a new one."""

    action: Literal["add", "drain", "undrain", "remove"]
    backend: str | None = None  # drain / undrain / remove: its name
    # add: as a [[backends]] entry
    url: str | None = None
    name: str | None = None
    kind: Literal["openai", "engine", "mock"] = "openai"
    weight: float = 1.0
    max_concurrency: int | None = None
    model: str | None = None
    options: dict[str, Any] = {}


class AdminWeight(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    weight: float


class AdminWeights(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /admin/models``: new weights for some versions of a split."""

    model: str
    versions: list[AdminWeight]


class AdminAPI:
    """The admin handlers over one router."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.removing: set[str] = set()  # drained, to leave once their streams end

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("GET", "/admin/backends"): self.list_backends,
            ("POST", "/admin/backends"): self.backends_action,
            ("POST", "/admin/backends/{name}/drain"): self.drain,
            ("POST", "/admin/backends/{name}/undrain"): self.undrain,
            ("DELETE", "/admin/backends/{name}"): self.remove,
            ("GET", "/admin/models"): self.list_models,
            ("POST", "/admin/models"): self.set_weights,
            ("GET", "/admin/routing"): self.list_routing,
            ("GET", "/admin/policies"): self.list_policies,
            ("GET", "/admin/breakdown"): self.breakdown,
            ("GET", "/admin/memory"): self.memory,
        }

    # ------------------------------------------------------------ backends

    async def list_backends(self, request: HTTPRequest) -> Response:
        """Each backend's statistics, with its breaker's (``breaker``: null without breakers)."""
        d = self.router.dispatcher
        breakers = {b.name: msgspec.to_builtins(b) for b in d.statistics().breakers}
        data = [{**msgspec.to_builtins(s), "breaker": breakers.get(s.name), "removing": s.name in self.removing}
                for s in d.backend_statistics()]  # fmt: skip
        return json_response({"object": "list", "data": data})

    async def backends_action(self, request: HTTPRequest) -> Response:
        try:
            action = msgspec.json.decode(request.body, type=AdminAction)
        except msgspec.DecodeError as exc:
            raise BadRequest(
                f'expected {{"action": "drain"|"undrain"|"remove", "backend": name}} or {{"action": "add", "url": ...}}: {exc}'
            ) from None
        if action.action == "add":
            return await self._add(action)
        if action.backend is None:
            raise BadRequest(f"{action.action} needs the backend's name", param="backend")
        if action.action == "remove":
            return await self._remove(action.backend)
        actor = self.router.actor(action.backend)
        if action.action == "drain":
            actor.drain()
        else:
            self._undrain(actor)
        return json_response(msgspec.to_builtins(actor.statistics()))

    async def drain(self, request: HTTPRequest) -> Response:
        actor = self.router.actor(request.params["name"])
        actor.drain()
        return json_response(msgspec.to_builtins(actor.statistics()))

    async def undrain(self, request: HTTPRequest) -> Response:
        actor = self.router.actor(request.params["name"])
        self._undrain(actor)
        return json_response(msgspec.to_builtins(actor.statistics()))

    async def remove(self, request: HTTPRequest) -> Response:
        return await self._remove(request.params["name"])

    def _undrain(self, actor: BackendActor) -> None:
        if actor.name in self.removing:
            raise BackendConflict(f"backend {actor.name!r} is being removed", param="backend")
        actor.undrain()

    async def _add(self, action: AdminAction) -> Response:
        from router.app import NamedBackend
        from router.factory import build_backend

        r = self.router
        if action.url is None and action.kind != "mock":
            raise BadRequest("add needs the backend's url", param="url")
        name = action.name or f"{action.kind}-{len(r.actors)}"
        if any(a.name == name for a in r.actors):
            raise BackendConflict(f"a backend named {name!r} exists", param="name")
        try:
            spec = msgspec.convert(
                {k: v for k, v in msgspec.structs.asdict(action).items() if k not in ("action", "backend") and v is not None},
                BackendSpec,
            )
            backend = build_backend(spec, name)
        except (msgspec.ValidationError, ConfigError) as exc:
            raise BadRequest(f"invalid backend: {exc}") from None
        actor = r.new_actor(NamedBackend(name, backend, spec.weight), spec.max_concurrency)
        await r.add_actor(actor)
        log.info("backend %s added at runtime (%s)", name, spec.url or spec.kind)
        return json_response(msgspec.to_builtins(actor.statistics()), 201)

    async def _remove(self, name: str) -> Response:
        r = self.router
        actor = r.actor(name)
        if len(r.actors) == 1:
            raise BackendConflict(f"backend {name!r} is the router's last", param="backend")
        actor.drain()
        if actor.in_flight == 0:
            await r.remove_actor(actor)
            return json_response({"backend": name, "state": "removed"})
        if name not in self.removing:
            self.removing.add(name)
            r.spawn(self._remove_when_idle, actor)
        return json_response({"backend": name, "state": "removing", "in_flight": actor.in_flight}, 202)

    async def _remove_when_idle(self, actor: BackendActor) -> None:
        try:
            await actor.wait_idle()
            await self.router.remove_actor(actor)
        finally:
            self.removing.discard(actor.name)

    # ------------------------------------------------------------ models, routing, policies

    async def list_models(self, request: HTTPRequest) -> Response:
        """Every split's versions: weight and counters."""
        data = [msgspec.to_builtins(v) for v in self.router.dispatcher.routes.statistics()]
        return json_response({"object": "list", "data": data})

    async def set_weights(self, request: HTTPRequest) -> Response:
        """``{"model": split, "versions": [{"model": version, "weight": w}]}``:
        new weights for the requests planned from now on; streams in flight
        keep their version."""
        try:
            change = msgspec.json.decode(request.body, type=AdminWeights)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"expected {{\"model\": name, \"versions\": [{{\"model\": name, \"weight\": w}}]}}: {exc}") from None
        weights = {v.model: v.weight for v in change.versions}
        data = self.router.dispatcher.routes.set_weights(change.model, weights)
        return json_response({"object": "list", "data": [msgspec.to_builtins(v) for v in data]})

    async def list_routing(self, request: HTTPRequest) -> Response:
        """Each routing policy instance, its backend group, and its
        statistics when it keeps any (kv_aware: hits, predictions checked
        against what backends reported, its index); and the prefix keys'."""
        data = []
        for policy, group in self.router.dispatcher.routes.policies():
            stats = getattr(policy, "statistics", None)
            data.append({
                "policy": getattr(policy, "name", type(policy).__name__),
                "backends": list(group) if group is not None else None,
                "statistics": msgspec.to_builtins(stats()) if stats is not None else None,
            })
        return json_response({"object": "list", "data": data, "keys": msgspec.to_builtins(self.router.keys.statistics())})

    async def list_policies(self, request: HTTPRequest) -> Response:
        """What decides at each extension point: routing per model group
        (a route's own policy and options, or ``[routing]``'s), admission,
        priority, rate limits, breakers, with their options; and the retry
        budget, migration and tracing settings."""
        c = self.router.config
        r = c.routing
        groups = [{
            "model": route.name, "aliases": list(route.aliases),
            "policy": route.policy or r.policy, "options": route.options if route.policy is not None else r.options,
            "backends": list(route.backends) if route.backends is not None else None,
            "versions": [msgspec.to_builtins(v) for v in route.versions],
            "fallbacks": list(route.fallbacks),
        } for route in c.models]  # fmt: skip
        a = c.admission
        return json_response({
            "routing": {"default": {"policy": r.policy, "options": r.options, "max_attempts": r.max_attempts}, "groups": groups},
            "admission": {"enabled": a.enabled, "policy": a.policy, "options": a.options,
                          "backend_concurrency": a.backend_concurrency, "learn_concurrency": a.learn_concurrency},
            "priority": {"policy": c.priority.policy, "options": c.priority.options},
            "ratelimit": {"policy": c.ratelimit.policy, "options": c.ratelimit.options, "shared": c.ratelimit.url is not None},
            "breaker": {"enabled": c.breaker.enabled, "policy": c.breaker.policy, "options": c.breaker.options},
            "retry": msgspec.to_builtins(c.retry),
            "migration": msgspec.to_builtins(c.migration),
            "tracing": {"export": c.tracing.otlp_endpoint is not None, "sample_ratio": c.tracing.sample_ratio},
        })  # fmt: skip

    async def breakdown(self, request: HTTPRequest) -> Response:
        """The latency breakdown per backend (router/breakdown.py): what ``headrace top`` shows."""
        in_flight = {a.name: a.in_flight for a in self.router.actors}
        return json_response(self.router.breakdown.snapshot(trio.current_time(), in_flight))

    async def memory(self, request: HTTPRequest) -> Response:
        """Where the process's memory is (frontend/heap.py): why RSS is what it is.
        A leak grows ``heap_in_use_bytes`` or ``python_blocks``; memory freed but
        not yet handed back shows as ``heap_free_bytes``. Null where not glibc."""
        trimmer = self.router.heap_trimmer.statistics()
        in_use, free = heap_bytes() or (None, None)
        return json_response({
            "resident_bytes": resident_bytes(), "heap_in_use_bytes": in_use,
            "heap_free_bytes": free, "python_blocks": sys.getallocatedblocks(),
            "trims": trimmer.trims, "trimmed_bytes": trimmer.released_bytes,
        })  # fmt: skip

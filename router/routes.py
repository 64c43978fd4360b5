"""Model routes at run time: a requested model name -> the chain of routes it tries.

::

    [[models]] (router.config.ModelRoute)  ──RouteTable(...)──>  one Target per served route
                                                                  (its group, its own policy)
    request ──> RouteTable.plan(request) ──> Plan: [Target, Target, ...] in the order to try
                  a split (versions): picks one version, sticky per conversation
                  a served route: its Target
                  then the route's fallbacks, depth first; each Target once

A model that no route names is served as before the routes existed: one
Target of that name on every backend that lists it, with the default policy.

Splits (canaries) pick by *weighted rendezvous hashing*: every version scores
``weight / -ln(u)``, ``u`` a blake2b hash of (split, version, conversation key)
mapped into (0, 1), and the highest score wins. A version wins with
probability ``weight / sum(weights)``; the key is the conversation's first
messages (:func:`conversation_key`), so every turn of one conversation, in
any router process, lands on the same version; and changing one version's
weight moves only conversations onto it (raised) or off it (lowered), never
between two other versions. Weights change at run time
(:meth:`RouteTable.set_weights`, ``POST /admin/models``); a stream in flight
keeps the Target it has.

Nothing here does I/O or reads a clock: the dispatcher asks, this answers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence

import msgspec

from backends.base import ChatMessage, GenerateRequest
from backends.errors import BadRequest, NotFound
from policies.base import RoutingPolicy
from router.config import ModelRoute
from router.migration import Settings as MigrationSettings

__all__ = ["KEY_CHARS", "Plan", "RouteTable", "Target", "VersionStatistics", "conversation_key", "pick_version"]

KEY_CHARS = 256  # characters of each leading message (or of the prompt) in a conversation's key


class Target:
    """One served route: what a backend is asked for, and by which group."""

    __slots__ = ("backends", "migration", "name", "policy", "upstream")

    def __init__(
        self,
        name: str | None,
        upstream: str | None,
        policy: RoutingPolicy,
        backends: tuple[str, ...] | None = None,
        migration: MigrationSettings | None = None,
    ) -> None:
        self.name = name  # the public name: the response's ``model``
        self.upstream = upstream  # the model named in the backend request
        self.policy = policy  # this group's own instance
        # The group, trusted to serve ``upstream`` whatever it lists; None:
        # every backend that lists ``upstream`` (or lists nothing).
        self.backends = backends
        # How its streams are watched and migrated; None: the router's [migration].
        self.migration = migration

    def __repr__(self) -> str:
        return f"Target({self.name!r} -> {self.upstream!r} on {self.backends or 'any'})"


class VersionStatistics(msgspec.Struct, frozen=True, kw_only=True):
    route: str  # the split's public name
    version: str  # the version's route name
    weight: float
    requests: int  # requests whose own model went through this version (fallbacks not counted)
    failed: int  # of those, ended by an error (before or after the first token)


class _Version:
    __slots__ = ("failed", "name", "requests", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name, self.weight = name, weight
        self.requests = 0
        self.failed = 0


class _Route:
    """A configured route, resolved: a Target, or a split's versions."""

    __slots__ = ("fallbacks", "name", "target", "versions")

    def __init__(self, name: str, target: Target | None, versions: list[_Version], fallbacks: tuple[str, ...]) -> None:
        self.name, self.target, self.versions, self.fallbacks = name, target, versions, fallbacks


class Plan:
    """One request's chain: the Targets to try, in order, and the split
    versions its own model went through (their counters)."""

    __slots__ = ("picked", "targets")

    def __init__(self, targets: list[Target], picked: list[_Version]) -> None:
        self.targets, self.picked = targets, picked

    def failed(self) -> None:
        for version in self.picked:
            version.failed += 1


def conversation_key(request: GenerateRequest) -> bytes:
    """What stays the same across the turns of one conversation: the
    messages up to and including the first user message (each cut to
    :data:`KEY_CHARS`), else the prompt's first characters, else its first
    token ids. Text before ids: a resumed request keeps its original text."""
    if request.messages:
        parts: list[str] = []
        for message in request.messages:
            parts.append(f"{message.role}\x1f{_text(message)[:KEY_CHARS]}")
            if message.role == "user":
                break
        return "\x1e".join(parts).encode()
    if request.prompt:
        return request.prompt[:KEY_CHARS].encode()
    if request.prompt_token_ids:
        return ",".join(map(str, request.prompt_token_ids[:KEY_CHARS])).encode()
    return b""


def _text(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _score(split: str, version: str, weight: float, key: bytes) -> float:
    if weight <= 0:
        return -1.0
    digest = hashlib.blake2b(f"{split}\x1f{version}\x1e".encode() + key, digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / 2.0**64  # uniform in (0, 1)
    return weight / -math.log(u)


def pick_version(split: str, versions: Sequence[tuple[str, float]], key: bytes) -> int:
    """The index of the version ``key`` goes to (weighted rendezvous; ties:
    the earlier version). Stable across processes: blake2b, not ``hash()``."""
    scores = [_score(split, name, weight, key) for name, weight in versions]
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


class RouteTable:
    """The configured routes, with a Target (and a policy instance) per
    served route; ``make_policy(route)`` builds each group's policy and
    ``default`` serves the models no route names."""

    def __init__(
        self,
        routes: Sequence[ModelRoute],
        default: RoutingPolicy,
        make_policy: Callable[[ModelRoute], RoutingPolicy] | None = None,
        migration: MigrationSettings | None = None,
    ) -> None:
        """``migration``: the router's [migration] settings, which a route's
        own timeouts and migration limit override."""
        self.default = default
        self._routes: dict[str, _Route] = {}
        self._names: dict[str, str] = {}  # public name or alias -> route name
        for route in routes:
            self._names.update(dict.fromkeys((route.name, *route.aliases), route.name))
        for route in routes:
            target = None
            if not route.versions:
                policy = make_policy(route) if make_policy is not None else default
                target = Target(
                    route.name, route.upstream_model or route.name, policy, route.backends, _migration(route, migration)
                )
            versions = [_Version(self._names[v.model], v.weight) for v in route.versions]
            fallbacks = tuple(self._names[f] for f in route.fallbacks)
            self._routes[route.name] = _Route(route.name, target, versions, fallbacks)

    def public_names(self) -> tuple[str, ...]:
        """Every configured name and alias, in config order."""
        return tuple(self._names)

    def policies(self) -> list[tuple[RoutingPolicy, tuple[str, ...] | None]]:
        """Each distinct policy instance and its group (None: any backend),
        for whoever feeds policies what backends report (KV events)."""
        seen: dict[int, tuple[RoutingPolicy, tuple[str, ...] | None]] = {id(self.default): (self.default, None)}
        for route in self._routes.values():
            if route.target is not None:
                seen.setdefault(id(route.target.policy), (route.target.policy, route.target.backends))
        return list(seen.values())

    def groups(self) -> list[tuple[str, ...]]:
        """Each served route's configured backends (routes that name none
        are left out: their group is whoever lists the model)."""
        found = (r.target.backends for r in self._routes.values() if r.target is not None)
        return list(dict.fromkeys(b for b in found if b))

    def plan(self, request: GenerateRequest) -> Plan:
        """The Targets ``request`` tries, in order."""
        model = request.model
        name = self._names.get(model) if model else None
        if name is None:  # not a configured route: as before routes existed
            return Plan([Target(model, model, self.default)], [])
        targets: dict[str, Target] = {}
        picked: list[_Version] = []
        self._expand(name, _Key(request), targets, picked)
        return Plan(list(targets.values()), picked)

    def _expand(self, name: str, key: _Key, out: dict[str, Target], picked: list[_Version]) -> None:
        route = self._routes[name]
        if route.target is not None:
            out.setdefault(route.name, route.target)
        else:
            versions = route.versions
            version = versions[pick_version(route.name, [(v.name, v.weight) for v in versions], key.value)]
            if not out:  # the request's own model goes through it (not a fallback)
                version.requests += 1
                picked.append(version)
            self._expand(version.name, key, out, picked)
        for fallback in route.fallbacks:
            self._expand(fallback, key, out, picked)

    def set_weights(self, model: str, weights: Mapping[str, float]) -> list[VersionStatistics]:
        """Change split weights (versions not named keep theirs). Requests
        planned from now on use them; streams in flight keep their Target."""
        name = self._names.get(model)
        route = self._routes.get(name) if name is not None else None
        if route is None:
            raise NotFound(f"no model route named {model!r}", param="model")
        if not route.versions:
            raise BadRequest(f"model {model!r} has no versions to weigh", param="model")
        by_name = {v.name: v for v in route.versions}
        new = {v.name: v.weight for v in route.versions}
        for version, weight in weights.items():
            canonical = self._names.get(version, version)
            if canonical not in by_name:
                raise BadRequest(f"{version!r} is not a version of {route.name!r} (versions: {', '.join(by_name)})", param="versions")
            if not weight >= 0 or math.isinf(weight):
                raise BadRequest(f"version {version!r}: a weight is a finite number >= 0", param="versions")
            new[canonical] = weight
        if sum(new.values()) <= 0:
            raise BadRequest(f"the weights of {route.name!r} would sum to 0", param="versions")
        for version_name, weight in new.items():
            by_name[version_name].weight = weight
        return [s for s in self.statistics() if s.route == route.name]

    def statistics(self) -> list[VersionStatistics]:
        return [
            VersionStatistics(route=r.name, version=v.name, weight=v.weight, requests=v.requests, failed=v.failed)
            for r in self._routes.values()
            for v in r.versions
        ]


def _migration(route: ModelRoute, base: MigrationSettings | None) -> MigrationSettings | None:
    """The route's migration settings: the router's, with what the route sets."""
    own = {
        name: getattr(route, name)
        for name in ("stall_timeout", "first_token_timeout", "max_migrations", "text_continuation", "standby_tokens")
        if getattr(route, name) is not None
    }
    if not own:
        return None
    return msgspec.structs.replace(base or MigrationSettings(), **own)


class _Key:
    """A conversation's key, computed the first time a split needs it."""

    __slots__ = ("_request", "_value")

    def __init__(self, request: GenerateRequest) -> None:
        self._request = request
        self._value: bytes | None = None

    @property
    def value(self) -> bytes:
        if self._value is None:
            self._value = conversation_key(self._request)
        return self._value

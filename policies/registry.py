"""Find policies by kind and name, with options: built-ins and plugins through one table.

Each extension point is a *kind* (:data:`KINDS`: routing, admission,
priority, rate limiting and circuit breaking), with the protocol an instance
must satisfy. Config names a
policy of a kind and gives its options, which reach the factory as keyword
arguments::

    [routing]                         create("routing", "prefix_hash", {"replicas": 2})
    policy = "prefix_hash"     ──>    -> factory(replicas=2), then checked: has pick()
    [routing.options]
    replicas = 2

Plugins register an entry point in the group ``headrace.policies.<kind>``
(``headrace.policies.routing``, ...) whose value is a factory, usually the
class. The plain group ``headrace.policies`` still means routing, so plugins
registered before kinds existed keep working. Built-ins are declared in
pyproject.toml too and are also known here directly (:data:`BUILTINS`), so a
source checkout that was never installed still finds them.

Options: a factory with an ``Options`` attribute that is a msgspec Struct
gets the options converted into it (``factory(Options(...))``); any other
factory is called with them as keyword arguments, after a check that it
accepts each name. Either way an option the policy rejects (an unknown name, a
TypeError, a msgspec ValidationError) is a :class:`PolicyError` naming the
policy and the option.

Discovery is sorted by name; a plugin that fails to import, or two packages
claiming one name within a kind, raises :class:`PolicyError` naming the
package at fault (as flake8's plugin finder does), instead of a bare
ImportError deep in startup.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from policies.admission import AdmissionPolicy, BoundedQueue, ErlangShedding
from policies.base import RoutingPolicy
from policies.breaker import BreakerPolicy, Breakers
from policies.fairness import FairQueue, QueuePolicy
from policies.kv_aware import KVAware
from policies.prefix_hash import PrefixHash
from policies.ratelimit import RateLimitPolicy, TokenBuckets
from policies.routing import LeastLoaded, PowerOfTwo, RoundRobin
from policies.shared_limits import SharedBuckets, SharedRateLimitPolicy

__all__ = [
    "BUILTINS",
    "GROUP",
    "KINDS",
    "LEGACY_GROUPS",
    "Kind",
    "PolicyError",
    "PolicyInfo",
    "available",
    "create",
    "create_policy",
    "group",
    "installed",
    "load_factory",
]

GROUP = "headrace.policies"

PolicyFactory = Callable[..., Any]
EntryPoints = Iterable[importlib.metadata.EntryPoint]


class Kind(NamedTuple):
    """One extension point. ``protocol`` is what an instance must satisfy
    (a runtime-checkable Protocol); ``None`` while the kind's interface has
    not landed, in which case any object is accepted."""

    name: str
    protocol: type | tuple[type, ...] | None  # a tuple: any one of them
    requires: str  # the protocol as an error message names it
    summary: str


# Adding a kind is a line here (and its config section where it is used).
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("routing", RoutingPolicy, "pick(candidates, request, now)", "picks a backend for each request"),
        Kind("admission", AdmissionPolicy, "decide(view, now)", "admits, queues or sheds a request (503 + Retry-After)"),
        Kind("priority", QueuePolicy, "push, pop, remove, charge, depth",
             "orders waiting requests (priority, tenant share)"),
        Kind("ratelimit", (RateLimitPolicy, SharedRateLimitPolicy),
             "acquire, charge, release (or, shared: acquire_call, acquire_result, settle_call)",
             "limits a tenant's request and token rates (429 + Retry-After)"),
        Kind("breaker", BreakerPolicy, "allows, dispatched, record, state", "opens a backend's circuit after failures"),
    )
}

# Groups from before kinds, and the kind they mean.
LEGACY_GROUPS: dict[str, str] = {GROUP: "routing"}

BUILTINS: dict[str, dict[str, tuple[str, PolicyFactory]]] = {
    "routing": {
        "kv_aware": ("policies.kv_aware:KVAware", KVAware),
        "least_loaded": ("policies.routing:LeastLoaded", LeastLoaded),
        "power_of_two": ("policies.routing:PowerOfTwo", PowerOfTwo),
        "prefix_hash": ("policies.prefix_hash:PrefixHash", PrefixHash),
        "round_robin": ("policies.routing:RoundRobin", RoundRobin),
    },
    "admission": {
        "bounded": ("policies.admission:BoundedQueue", BoundedQueue),
        "erlang": ("policies.admission:ErlangShedding", ErlangShedding),
    },
    "priority": {"fair_queue": ("policies.fairness:FairQueue", FairQueue)},
    "ratelimit": {
        "memory": ("policies.ratelimit:TokenBuckets", TokenBuckets),
        "redis": ("policies.shared_limits:SharedBuckets", SharedBuckets),
    },
    "breaker": {"standard": ("policies.breaker:Breakers", Breakers)},
}

BUILTIN_PACKAGE = "headrace"


class PolicyError(Exception):
    """A policy name that does not resolve, options it rejects, or a plugin that is broken."""


class PolicyInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One installed policy, as ``headrace policies`` lists it."""

    kind: str
    name: str
    package: str
    value: str  # module:attribute
    builtin: bool
    summary: str = ""  # the first line of the factory's docstring


def summary(factory: object) -> str:
    """A policy's one-line description: its factory's docstring, first line."""
    doc = inspect.getdoc(factory) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def group(kind: str) -> str:
    """The entry-point group of ``kind``."""
    return f"{GROUP}.{_kind(kind).name}"


def _kind(kind: str) -> Kind:
    found = KINDS.get(kind)
    if found is None:
        raise PolicyError(f"unknown policy kind {kind!r}; known: {', '.join(KINDS)}")
    return found


def _package(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return dist.name if dist is not None else ep.value.split(":", 1)[0].split(".", 1)[0]


def _entry_points(kind: str, entry_points: EntryPoints | None) -> list[importlib.metadata.EntryPoint]:
    groups = {group(kind), *(g for g, k in LEGACY_GROUPS.items() if k == kind)}
    if entry_points is None:
        everything = importlib.metadata.entry_points()
        return [ep for g in sorted(groups) for ep in everything.select(group=g)]
    return [ep for ep in entry_points if ep.group in groups]


def _discover(kind: str, entry_points: EntryPoints | None) -> dict[str, importlib.metadata.EntryPoint]:
    builtins = BUILTINS.get(kind, {})
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in sorted(_entry_points(kind, entry_points), key=lambda e: (e.name, e.value)):
        builtin = builtins.get(ep.name)
        if builtin is not None and builtin[0] == ep.value:
            continue  # the built-in's own declaration
        if ep.name in found and found[ep.name].value == ep.value:
            continue  # one declaration seen twice (legacy and kind group, or a path listed twice)
        if builtin is not None or ep.name in found:
            other = f"{BUILTIN_PACKAGE} (built-in)" if builtin is not None else _package(found[ep.name])
            raise PolicyError(f"{kind} policy {ep.name!r} is registered twice: by {other} and by {_package(ep)}")
        found[ep.name] = ep
    return found


def _names(kind: str, plugins: Mapping[str, importlib.metadata.EntryPoint]) -> list[str]:
    return sorted({*BUILTINS.get(kind, {}), *plugins})


def available(entry_points: EntryPoints | None = None, *, kind: str = "routing") -> list[str]:
    """Every known policy name of ``kind``, sorted."""
    return _names(kind, _discover(kind, entry_points))


def installed(entry_points: EntryPoints | None = None) -> list[PolicyInfo]:
    """Every known policy of every kind (kinds in :data:`KINDS` order, names
    sorted), with the package that provides it and its one-line summary
    (read from the factory, so plugins are imported; one that fails to
    import says so in its summary instead of hiding the others)."""
    rows: list[PolicyInfo] = []
    for kind in KINDS:
        builtins = BUILTINS.get(kind, {})
        plugins = _discover(kind, entry_points)
        for name in _names(kind, plugins):
            if name in builtins:
                value, factory = builtins[name]
                rows.append(PolicyInfo(kind=kind, name=name, package=BUILTIN_PACKAGE, value=value, builtin=True,
                                       summary=summary(factory)))
            else:
                ep = plugins[name]
                try:
                    text = summary(ep.load())
                except Exception as exc:
                    text = f"(fails to load: {exc!r})"
                rows.append(PolicyInfo(kind=kind, name=name, package=_package(ep), value=ep.value, builtin=False,
                                       summary=text))
    return rows


def load_factory(name: str, entry_points: EntryPoints | None = None, *, kind: str = "routing") -> PolicyFactory:
    """The factory registered under ``name`` for ``kind``."""
    builtin = BUILTINS.get(kind, {}).get(name)
    plugins = _discover(kind, entry_points)
    if builtin is not None:
        return builtin[1]
    ep = plugins.get(name)
    if ep is None:
        known = ", ".join(_names(kind, plugins)) or "none installed"
        raise PolicyError(f"unknown {kind} policy {name!r}; known: {known}")
    try:
        factory: PolicyFactory = ep.load()
    except Exception as exc:
        raise PolicyError(f"{kind} policy {name!r} from package {_package(ep)} failed to load: {exc!r}") from exc
    return factory


def create(
    kind: str,
    name: str,
    options: Mapping[str, Any] | None = None,
    *,
    entry_points: EntryPoints | None = None,
) -> Any:
    """A fresh policy of ``kind`` built with ``options``; checks it satisfies
    the kind's protocol."""
    spec = _kind(kind)
    factory = load_factory(name, entry_points, kind=kind)
    policy = _instantiate(f"{kind} policy {name!r}", factory, dict(options or {}))
    if spec.protocol is not None and not isinstance(policy, spec.protocol):
        raise PolicyError(f"{kind} policy {name!r} has no {spec.requires} method")
    return policy


def create_policy(
    name: str,
    entry_points: EntryPoints | None = None,
    *,
    options: Mapping[str, Any] | None = None,
) -> RoutingPolicy:
    """A fresh routing policy (``[routing] policy`` and ``[routing.options]``)."""
    policy: RoutingPolicy = create("routing", name, options, entry_points=entry_points)
    return policy


def _instantiate(what: str, factory: PolicyFactory, options: dict[str, Any]) -> Any:
    declared = getattr(factory, "Options", None)
    structured = isinstance(declared, type) and issubclass(declared, msgspec.Struct)
    if not structured:
        _check_names(what, factory, options)
    try:
        return factory(msgspec.convert(options, declared)) if structured else factory(**options)
    except msgspec.ValidationError as exc:
        detail = str(exc).replace("`$.", "`").replace(" - at `$`", "")
        raise PolicyError(f"{what}: bad option: {detail}") from exc
    except TypeError as exc:
        if not options:
            raise PolicyError(f"{what} failed to initialise: {exc!r}") from exc
        raise PolicyError(f"{what} rejected its options ({', '.join(sorted(options))}): {exc}") from exc
    except Exception as exc:
        raise PolicyError(f"{what} failed to initialise: {exc!r}") from exc


def _check_names(what: str, factory: PolicyFactory, options: Mapping[str, Any]) -> None:
    """An option the factory has no keyword for is named before the call
    (a TypeError from deep inside a constructor names it less clearly)."""
    if not options:
        return
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to read (a C callable): the call itself will tell
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        accepted = f"its options: {', '.join(takes)}" if takes else "it takes no options"
        raise PolicyError(f"{what} has no option {unknown[0]!r} ({accepted})")

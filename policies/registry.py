"""Find routing policies by name: built-ins and plugins through one table.

Plugins register an entry point in the group ``headrace.policies`` whose value
is a zero-argument factory (usually the class) returning a
:class:`~policies.base.RoutingPolicy`. Built-ins are declared the same way in
pyproject.toml and are also known here directly, so a source checkout that was
never installed still finds them. Discovery is sorted by name; a plugin that
fails to import, or two packages claiming one name, raises
:class:`PolicyError` naming the package at fault (as flake8's plugin finder
does), instead of a bare ImportError deep in startup.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from typing import Any

from policies.base import RoutingPolicy
from policies.routing import LeastLoaded, RoundRobin

__all__ = ["BUILTINS", "GROUP", "PolicyError", "available", "create_policy", "load_factory"]

GROUP = "headrace.policies"

PolicyFactory = Callable[[], Any]

BUILTINS: dict[str, tuple[str, PolicyFactory]] = {
    "least_loaded": ("policies.routing:LeastLoaded", LeastLoaded),
    "round_robin": ("policies.routing:RoundRobin", RoundRobin),
}


class PolicyError(Exception):
    """A policy name that does not resolve, or a plugin that is broken."""


def _package(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return dist.name if dist is not None else ep.value.split(":", 1)[0].split(".", 1)[0]


def _discover(entry_points: Iterable[importlib.metadata.EntryPoint] | None) -> dict[str, importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=GROUP) if entry_points is None else entry_points
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in sorted(eps, key=lambda e: (e.name, e.value)):
        builtin = BUILTINS.get(ep.name)
        if builtin is not None and builtin[0] == ep.value:
            continue  # the built-in's own declaration
        if builtin is not None or ep.name in found:
            other = "headrace (built-in)" if builtin is not None else _package(found[ep.name])
            raise PolicyError(f"routing policy {ep.name!r} is registered twice: by {other} and by {_package(ep)}")
        found[ep.name] = ep
    return found


def available(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> list[str]:
    """Every known policy name, sorted."""
    return sorted({*BUILTINS, *_discover(entry_points)})


def load_factory(name: str, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> PolicyFactory:
    """The factory registered under ``name``."""
    builtin = BUILTINS.get(name)
    plugins = _discover(entry_points)
    if builtin is not None:
        return builtin[1]
    ep = plugins.get(name)
    if ep is None:
        known = ", ".join(sorted({*BUILTINS, *plugins}))
        raise PolicyError(f"unknown routing policy {name!r}; known: {known}")
    try:
        factory: PolicyFactory = ep.load()
    except Exception as exc:
        raise PolicyError(f"routing policy {name!r} from package {_package(ep)} failed to load: {exc!r}") from exc
    return factory


def create_policy(name: str, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> RoutingPolicy:
    """A fresh policy instance; checks it has ``pick``."""
    factory = load_factory(name, entry_points)
    try:
        policy = factory()
    except Exception as exc:
        raise PolicyError(f"routing policy {name!r} failed to initialise: {exc!r}") from exc
    if not isinstance(policy, RoutingPolicy):
        raise PolicyError(f"routing policy {name!r} has no pick(candidates, request, now) method")
    return policy

"""Backend specs from the config -> Backend clients the actors own.

:func:`default_backends` names the local engine replicas ``headrace serve``
routes to when no backend is configured (by default two on the default
model, :data:`DEFAULT_REPLICAS`; ``[[engines]]`` says otherwise: router/engines.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from backends.base import Backend
from router.app import NamedBackend
from router.config import BackendSpec, ConfigError, RouterConfig

__all__ = ["DEFAULT_REPLICAS", "build_backend", "build_backends", "default_backends"]

DEFAULT_MODEL = "mock"


DEFAULT_REPLICAS = 2


def default_backends(urls: Sequence[str | BackendSpec]) -> tuple[BackendSpec, ...]:
    """What to route to when neither the config nor the command line names a
    backend: the local engine replicas started at ``urls`` (or their specs,
    named by router/engines.py, as they are)."""
    return tuple(u if isinstance(u, BackendSpec) else BackendSpec(url=u, kind="engine", name=f"engine-{i}") for i, u in enumerate(urls))


def build_backend(spec: BackendSpec, name: str) -> Backend:
    """One client for ``spec``; imports lazily so unused adapters cost nothing."""
    if spec.url is None:  # config validation allows this for mocks only
        from backends.mock import MockBackend, MockConfig

        unknown = sorted(set(spec.options) - set(MockConfig.__struct_fields__))
        if unknown:
            raise ConfigError(f"backend {name!r}: unknown mock options: {', '.join(unknown)}")
        fields = {"name": name, "models": (spec.model or DEFAULT_MODEL,), **spec.options}
        try:
            config = msgspec.convert(fields, MockConfig)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"backend {name!r}: invalid options: {exc}") from None
        mock: Backend = MockBackend(config)
        return mock
    from backends.openai_http import HTTPOptions, OpenAIHTTPBackend

    # headrace's engine: token ids, the tenant for its GPU-time accounting, and
    # the class's priority in its order (higher first; a plain OpenAI server: none)
    options: dict[str, object] = {"token_ids": True, "send_tenant": True, "priority": "higher_first"} if spec.kind == "engine" else {}
    if spec.model is not None:
        options["model"] = spec.model
    options.update(spec.options)
    try:
        settings = msgspec.convert(options, HTTPOptions)
        http: Backend = OpenAIHTTPBackend(spec.url, name=name, **settings.kwargs())
    except msgspec.ValidationError as exc:
        raise ConfigError(f"backend {name!r}: invalid options: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from None
    return http


def build_backends(config: RouterConfig) -> list[NamedBackend]:
    """A client for each configured backend."""
    specs = config.backends
    named = config.backend_names()
    return [NamedBackend(name, build_backend(spec, name), spec.weight) for name, spec in zip(named, specs, strict=True)]

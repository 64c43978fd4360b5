"""Backend specs from the config -> Backend clients the actors own.

:func:`default_backends` is the one place that says what ``headrace serve``
routes to when nothing is configured: today two in-process mock backends.
"""

from __future__ import annotations

import msgspec

from backends.base import Backend
from router.app import NamedBackend
from router.config import BackendSpec, ConfigError, RouterConfig

__all__ = ["build_backend", "build_backends", "default_backends"]

DEFAULT_MODEL = "mock"


def default_backends(config: RouterConfig) -> tuple[BackendSpec, ...]:
    """What to route to when neither the config nor the command line names a backend."""
    return tuple(BackendSpec(kind="mock", name=f"mock-{i}") for i in range(2))


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
    if spec.options:
        raise ConfigError(f"backend {name!r}: options are only understood by in-process mocks")
    from backends.openai_http import OpenAIHTTPBackend

    try:
        http: Backend = OpenAIHTTPBackend(spec.url, name=name, token_ids=True if spec.kind == "engine" else "auto")
    except ValueError as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from None
    return http


def build_backends(config: RouterConfig) -> list[NamedBackend]:
    """The configured backends, or :func:`default_backends` when there are none."""
    specs = config.backends or default_backends(config)
    named = RouterConfig(backends=specs).backend_names()
    return [NamedBackend(name, build_backend(spec, name), spec.weight) for name, spec in zip(named, specs, strict=True)]

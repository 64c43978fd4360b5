"""Backend specs from the config -> Backend clients the actors own.

:func:`default_backends` is the one place that says what ``headrace serve``
routes to when nothing is configured: today two in-process mock backends.
"""

from __future__ import annotations

from backends.base import Backend
from router.app import NamedBackend
from router.config import BackendSpec, RouterConfig

__all__ = ["build_backend", "build_backends", "default_backends"]

DEFAULT_MODEL = "mock"


def default_backends(config: RouterConfig) -> tuple[BackendSpec, ...]:
    """What to route to when neither the config nor the command line names a backend."""
    return tuple(BackendSpec(kind="mock", name=f"mock-{i}") for i in range(2))


def build_backend(spec: BackendSpec, name: str) -> Backend:
    """One client for ``spec``; imports lazily so unused adapters cost nothing."""
    if spec.url is None:  # config validation allows this for mocks only
        from backends.mock import MockBackend, MockConfig

        mock: Backend = MockBackend(MockConfig(name=name, models=(spec.model or DEFAULT_MODEL,)))
        return mock
    from backends.openai_http import OpenAIHTTPBackend

    http: Backend = OpenAIHTTPBackend(spec.url, name=name)
    return http


def build_backends(config: RouterConfig) -> list[NamedBackend]:
    """The configured backends, or :func:`default_backends` when there are none."""
    specs = config.backends or default_backends(config)
    named = RouterConfig(backends=specs).backend_names()
    return [NamedBackend(name, build_backend(spec, name), spec.weight) for name, spec in zip(named, specs, strict=True)]

"""The Trio edge router: actors per backend, a dispatcher that routes through
a policy, Prometheus metrics, and ``headrace serve``."""

from __future__ import annotations

from router.actors import ActorStatistics, BackendActor, Supervisor
from router.app import KVFanOut, NamedBackend, Router
from router.config import (
    AuthConfig,
    BackendSpec,
    ConfigError,
    HealthConfig,
    ModelRoute,
    ModelVersion,
    RouterConfig,
    RoutingConfig,
    ServerConfig,
    decode_config,
    load_config,
    with_overrides,
)
from router.dispatch import Dispatcher, DispatchStatistics, Progress, Recorder
from router.factory import build_backend, build_backends, default_backends
from router.health import HealthEvent, HealthState, LifecycleError
from router.metrics import RouterMetrics
from router.prefix_keys import PrefixKeys, PromptKeys
from router.routes import RouteTable
from router.server import run_router

__all__ = [
    "ActorStatistics",
    "AuthConfig",
    "BackendActor",
    "BackendSpec",
    "ConfigError",
    "DispatchStatistics",
    "Dispatcher",
    "HealthConfig",
    "HealthEvent",
    "HealthState",
    "KVFanOut",
    "LifecycleError",
    "ModelRoute",
    "ModelVersion",
    "NamedBackend",
    "PrefixKeys",
    "Progress",
    "PromptKeys",
    "Recorder",
    "RouteTable",
    "Router",
    "RouterConfig",
    "RouterMetrics",
    "RoutingConfig",
    "ServerConfig",
    "Supervisor",
    "build_backend",
    "build_backends",
    "decode_config",
    "default_backends",
    "load_config",
    "run_router",
    "with_overrides",
]

"""Backends: the :class:`Backend` protocol, the error tree, and the adapters
that need neither torch nor a server (the built-in engine lives in
``backends.engine`` and the mock's HTTP server in ``backends.mock_server``, both
imported on demand)."""

from __future__ import annotations

from backends.base import (
    Backend,
    BackendInfo,
    ChatMessage,
    Event,
    GenerateRequest,
    Health,
    KVEvent,
    Logprob,
    TopLogprob,
    Usage,
)
from backends.errors import (
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    ClientError,
    ContextLengthExceeded,
    HeadraceError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    StreamBroken,
    Unauthorized,
    UpstreamError,
    UpstreamRateLimited,
)
from backends.fakes import FlakyBackend, SlowBackend, StallingBackend
from backends.mock import Fault, MockBackend, MockConfig, parse_fault
from backends.openai_http import OpenAIHTTPBackend

__all__ = [
    "Backend",
    "BackendInfo",
    "BackendProtocolError",
    "BackendTimeout",
    "BackendUnavailable",
    "BadRequest",
    "ChatMessage",
    "ClientError",
    "ContextLengthExceeded",
    "Event",
    "Fault",
    "FlakyBackend",
    "GenerateRequest",
    "HeadraceError",
    "Health",
    "KVEvent",
    "Logprob",
    "MethodNotAllowed",
    "MockBackend",
    "MockConfig",
    "ModelNotFound",
    "NotFound",
    "OpenAIHTTPBackend",
    "PayloadTooLarge",
    "RateLimited",
    "SlowBackend",
    "StallingBackend",
    "StreamBroken",
    "TopLogprob",
    "Unauthorized",
    "UpstreamError",
    "UpstreamRateLimited",
    "Usage",
    "parse_fault",
]

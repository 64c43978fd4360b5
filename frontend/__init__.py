"""The OpenAI-compatible HTTP layer, shared by the router, the engine server
and the mock server: :class:`OpenAIServer` (ASGI), :class:`Call` (one request
body run against any Backend, no HTTP), :class:`RequestContext` and the
:class:`Gate` a request passes once, and :func:`serve` (hypercorn)."""

from frontend.call import Call, prepare_call
from frontend.context import OPEN_GATE, Gate, Principal, RequestContext
from frontend.server import HTTPRequest, OpenAIServer, Response, error_response, json_response
from frontend.serving import ServeOptions, serve

__all__ = [
    "OPEN_GATE",
    "Call",
    "Gate",
    "HTTPRequest",
    "OpenAIServer",
    "Principal",
    "RequestContext",
    "Response",
    "ServeOptions",
    "error_response",
    "json_response",
    "prepare_call",
    "serve",
]

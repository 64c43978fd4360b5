"""Errors: the right status and the OpenAI error shape for bad input.

Client mistakes must be 4xx with ``{"error": {"message", "type", "param",
"code"}}``; a 500 for bad input is a bug (it also makes a router retry what
will never succeed).
"""

from __future__ import annotations

from .registry import expect
from .shapes import error_shape
from .suite import HTTP, PROMPT
from .target import HttpTarget

DEFAULT_CONTEXT = 131072


@HTTP.check("errors.malformed_json", "errors")
async def malformed_json(t: HttpTarget) -> None:
    """A body that is not JSON gets 400 and an error object."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = await t.post(path, b'{"model": "x", "prompt": ')
        error_shape(reply, 400, f"POST {path} with a truncated JSON body")


@HTTP.check("errors.wrong_type", "errors")
async def wrong_type(t: HttpTarget) -> None:
    """A field of the wrong type (max_tokens as a string) gets 400."""
    body = {"model": t.model, "prompt": PROMPT, "max_tokens": "ten"}
    error_shape(await t.post("/v1/completions", body), 400, "max_tokens='ten'")
    chat = {"model": t.model, "messages": "not a list", "max_tokens": 4}
    error_shape(await t.post("/v1/chat/completions", chat), 400, "messages='not a list'")


@HTTP.check("errors.unknown_model", "errors")
async def unknown_model(t: HttpTarget) -> None:
    """A model the target does not serve gets 404."""
    body = {"model": "no-such-model-conformance", "prompt": PROMPT, "max_tokens": 4}
    error_shape(await t.post("/v1/completions", body), 404, "unknown model")
    chat = {"model": "no-such-model-conformance", "messages": [{"role": "user", "content": "hi"}]}
    error_shape(await t.post("/v1/chat/completions", chat), 404, "unknown model (chat)")


@HTTP.check("errors.context_length", "errors")
async def context_length(t: HttpTarget) -> str:
    """A prompt longer than the context window gets 400, not a 500 or a truncation."""
    limit = t.caps.max_context or DEFAULT_CONTEXT
    prompt = " hello" * (limit + 64)
    body = {"model": t.model, "prompt": prompt, "max_tokens": 4}
    message = error_shape(await t.post("/v1/completions", body), 400, f"prompt of ~{limit + 64} tokens")
    expect(message, "empty error message")
    source = "from /v1/models" if t.caps.max_context else "assumed"
    return f"context {limit} ({source})"

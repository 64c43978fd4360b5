"""The registry the HTTP checks add themselves to, and shared request helpers.

Each ``checks_*`` module registers into :data:`HTTP`; importing
:mod:`conformance.checks` loads them all in a fixed order.
"""

from __future__ import annotations

from typing import Any

from .registry import Registry
from .shapes import Completion, from_reply, from_stream
from .target import HttpTarget

__all__ = ["HTTP", "PROMPT", "chat", "complete"]

HTTP = Registry()

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def complete(target: HttpTarget, *, stream: bool = False, prompt: str | list[int] = PROMPT,
                   **params: Any) -> Completion:
    """One completion, validated and folded."""
    body = target.completion_body(prompt, **params)
    if stream:
        return from_stream(await target.stream("/v1/completions", body), "completion")
    return from_reply(await target.post("/v1/completions", body), "completion")


async def chat(target: HttpTarget, *, stream: bool = False, content: str = PROMPT,
               **params: Any) -> Completion:
    body = target.chat_body(content, **params)
    if stream:
        return from_stream(await target.stream("/v1/chat/completions", body), "chat")
    return from_reply(await target.post("/v1/chat/completions", body), "chat")

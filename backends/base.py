"""The Backend protocol: what every adapter provides.

A backend turns one :class:`GenerateRequest` into an async iterator of
:class:`Event`. Every event but the last carries new tokens; the last carries
``finish_reason`` and ``usage`` (and may carry tokens too). The first event
carries ``prompt_token_ids`` when the backend knows them, which is what lets the
router resume a broken stream elsewhere: it re-sends ``prompt_token_ids +
emitted token ids`` with the same seed and ``max_tokens`` reduced.

Errors are raised as :mod:`backends.errors` exceptions only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "Backend",
    "BackendInfo",
    "ChatMessage",
    "Event",
    "GenerateRequest",
    "Health",
    "KVEvent",
    "Logprob",
    "TopLogprob",
    "Usage",
]


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generation, already validated. Exactly one of ``prompt``,
    ``prompt_token_ids`` or ``messages`` is the input; ``prompt_token_ids``
    wins when several are set (a resumed request keeps the original text for
    logs but continues from the ids)."""

    request_id: str = ""
    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: chosen token plus n alternatives
    priority: int = 0  # higher runs first
    tenant: str = "default"
    # OpenAI fields we do not interpret; passed through to HTTP backends.
    extra: dict[str, Any] = {}


class TopLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    token: str = ""  # the token's text piece, when the backend can decode it


class Logprob(msgspec.Struct):
    token_id: int
    logprob: float
    token: str = ""
    top: list[TopLogprob] = []


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FinishReason = Literal["stop", "length", "abort"]


class Event(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A step of a stream: new tokens, and on the last event the outcome."""

    token_ids: list[int] = []
    text: str = ""
    logprobs: list[Logprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # first event only, when known
    seed: int | None = None  # the seed actually used (drawn when the request had none)


class Health(msgspec.Struct, frozen=True):
    ok: bool
    detail: str = ""


class BackendInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    models: tuple[str, ...]
    max_context: int | None = None
    token_ids: bool = False  # reports token ids and accepts prompt token ids
    kv_events: bool = False
    seeds: bool = True  # honours `seed` deterministically
    block_size: int | None = None  # KV block size, for KV-aware routing


class KVEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None


@runtime_checkable
class Backend(Protocol):
    """One inference server (or an in-process engine)."""

    def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Generate; cancelling the consumer cancels the generation."""
        ...

    async def health(self) -> Health: ...

    def info(self) -> BackendInfo: ...

    async def aclose(self) -> None: ...

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

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import trio

__all__ = [
    "SAMPLING_FIELDS",
    "Backend",
    "BackendInfo",
    "ChatMessage",
    "Event",
    "GenerateRequest",
    "Health",
    "KVEvent",
    "Logprob",
    "Sampling",
    "TopLogprob",
    "Usage",
    "chain_hashes",
    "close_stream",
    "hash_block",
]


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one generation: the sampling fields, declared once here
    and derived everywhere else (adding one is one edit here, plus the code
    that implements it). :class:`GenerateRequest` inherits them; the wire
    layer maps the client's spelling onto them (``frontend.wire``); the HTTP
    adapter forwards the ones that are set (``backends.openai_http``); the
    engine resolves the unset ones (``SamplingParams.from_request``).

    ``None`` is "not given by the client". A backend fills it with its own
    default: the engine with the model's recommended sampling (its generation
    config), an OpenAI-style backend with OpenAI's (1.0, 1.0, off, off, 1.0).
    An HTTP adapter forwards only the fields that differ from these defaults,
    so the server it calls applies its defaults in turn."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: chosen token plus n alternatives


SAMPLING_FIELDS: tuple[msgspec.structs.FieldInfo, ...] = msgspec.structs.fields(Sampling)


class GenerateRequest(Sampling, kw_only=True, omit_defaults=True):
    """One generation, already validated: its input, its :class:`Sampling`,
    and who asked. Exactly one of ``prompt``, ``prompt_token_ids`` or
    ``messages`` is the input; ``prompt_token_ids`` wins when several are set
    (a resumed request keeps the original text for logs but continues from
    the ids; ``resumed_tokens`` says how many of them are earlier output)."""

    request_id: str = ""
    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    priority: int = 0  # higher runs first
    tenant: str = "default"
    # A resumed generation (stream migration): the last ``resumed_tokens`` of
    # ``prompt_token_ids`` are this generation's own earlier output, already
    # relayed to the client. The backend continues as if it had produced them:
    # penalties, ``min_tokens``, stop strings, text offsets and ``usage`` count
    # them as output; only the text after them is emitted. ``max_tokens`` and
    # ``min_tokens`` are what remains (already reduced by ``resumed_tokens``).
    # Wire spelling: ``"resumed_tokens": k`` next to a token-id ``prompt``.
    resumed_tokens: int = 0
    # The W3C ``traceparent`` a backend is sent (the router gives each
    # attempt a span of its own); None: no trace.
    traceparent: str | None = None
    # Requests with one affinity key go to one backend while its load stays
    # bounded (the router's dispatcher; a batch's items carry the batch id).
    affinity: str | None = None
    # OpenAI fields we do not interpret; passed through to HTTP backends.
    extra: dict[str, Any] = {}


class TopLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    token: str = ""  # the token's text piece, when the backend can decode it
    # The token's bytes, when the backend knows them. A token holding part of
    # a UTF-8 character spells those bytes as ``\xNN`` escapes in ``token``
    # (Python's ``backslashreplace``), which is how the wire layer reads a
    # token that comes without them.
    token_bytes: bytes | None = None


class Logprob(msgspec.Struct):
    token_id: int
    logprob: float
    token: str = ""
    top: list[TopLogprob] = []
    token_bytes: bytes | None = None  # as on TopLogprob
    # Where the token starts in its choice's text, in characters, when the
    # backend knows (else the wire layer counts the tokens' characters).
    text_offset: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # The engine's batch accounting: this request's share of the steps it was
    # computed in (backends/engine/accounting.py); 0 where the backend does not say.
    gpu_seconds: float = 0.0

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
    # First event only, when the model that answers is not the one asked for
    # (the router's fallbacks and versions); the response's ``model`` then says it.
    model: str | None = None
    # A hint for a consumer that writes what it relays: the stream's next step
    # (another event, or its end) is already here, so a write can wait for it.
    # A backend that cannot tell leaves it False (each event is written alone).
    more_ready: bool = False


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
    # KV blocks its prefix cache holds at most: a router that knows it can
    # tell which cached blocks the prompts it sends there will evict.
    kv_capacity_blocks: int | None = None
    # A prompt sent while another with the same prefix is still prefilling
    # finds that prefix cached once its turn comes (the engine's scheduler
    # waits for a running prefill's blocks; the mock's lane is FIFO).
    prefix_sharing: bool = False
    # Where the router can get this backend's tokenizer, to compute the engine's
    # block hashes itself: a GGUF file or HF folder path, or "bytes" (the mock's).
    tokenizer: str | None = None
    # Names one run of the backend's KV event numbering: a restarted engine
    # numbers its events from 1 again under a new epoch, so a subscriber
    # holding an old seq knows to drop what it indexed and start over.
    kv_epoch: str | None = None
    # The same request gives the same tokens whatever else the backend serves and
    # whatever it has cached, and a request whose prompt is another's prompt plus its
    # first k output tokens continues it exactly (stream migration relies on it).
    exact_resume: bool = False


_MASK63 = (1 << 63) - 1


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full KV block: the engine registers its prefix
    cache under it and publishes it in :class:`KVEvent`; the router computes
    the same from a request's token ids to route by what is cached. Stable
    across processes (Python's tuple hash of ints does not depend on
    PYTHONHASHSEED), non-negative, 63 bits."""
    return hash((-1 if parent_hash is None else parent_hash, token_ids)) & _MASK63


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained :func:`hash_block` of every full block of ``token_ids``."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start : start + block_size]))
        out.append(parent)
    return out


class KVEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None


async def close_stream(stream: object) -> None:
    """Close an event stream (its ``aclose``) however its consumer ends,
    shielded from cancellation, so the backend hears of it and an adapter's
    cleanup may wait. An async generator that already ran to its end has
    nothing left to close and is left alone: a stream passes about seven
    layers that each close it, and the common ending, a finished stream,
    then costs them no cancel scope."""
    if getattr(stream, "ag_frame", True) is None:  # an exhausted (or closed) async generator
        return
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with trio.CancelScope(shield=True):
            await aclose()


@runtime_checkable
class Backend(Protocol):
    """One inference server (or an in-process engine)."""

    def stream(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Generate; cancelling the consumer cancels the generation."""
        ...

    async def health(self) -> Health: ...

    def info(self) -> BackendInfo: ...

    async def aclose(self) -> None: ...

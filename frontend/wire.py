"""The OpenAI wire format: request Structs, validation, and response builders.

Requests are decoded once into a dict (so fields OpenAI allows but we do not
interpret survive as ``GenerateRequest.extra`` and reach HTTP backends), then
converted into a typed Struct that does the type checking. Everything a client
can get wrong becomes :class:`~backends.errors.BadRequest` naming the field.

Extensions (as vLLM spells them): ``prompt`` as token ids, ``return_token_ids``
(``token_ids`` per choice, ``prompt_token_ids`` on the first chunk), ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``priority`` (vLLM's int, higher runs first here; or a
class name, ``"interactive" | "default" | "batch"``, as ``X-Priority``
spells it). With ``return_token_ids`` the choice also
carries the ``seed`` actually used, which is what a resume needs. And the resume
itself: ``resumed_tokens: k`` with a token-id prompt (completions and
``/v1/generate``, one choice) says its last k ids are the generation's own earlier
output (:attr:`GenerateRequest.resumed_tokens`).
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

import msgspec

from backends.base import (
    SAMPLING_FIELDS,
    ChatMessage,
    Event,
    GenerateRequest,
    Logprob,
    TopLogprob,
    Usage,
)
from backends.errors import BadRequest
from frontend.context import ENGINE_PRIORITY, PriorityClass, new_request_id

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "NativeRequest",
    "WireRequest",
    "chunk_choice",
    "decode_request",
    "error_body",
    "logprobs_payload",
    "new_id",
    "text_offsets",
    "to_generate_requests",
    "usage_payload",
]

Kind = Literal["completion", "chat", "native"]

MAX_N = 128
MAX_STOP = 16
MAX_LOGPROBS = 20


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    priority: int | PriorityClass = 0
    resumed_tokens: int = 0  # a stream migration's continuation (checked in _validate_resumed)


# msgspec unions hold one array type: the batch forms are checked in _prompts.
Prompt = str | list[int | str | list[int]]


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class NativeRequest(_Sampling, kw_only=True):
    prompt: str | list[int] | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    logprobs: int | None = None


WireRequest = CompletionRequest | ChatRequest | NativeRequest
_STRUCTS: dict[Kind, type[WireRequest]] = {
    "completion": CompletionRequest,
    "chat": ChatRequest,
    "native": NativeRequest,
}


def new_id(kind: Kind) -> str:
    prefix = {"completion": "cmpl", "chat": "chatcmpl", "native": "gen"}[kind]
    return f"{prefix}-{new_request_id()}"


def decode_request(body: bytes, kind: Kind) -> tuple[WireRequest, dict[str, Any]]:
    """Decode and type-check a body; return the Struct and the fields it does
    not know (passed through to HTTP backends)."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested ~1,000 deep, even in an unknown field
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(raw, dict):
        raise BadRequest("request body must be a JSON object")
    struct = _STRUCTS[kind]
    try:
        wire = msgspec.convert(raw, struct, strict=True)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc), param=_param_of(str(exc))) from None
    known = set(struct.__struct_fields__)
    extra = {k: v for k, v in raw.items() if k not in known}
    _validate(wire)
    return wire, extra


def _param_of(message: str) -> str | None:
    # msgspec says "... - at `$.messages[0].role`"; the param is the path.
    marker = "at `$."
    if marker not in message:
        return None
    return message.split(marker, 1)[1].rstrip("`")


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)


def _validate(w: WireRequest) -> None:
    max_tokens = w.max_completion_tokens if isinstance(w, ChatRequest) and w.max_completion_tokens is not None else w.max_tokens
    if max_tokens is not None:
        _check(max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
    if w.temperature is not None:
        _check(0.0 <= w.temperature <= 2.0, "temperature must be between 0 and 2", "temperature")
    if w.top_p is not None:
        _check(0.0 < w.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
    if w.min_p is not None:
        _check(0.0 <= w.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
    if w.top_k is not None:
        _check(w.top_k >= -1, "top_k must be -1, 0 (off) or positive", "top_k")
    if w.repetition_penalty is not None:
        _check(0.0 < w.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]", "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(w, name)
        if value is not None:
            _check(-2.0 <= value <= 2.0, f"{name} must be between -2 and 2", name)
    _check(1 <= w.n <= MAX_N, f"n must be between 1 and {MAX_N}", "n")
    _check(w.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
    if w.seed is not None:
        _check(-(2**63) <= w.seed < 2**64, "seed must fit in 64 bits", "seed")
    stops = _stops(w.stop)
    _check(len(stops) <= MAX_STOP, f"at most {MAX_STOP} stop sequences", "stop")
    _check(all(stops), "stop sequences must be non-empty", "stop")
    if w.stop_token_ids is not None:
        _check(all(t >= 0 for t in w.stop_token_ids), "stop_token_ids must be non-negative", "stop_token_ids")
    if isinstance(w, CompletionRequest):
        _validate_completion(w)
        _validate_resumed(w, _prompts(w.prompt))
    elif isinstance(w, ChatRequest):
        _check(w.resumed_tokens == 0, "resumed_tokens needs a token-id prompt, not messages", "resumed_tokens")
        _check(len(w.messages) > 0, "messages must not be empty", "messages")
        if w.top_logprobs is not None:
            _check(0 <= w.top_logprobs <= MAX_LOGPROBS, f"top_logprobs must be 0..{MAX_LOGPROBS}", "top_logprobs")
    else:
        inputs = [w.prompt is not None, w.prompt_token_ids is not None, w.messages is not None]
        _check(sum(inputs) == 1, "give exactly one of prompt, prompt_token_ids, messages", "prompt")
        _check(w.n == 1, "n must be 1 on /v1/generate", "n")
        if w.logprobs is not None:
            _check(0 <= w.logprobs <= MAX_LOGPROBS, f"logprobs must be 0..{MAX_LOGPROBS}", "logprobs")
        ids = w.prompt_token_ids if w.prompt_token_ids is not None else w.prompt
        if isinstance(ids, list):
            _check(len(ids) > 0 and all(t >= 0 for t in ids), "prompt token ids must be non-negative and non-empty", "prompt")
        _validate_resumed(w, [] if ids is None else [ids])


def _validate_resumed(w: CompletionRequest | NativeRequest, prompts: list[str | list[int]]) -> None:
    """``resumed_tokens``: a non-negative int; when positive, one choice of one
    token-id prompt with at least one id left that is not earlier output."""
    k = w.resumed_tokens
    _check(k >= 0, "resumed_tokens must be non-negative", "resumed_tokens")
    if k == 0:
        return
    _check(
        len(prompts) == 1 and isinstance(prompts[0], list),
        "resumed_tokens needs one prompt of token ids",
        "resumed_tokens",
    )
    _check(w.n == 1, "resumed_tokens needs n = 1", "resumed_tokens")
    _check(
        k < len(prompts[0]),
        f"resumed_tokens ({k}) must leave at least one of the {len(prompts[0])} prompt tokens",
        "resumed_tokens",
    )


def _validate_completion(w: CompletionRequest) -> None:
    _check(not w.echo, "echo is not supported", "echo")
    _check(w.suffix is None, "suffix is not supported", "suffix")
    _check(w.best_of is None or w.best_of == w.n, "best_of must equal n", "best_of")
    if w.logprobs is not None:
        _check(0 <= w.logprobs <= MAX_LOGPROBS, f"logprobs must be 0..{MAX_LOGPROBS}", "logprobs")
    prompts = _prompts(w.prompt)
    _check(0 < len(prompts) <= MAX_N, f"between 1 and {MAX_N} prompts", "prompt")
    _check(len(prompts) * w.n <= MAX_N, f"at most {MAX_N} choices (prompts x n)", "n")
    for p in prompts:
        if isinstance(p, list):
            _check(len(p) > 0 and all(t >= 0 for t in p), "prompt token ids must be non-negative and non-empty", "prompt")


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _prompts(prompt: Prompt) -> list[str | list[int]]:
    """One prompt or a batch: ``str``, ``[int]``, ``[str]``, ``[[int]]``."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return []
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise BadRequest("prompt must be a string, a list of token ids, or a list of either", param="prompt")


def to_generate_requests(
    wire: WireRequest, extra: dict[str, Any], *, request_id: str, tenant: str = "default", traceparent: str | None = None
) -> list[GenerateRequest]:
    """One GenerateRequest per choice (prompts x n), in choice-index order.
    With a seed, choice i of a prompt uses ``seed + i`` so choices differ but
    stay reproducible."""
    common = _common_fields(wire)
    inputs: list[dict[str, Any]]
    if isinstance(wire, CompletionRequest):
        inputs = [_input_of(p) for p in _prompts(wire.prompt)]
    elif isinstance(wire, ChatRequest) or wire.messages is not None:
        inputs = [{"messages": wire.messages}]
    elif wire.prompt_token_ids is not None:
        inputs = [{"prompt_token_ids": wire.prompt_token_ids}]
    else:
        assert wire.prompt is not None  # checked by _validate
        inputs = [_input_of(wire.prompt)]
    out = []
    for p_index, source in enumerate(inputs):
        for i in range(wire.n):
            seed = None if wire.seed is None else (wire.seed + i) % 2**64
            index = p_index * wire.n + i
            out.append(
                GenerateRequest(
                    request_id=f"{request_id}-{index}" if len(inputs) * wire.n > 1 else request_id,
                    seed=seed,
                    tenant=tenant,
                    traceparent=traceparent,
                    extra=extra,
                    **source,
                    **common,
                )
            )
    return out


def _input_of(prompt: str | list[int]) -> dict[str, Any]:
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def _common_fields(w: WireRequest) -> dict[str, Any]:
    max_tokens = w.max_tokens
    logprobs: int | None
    if isinstance(w, ChatRequest):
        if w.max_completion_tokens is not None:
            max_tokens = w.max_completion_tokens
        logprobs = (w.top_logprobs or 0) if w.logprobs else None
    else:
        logprobs = w.logprobs
        if isinstance(w, CompletionRequest) and max_tokens is None:
            max_tokens = 16  # OpenAI's default for completions
    fields: dict[str, Any] = {
        # Each Sampling field the client gave, as the wire spells it (the
        # seed is per choice: to_generate_requests)...
        **{
            f.name: getattr(w, f.name)
            for f in SAMPLING_FIELDS
            if f.name != "seed" and getattr(w, f.name, None) is not None
        },
        # ...and the fields whose spelling differs.
        "model": w.model or None,  # "" is no model, as the front end reads it: any backend
        "max_tokens": max_tokens,
        "stop": _stops(w.stop),
        "stop_token_ids": list(w.stop_token_ids or []),
        "logprobs": logprobs,
        "priority": w.priority if isinstance(w.priority, int) else ENGINE_PRIORITY[w.priority],
    }
    if not isinstance(w, ChatRequest):
        fields["resumed_tokens"] = w.resumed_tokens
    if w.top_k == -1:
        fields["top_k"] = 0  # vLLM's spelling of "off"
    return fields


# ---------------------------------------------------------------- responses


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_payload(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.gpu_seconds:  # an extension: the engine's GPU time for this request (its batch accounting)
        out["gpu_seconds"] = usage.gpu_seconds
    return out


def logprobs_payload(kind: Kind, entries: list[Logprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI's two logprob shapes: completions' parallel arrays, chat's list.

    Completions' ``top_logprobs`` maps hold the alternatives and always the
    chosen token (so up to ``logprobs + 1`` keys, as OpenAI documents);
    ``text_offset`` is where each token starts in the choice's text: the
    backend's ``Logprob.text_offset`` where it gives one, else counted from the
    tokens' bytes, ``offset`` being the length of the text before ``entries``
    (a streamed chunk's)."""
    if kind == "chat":
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": _token_bytes(e),
                    "top_logprobs": [
                        {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t)}
                        for t in e.top
                    ],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_map(e) for e in entries],
        "text_offset": [
            e.text_offset if e.text_offset is not None else counted
            for e, counted in zip(entries, text_offsets([_raw(e) for e in entries], offset), strict=True)
        ],
    }


def _raw(e: Logprob | TopLogprob) -> bytes:
    """A token's bytes: as the backend gave them, else read from its text, where
    ``\\xNN`` spells a byte that is not a whole character (the engine's
    spelling, Python's ``backslashreplace``): what is left of a record that
    crossed an HTTP hop without its bytes."""
    if e.token_bytes is not None:
        return e.token_bytes
    if "\\x" not in e.token:
        return e.token.encode()
    parts = _ESCAPED_BYTE.split(e.token)  # text, hex, text, hex, ..., text
    return b"".join(
        bytes([int(part, 16)]) if i % 2 else part.encode() for i, part in enumerate(parts)
    )


_ESCAPED_BYTE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _token_bytes(e: Logprob | TopLogprob) -> list[int]:
    return list(_raw(e))


def _top_map(e: Logprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for t in e.top:
        top.setdefault(t.token, t.logprob)  # the likelier of two equal texts
    top.setdefault(e.token, e.logprob)
    return top


def text_offsets(pieces: list[bytes], start: int = 0) -> list[int]:
    """Where each token starts in the text, in characters: the number of whole
    characters before it (a token that begins inside a multi-byte character
    starts at that character). ``pieces`` are the tokens' bytes, in order;
    ``start`` the characters before them. A leading run of continuation bytes
    finishes a character begun before ``pieces`` (not counted in ``start``,
    as a stream emits a character only once it is whole)."""
    offsets: list[int] = []
    count, need, orphan = start, 0, False
    for piece in pieces:
        if piece and not _is_continuation(piece[0]):
            count += int(orphan or need > 0)  # the open character ended (or was cut short)
            orphan, need = False, 0
        offsets.append(count)
        for byte in piece:
            if _is_continuation(byte):
                if need:
                    need -= 1
                    count += int(need == 0)
                else:
                    orphan = True
                continue
            count += int(orphan or need > 0)
            orphan = False
            need = _utf8_width(byte) - 1
            count += int(need == 0)
    return offsets


def _is_continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


def _utf8_width(lead: int) -> int:
    if 0xC0 <= lead < 0xE0:
        return 2
    if 0xE0 <= lead < 0xF0:
        return 3
    if 0xF0 <= lead < 0xF8:
        return 4
    return 1  # ASCII, or an invalid byte (shown as one U+FFFD)


def chunk_choice(
    kind: Kind,
    index: int,
    event: Event,
    *,
    token_ids: bool,
    first: bool,
    text_offset: int = 0,
) -> dict[str, Any]:
    """One choice of a streamed chunk."""
    choice: dict[str, Any] = {"index": index}
    if kind == "chat":
        delta: dict[str, Any] = {"content": event.text} if (event.text or not first) else {}
        if first:
            delta = {"role": "assistant", "content": event.text}
        choice["delta"] = delta
    else:
        choice["text"] = event.text
    choice["logprobs"] = logprobs_payload(kind, event.logprobs, text_offset) if event.logprobs else None
    choice["finish_reason"] = event.finish_reason
    if token_ids:
        choice["token_ids"] = event.token_ids
        if event.prompt_token_ids is not None:
            choice["prompt_token_ids"] = event.prompt_token_ids
        if event.seed is not None:
            choice["seed"] = event.seed
    return choice


def now() -> int:
    return int(time.time())

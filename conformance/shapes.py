"""Validate OpenAI response shapes and fold them into one comparable record.

Streaming and non-streaming answers, completions and chat, all reduce to a
:class:`Completion` (text, finish reason and token ids per choice, usage), so
checks compare outcomes without caring how they arrived. Every structural rule
the OpenAI clients rely on is enforced here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .registry import expect, fail
from .target import Reply, StreamReply

__all__ = ["Completion", "error_shape", "from_reply", "from_stream"]

Kind = Literal["completion", "chat"]
_OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
_CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
FINISH_REASONS = {"stop", "length"}


@dataclass
class Completion:
    id: str
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    logprobs: dict[int, Any] = field(default_factory=dict)
    pieces: dict[int, list[str]] = field(default_factory=dict)  # streamed text, chunk by chunk

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    @property
    def ids(self) -> list[int]:
        return self.token_ids.get(0, [])

    def completion_tokens(self) -> int:
        expect(self.usage is not None, "no usage in the response")
        assert self.usage is not None
        return int(self.usage["completion_tokens"])


def _ok(reply: Reply | StreamReply, what: str) -> None:
    if reply.status != 200:
        fail(f"{what}: HTTP {reply.status}: {reply.body[:200]!r}")


def from_reply(reply: Reply, kind: Kind) -> Completion:
    _ok(reply, f"{kind} request")
    doc = reply.json
    expect(isinstance(doc, dict), f"{kind} response is not a JSON object")
    expect(isinstance(doc.get("id"), str) and doc["id"], "response has no string id")
    expect(doc.get("object") == _OBJECT[kind], f"object is {doc.get('object')!r}, not {_OBJECT[kind]!r}")
    choices = doc.get("choices")
    expect(isinstance(choices, list) and choices, "response has no choices")
    out = Completion(id=doc["id"], usage=check_usage(doc.get("usage"), required=True))
    for choice in choices:
        index = _index(choice)
        out.texts[index] = _choice_text(choice, kind)
        out.finish[index] = _finish(choice)
        _collect_extras(out, doc, choice, index)
    return out


def from_stream(reply: StreamReply, kind: Kind) -> Completion:
    """Fold a stream, enforcing SSE framing, one id, one finish per choice."""
    _ok(reply, f"streaming {kind} request")
    ctype = reply.headers.get("content-type", "")
    expect(ctype.startswith("text/event-stream"), f"content-type is {ctype!r}, not text/event-stream")
    sse = reply.sse
    expect(not sse.problems, f"SSE framing: {'; '.join(sse.problems[:3])}")
    expect(sse.done, "stream did not end with data: [DONE]")
    expect(sse.after_done == 0, f"{sse.after_done} event(s) after data: [DONE]")
    expect(sse.chunks, "stream carried no chunks")
    ids = {chunk.get("id") for chunk in sse.chunks}
    expect(len(ids) == 1, f"chunk ids are not stable across the stream: {sorted(map(str, ids))[:4]}")
    out = Completion(id=str(next(iter(ids))))
    expect(out.id and out.id != "None", "chunks carry no id")
    for chunk in sse.chunks:
        _fold_chunk(out, chunk, kind)
    expect(out.texts, "no chunk carried a choice")
    for index in out.texts:
        expect(index in out.finish, f"choice {index} never got a finish_reason")
    return out


def _fold_chunk(out: Completion, chunk: dict[str, Any], kind: Kind) -> None:
    obj = chunk.get("object")
    expect(obj == _CHUNK_OBJECT[kind], f"chunk object is {obj!r}, not {_CHUNK_OBJECT[kind]!r}")
    usage = chunk.get("usage")
    if usage is not None:
        expect(out.usage is None, "more than one chunk carried usage")
        out.usage = check_usage(usage, required=True)
    choices = chunk.get("choices")
    expect(isinstance(choices, list), "chunk has no choices list")
    for choice in choices:
        _fold_choice(out, chunk, choice, kind)


def _fold_choice(out: Completion, chunk: dict[str, Any], choice: Any, kind: Kind) -> None:
    index = _index(choice)
    expect(index not in out.finish, f"choice {index} has chunks after its finish_reason")
    if kind == "chat" and index not in out.texts:
        role = (choice.get("delta") or {}).get("role")
        expect(role == "assistant", f"first delta of choice {index} has role {role!r}, not 'assistant'")
    piece = _choice_text(choice, kind, delta=True)
    out.texts[index] = out.texts.get(index, "") + piece
    if piece:
        out.pieces.setdefault(index, []).append(piece)
    if choice.get("finish_reason") is not None:
        out.finish[index] = _finish(choice)
    _collect_extras(out, chunk, choice, index)


def _collect_extras(out: Completion, doc: dict[str, Any], choice: dict[str, Any], index: int) -> None:
    ids = choice.get("token_ids")
    if ids is not None:
        expect(_int_list(ids), f"choice {index} token_ids is not a list of ints")
        out.token_ids.setdefault(index, []).extend(ids)
    prompt_ids = choice.get("prompt_token_ids", doc.get("prompt_token_ids"))
    if prompt_ids is not None and out.prompt_token_ids is None:
        expect(_int_list(prompt_ids), "prompt_token_ids is not a list of ints")
        out.prompt_token_ids = list(prompt_ids)
    if choice.get("logprobs") is not None:
        out.logprobs.setdefault(index, []).append(choice["logprobs"])


def _index(choice: Any) -> int:
    expect(isinstance(choice, dict), "a choice is not an object")
    index = choice.get("index")
    expect(isinstance(index, int) and index >= 0, f"choice index is {index!r}")
    return int(index)


def _choice_text(choice: dict[str, Any], kind: Kind, *, delta: bool = False) -> str:
    if kind == "completion":
        text = choice.get("text")
        expect(isinstance(text, str), f"choice text is {type(text).__name__}, not str")
        return str(text)
    message = choice.get("delta" if delta else "message")
    expect(isinstance(message, dict), "chat choice has no message/delta object")
    if not delta:
        expect(message.get("role") == "assistant", f"message role is {message.get('role')!r}")
    content = message.get("content")
    expect(content is None or isinstance(content, str), "message content is not a string")
    return content or ""


def _finish(choice: dict[str, Any]) -> str:
    reason = choice.get("finish_reason")
    expect(reason in FINISH_REASONS, f"finish_reason is {reason!r}, expected stop or length")
    return str(reason)


def check_usage(usage: Any, *, required: bool) -> dict[str, Any] | None:
    if usage is None:
        expect(not required, "response has no usage")
        return None
    expect(isinstance(usage, dict), "usage is not an object")
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    for key in keys:
        expect(isinstance(usage.get(key), int) and usage[key] >= 0, f"usage.{key} is {usage.get(key)!r}")
    expect(usage["prompt_tokens"] > 0, "usage.prompt_tokens is 0 for a non-empty prompt")
    total = usage["prompt_tokens"] + usage["completion_tokens"]
    expect(usage["total_tokens"] == total, f"usage.total_tokens {usage['total_tokens']} != {total}")
    return dict(usage)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def error_shape(reply: Reply, status: int, what: str) -> str:
    """Expect ``status`` and the OpenAI error body; return the message."""
    expect(reply.status == status, f"{what}: HTTP {reply.status}, expected {status}")
    doc = reply.json
    err = doc.get("error") if isinstance(doc, dict) else None
    expect(isinstance(err, dict), f"{what}: body is not {{'error': {{...}}}}: {reply.body[:160]!r}")
    missing = [k for k in ("message", "type", "param", "code") if k not in err]
    expect(not missing, f"{what}: error object lacks {', '.join(missing)}")
    expect(isinstance(err["message"], str) and err["message"], f"{what}: error.message is empty")
    expect(isinstance(err["type"], str) and err["type"], f"{what}: error.type is not a string")
    return str(err["message"])

"""The OpenAI wire as an upstream speaks it, sans-I/O: stream chunks to
:class:`~backends.base.Event` (:class:`ChunkParser`), a non-200 answer to the
error tree (:func:`status_error`), a transport failure to the error tree
(:func:`transport_error`), the engine's additions to ``/v1/models``
(:func:`engine_fields`) and ``/v1/kv_events`` bytes to :class:`KVEvent`
(:class:`KVEventParser`). :mod:`backends.openai_http` does the I/O around them.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import msgspec

from backends.base import Event, KVEvent, Logprob, TopLogprob, Usage
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
    PayloadTooLarge,
    StreamBroken,
    Unauthorized,
    UpstreamError,
    UpstreamRateLimited,
)

__all__ = ["ChunkParser", "KVEventParser", "engine_fields", "status_error", "transport_error"]

# ---------------------------------------------------------------- chunks -> events


def _finish(reason: object) -> Literal["stop", "length", "abort"]:
    return reason if reason in ("length", "abort") else "stop"


def _int_list(value: object, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise BackendProtocolError(f"{what} is not a list of token ids")
    return value


def _usage(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    details = obj.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    gpu = obj.get("gpu_seconds")  # headrace's engine: this request's share of its steps
    return Usage(
        prompt_tokens=int(obj.get("prompt_tokens") or 0),
        completion_tokens=int(obj.get("completion_tokens") or 0),
        cached_tokens=int(cached or 0),
        gpu_seconds=float(gpu) if isinstance(gpu, int | float) and gpu >= 0 else 0.0,
    )


def _bytes(value: object) -> bytes | None:
    """A chat logprob's ``bytes`` (a list of byte values), or None."""
    return bytes(value) if isinstance(value, list) else None


def _logprobs(obj: object, ids: list[int]) -> list[Logprob] | None:
    """Both OpenAI shapes: completions' parallel arrays, chat's ``content``."""
    if not isinstance(obj, dict):
        return None
    try:
        if isinstance(obj.get("content"), list):
            entries = [
                (
                    e["token"],
                    e["logprob"],
                    _bytes(e.get("bytes")),
                    [(t["token"], t["logprob"], _bytes(t.get("bytes"))) for t in e.get("top_logprobs") or []],
                )
                for e in obj["content"]
            ]
        else:
            tops = obj.get("top_logprobs") or [None] * len(obj["tokens"])
            entries = [
                (tok, lp, None, [(k, v, None) for k, v in (top or {}).items()])
                for tok, lp, top in zip(obj["tokens"], obj["token_logprobs"], tops, strict=True)
            ]
        # Upstream text offsets are not carried: the frontend counts them
        # for the text it relays (a resumed stream restarts them upstream).
        return [
            Logprob(
                ids[i] if i < len(ids) else -1,
                float(lp),
                str(tok),
                [TopLogprob(-1, float(v), str(k), b) for k, v, b in top],
                token_bytes=raw,
            )
            for i, (tok, lp, raw, top) in enumerate(entries)
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BackendProtocolError(f"malformed logprobs in chunk: {exc!r}") from None


class _Choice(msgspec.Struct):
    """One choice of a stream chunk: the fields read, any others skipped."""

    index: int = 0
    text: Any = None
    delta: Any = None
    logprobs: Any = None
    finish_reason: Any = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    seed: Any = None
    usage: Any = None


class _Chunk(msgspec.Struct):
    """A stream chunk: the fields read (``error``: UNSET when absent)."""

    choices: list[_Choice] | None = None
    error: Any = msgspec.UNSET
    prompt_token_ids: list[int] | None = None
    seed: Any = None
    usage: Any = None


_CHUNK = msgspec.json.Decoder(_Chunk)
_ANY = msgspec.json.Decoder()


def _checked(data: str) -> _Chunk:
    """The slow path, for a chunk the typed decoder refused: the generic
    checks, each with its own message, and the chunk they let through."""
    try:  # the typed decoder may refuse a chunk before reading all of it: it can still be malformed
        obj = _ANY.decode(data)
    except msgspec.DecodeError:
        raise BackendProtocolError(f"malformed chunk: {data[:200]!r}") from None
    if not isinstance(obj, dict):
        raise BackendProtocolError(f"chunk is not a JSON object: {data[:200]!r}")
    if "error" in obj:
        return _Chunk(error=obj["error"])
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise BackendProtocolError(f"chunk without choices: {data[:200]!r}")
    for c in choices:
        if not isinstance(c, dict) or c.get("index", 0) != 0:
            raise BackendProtocolError(f"unexpected choice {c!r} (asked for one)")
    return _Chunk(
        choices=[_Choice(**{f: _ids(c, f) for f in _Choice.__struct_fields__ if f in c}) for c in choices],
        prompt_token_ids=_int_list(obj.get("prompt_token_ids"), "prompt_token_ids"),
        seed=obj.get("seed"),
        usage=obj.get("usage"),
    )


def _ids(c: dict[str, Any], field: str) -> Any:
    value = c[field]
    return _int_list(value, field) if field in ("token_ids", "prompt_token_ids") else value


class ChunkParser:
    """OpenAI stream chunks -> Events. The event with ``finish_reason`` is
    held until ``[DONE]`` (or :meth:`end`), so it leaves with usage. A stream
    that ends without ``[DONE]`` is complete when the usage chunk came after
    the finish reason (:attr:`complete`: :meth:`end` delivers the final
    event); else :meth:`end` raises StreamBroken and the final event is never
    delivered (the tokens in it are then regenerated by a resume, which keeps
    resumes exact).

    A chunk is decoded straight into the fields read (msgspec skips the
    rest: id, object, created, model...); one that does not fit them is
    decoded again generically and checked field by field, for its error's
    message (:func:`_checked`)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.prompt_ids: list[int] | None = None
        self.seed: int | None = None
        self.final: Event | None = None
        self.usage: Usage | None = None
        self.events = 0
        self.tokens = 0
        self.saw_ids = False
        self.done = False

    def feed(self, data: str) -> list[Event]:
        if data == "[DONE]" or data.strip() == "[DONE]":
            self.done = True
            return [self._final()]
        if self.done:
            raise BackendProtocolError("data after [DONE]")
        try:
            chunk = _CHUNK.decode(data)
        except msgspec.ValidationError:
            chunk = _checked(data)
        except msgspec.DecodeError:
            raise BackendProtocolError(f"malformed chunk: {data[:200]!r}") from None
        if chunk.error is not msgspec.UNSET:
            raise self._stream_error(chunk.error)
        if chunk.prompt_token_ids is not None or chunk.seed is not None or chunk.usage is not None:
            self._absorb(chunk.prompt_token_ids, chunk.seed, chunk.usage)
        choices = chunk.choices
        if choices is None:
            raise BackendProtocolError(f"chunk without choices: {data[:200]!r}")
        if len(choices) == 1:  # every token's chunk
            event = self._choice(choices[0])
            return [event] if event is not None else []
        events = []
        for c in choices:
            event = self._choice(c)
            if event is not None:
                events.append(event)
        return events

    def _absorb(self, prompt_ids: list[int] | None, seed: object, usage: object) -> None:
        if prompt_ids is not None and self.prompt_ids is None:
            self.prompt_ids = prompt_ids
        if isinstance(seed, int) and self.seed is None:
            self.seed = seed
        if usage is not None:
            parsed = _usage(usage)
            if parsed is not None:
                self.usage = parsed

    def _choice(self, c: _Choice) -> Event | None:
        if c.index != 0:
            raise BackendProtocolError(f"unexpected choice {msgspec.to_builtins(c)!r} (asked for one)")
        if c.prompt_token_ids is not None or c.seed is not None or c.usage is not None:
            self._absorb(c.prompt_token_ids, c.seed, c.usage)
        if self.final is not None:
            raise BackendProtocolError("tokens after finish_reason")
        ids = c.token_ids
        if ids is not None:
            self.saw_ids = True
        else:
            ids = []
        if self.chat:
            text = self._text(c)
        else:  # _text's completions case, inline: every token's chunk
            text = c.text
            if text is None:
                text = ""
            elif not isinstance(text, str):
                raise BackendProtocolError("chunk text is not a string")
        event = Event(token_ids=ids, text=text, logprobs=_logprobs(c.logprobs, ids) if c.logprobs is not None else None)
        self.tokens += len(ids)
        if c.finish_reason is not None:
            event.finish_reason = _finish(c.finish_reason)
            self.final = event
            return None
        if not ids and not text:
            return None  # a role-only or empty delta
        return self._stamp(event)

    def _text(self, c: _Choice) -> str:
        if self.chat:
            delta = c.delta
            value = delta.get("content") if isinstance(delta, dict) else None
            if delta and not isinstance(delta, dict):
                raise BackendProtocolError("chunk delta is not an object")
        else:
            value = c.text
        if value is not None and not isinstance(value, str):
            raise BackendProtocolError("chunk text is not a string")
        return value or ""

    def _stamp(self, event: Event) -> Event:
        if self.events == 0:
            event.prompt_token_ids, event.seed = self.prompt_ids, self.seed
        self.events += 1
        return event

    @property
    def complete(self) -> bool:
        """The finish reason and the usage chunk have both come."""
        return self.final is not None and self.usage is not None

    def end(self) -> Event:
        """The stream ended without ``[DONE]``: its final event when
        :attr:`complete`, else :class:`StreamBroken`."""
        if not self.complete:
            missing = "its usage chunk" if self.final is not None else "its final event"
            raise StreamBroken(f"stream ended without {missing} after {self.events} events")
        self.done = True
        return self._final()

    def _final(self) -> Event:
        if self.final is None:
            raise BackendProtocolError("stream ended with [DONE] but no finish_reason")
        usage = self.usage or Usage(len(self.prompt_ids or []), self.tokens)
        self.final.usage = usage
        return self._stamp(self.final)

    def _stream_error(self, err: object) -> HeadraceError:
        message, type_, code = _error_fields(err)
        if type_ == "invalid_request_error":
            return BadRequest(message, code=code)
        if self.events:
            return StreamBroken(f"backend failed mid-stream: {message}")
        if code == "backend_unavailable":
            return BackendUnavailable(message)
        return UpstreamError(message)


# ---------------------------------------------------------------- status codes


def _error_fields(err: object) -> tuple[str, str | None, str | None]:
    """(message, type, code) from OpenAI's ``{"error": {...}}``, vLLM's flat
    ``{"object": "error", "message": ...}`` or anything else."""
    if isinstance(err, dict) and isinstance(err.get("error"), dict):
        err = err["error"]
    if isinstance(err, dict):
        code = err.get("code")
        return (
            str(err.get("message") or err),
            err.get("type"),
            code if isinstance(code, str) else None,
        )
    return str(err), None, None


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def status_error(status: int, body: bytes, retry_after: str | None = None) -> HeadraceError:
    """The one mapping from a backend's non-200 answer to our error tree."""
    try:
        message, _, code = _error_fields(msgspec.json.decode(body))
    except msgspec.DecodeError:
        message, code = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}", None
    if status == 429:  # healthy but throttling: the router cools it down and moves on
        return UpstreamRateLimited(message, retry_after=_retry_after(retry_after))
    if status == 503:
        return BackendUnavailable(message, retry_after=_retry_after(retry_after))
    if status == 400 and (code == "context_length_exceeded" or "context length" in message.lower()):
        return ContextLengthExceeded(message)
    known: dict[int, type[HeadraceError]] = {
        400: BadRequest, 401: Unauthorized, 403: Unauthorized, 404: ModelNotFound, 405: MethodNotAllowed,
        408: BackendTimeout, 413: PayloadTooLarge, 422: BadRequest, 504: BackendTimeout,
    }  # fmt: skip
    if status in known:
        return known[status](message)
    if 400 <= status < 500:
        exc = ClientError(message)
        exc.status = status
        return exc
    if status >= 500:
        return UpstreamError(message)
    return BackendProtocolError(f"unexpected HTTP {status}: {message}")


def transport_error(exc: BaseException, *, started: bool) -> HeadraceError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(
        exc, (httpx.ConnectTimeout, httpx.PoolTimeout)
    ):
        return BackendTimeout(f"backend timed out: {exc!r}")
    if started:
        return StreamBroken(f"backend stream broke: {exc!r}")
    return BackendUnavailable(f"backend unreachable: {exc!r}")


# ---------------------------------------------------------------- /v1/models, /v1/kv_events


def engine_fields(data: list[Any]) -> dict[str, Any]:
    """The engine's additions to ``/v1/models`` (the first entry that has
    each, of the right type), as :class:`BackendInfo` fields. ``kv_events``
    holds if any entry says so; ``token_ids``, ``exact_resume`` and
    ``prefix_sharing`` only if every entry that says one says true."""
    found: dict[str, Any] = {}
    for entry in data:
        if not isinstance(entry, dict):
            continue
        block, kv, tok = entry.get("block_size"), entry.get("kv_events"), entry.get("tokenizer")
        capacity = entry.get("kv_capacity_blocks")
        epoch = entry.get("kv_epoch")
        for name in ("token_ids", "exact_resume", "prefix_sharing"):
            if isinstance(entry.get(name), bool):
                found[name] = found.get(name, True) and entry[name]
        if isinstance(epoch, str) and epoch:
            found.setdefault("kv_epoch", epoch)
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:
            found.setdefault("block_size", block)
        if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
            found.setdefault("kv_capacity_blocks", capacity)
        if isinstance(kv, bool):
            found["kv_events"] = found.get("kv_events", False) or kv
        if isinstance(tok, str) and tok:
            found.setdefault("tokenizer", tok)
    return found


class KVEventParser:
    """``/v1/kv_events`` bytes -> :class:`KVEvent` (sans-I/O). Lines end in
    LF (CRLF too); ``id:`` and ``data:`` fill an event, a blank line ends it,
    ``:`` lines are comments, ``event:``/``retry:`` are ignored. Anything else,
    JSON that is not a KVEvent, an ``id`` that is not its ``seq``, or a line
    past 1 MiB is :class:`BackendProtocolError`."""

    MAX_LINE = 1 << 20

    def __init__(self) -> None:
        self.events = 0
        self._buffer = b""
        self._id: str | None = None
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> Iterator[KVEvent]:
        """The events ``chunk`` completes, lazily: a bad line raises after the
        events before it have been taken."""
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()
        for raw in lines:
            event = self._line(raw.removesuffix(b"\r"))
            if event is not None:
                yield event
        if len(self._buffer) > self.MAX_LINE:
            raise BackendProtocolError("/v1/kv_events: a line longer than 1 MiB")

    def _line(self, line: bytes) -> KVEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(b":"):
            return None
        name, colon, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if name == b"data" and colon:
            self._data.append(value)
        elif name == b"id" and colon:
            self._id = value.decode("ascii", "replace")
        elif name not in (b"event", b"retry") or not colon:
            raise BackendProtocolError(f"/v1/kv_events: not an SSE line: {line[:200]!r}")
        return None

    def _dispatch(self) -> KVEvent | None:
        if not self._data:
            self._id = None
            return None
        data, ident = b"\n".join(self._data), self._id
        self._data, self._id = [], None
        try:
            event = msgspec.json.decode(data, type=KVEvent)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendProtocolError(f"/v1/kv_events: not a KV event ({exc}): {data[:200]!r}") from None
        if ident is not None and ident != str(event.seq):
            raise BackendProtocolError(f"/v1/kv_events: id {ident!r} is not the event's seq {event.seq}")
        self.events += 1
        return event

"""A small OpenAI-compatible ASGI server, the suite's own test target.

It implements the contract the conformance suite checks (completions and
chat, SSE, usage, n, logprobs, the vLLM ``return_token_ids`` extension, token
id prompts, OpenAI errors, bounded admission with 503 + Retry-After, slots
freed on disconnect), and each entry of ``flaws`` breaks one clause, so the
tests can prove that the matching check fails.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
import trio

from .reference_model import VOCAB, Generation, Sampling, alternatives, generate, tokenize

FLAWS = frozenset({
    "no_done", "unstable_ids", "error_status_500", "no_error_shape", "stop_no_straddle",
    "leak_on_disconnect", "no_retry_after", "bad_usage", "seed_ignored", "resume_drift",
    "max_tokens_off_by_one", "no_role", "no_models", "logprob_tokens_empty",
    "logprob_tokens_collide",
})


class CompletionBody(msgspec.Struct, kw_only=True):
    model: str
    prompt: str | list[int] = ""
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: int | bool | None = None
    top_logprobs: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class Disconnected(Exception):
    """The client went away before its request body arrived."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class ReferenceServer:
    def __init__(self, flaws: frozenset[str] = frozenset(), *, max_running: int = 4,
                 max_waiting: int = 4, token_delay: float = 0.001, max_context: int = 512,
                 model: str = "ref-model", token_ids: bool = True) -> None:
        unknown = set(flaws) - FLAWS
        if unknown:
            raise ValueError(f"unknown flaws {sorted(unknown)}")
        self.flaws, self.model, self.max_context = frozenset(flaws), model, max_context
        self.token_delay, self.max_waiting = token_delay, max_waiting
        self.token_ids = token_ids  # False: ignore the return_token_ids extension
        self.slots = trio.Semaphore(max_running)
        self.waiting = 0
        self._ids = itertools.count()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        try:
            await self._route(scope, receive, send)
        except ApiError as exc:
            await self._error(send, exc)
        except Disconnected:
            pass

    async def _route(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/v1/models" and method == "GET" and "no_models" not in self.flaws:
            entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "reference",
                     "max_model_len": self.max_context}
            return await _json(send, 200, {"object": "list", "data": [entry]})
        kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(path)
        if kind is None or method != "POST":
            raise ApiError(404, f"no route {method} {path}")
        body = self._decode(await _read_body(receive))
        body.return_token_ids = body.return_token_ids and self.token_ids
        await self._admit_and_run(kind, body, receive, send)

    def _decode(self, raw: bytes) -> CompletionBody:
        try:
            body = msgspec.json.decode(raw, type=CompletionBody)
        except msgspec.ValidationError as exc:
            raise ApiError(400, f"invalid request: {exc}", param=None) from None
        except msgspec.DecodeError as exc:
            raise ApiError(500 if "error_status_500" in self.flaws else 400, f"bad JSON: {exc}") from None
        if body.model != self.model:
            raise ApiError(404, f"model {body.model!r} does not exist", code="model_not_found")
        return body

    async def _admit_and_run(self, kind: str, body: CompletionBody, receive: Any, send: Any) -> None:
        try:
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            if self.waiting >= self.max_waiting:
                raise ApiError(503, "overloaded, retry later", code="overloaded") from None
            self.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                self.waiting -= 1
        disconnected = False
        try:
            disconnected = await self._run(kind, body, receive, send)
        finally:
            if not (disconnected and "leak_on_disconnect" in self.flaws):
                self.slots.release()

    async def _run(self, kind: str, body: CompletionBody, receive: Any, send: Any) -> bool:
        prompt = self._prompt_ids(kind, body)
        sampling = Sampling(max_tokens=body.max_tokens or 16, temperature=body.temperature,
                            seed=body.seed, ignore_eos=body.ignore_eos,
                            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []))
        gens = [generate(prompt, sampling, self.flaws, choice=i) for i in range(body.n)]
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{next(self._ids)}"
        render = Renderer(kind, body, rid, self.model, prompt, self.flaws)
        if not body.stream:
            await trio.sleep(self.token_delay * max(len(g.ids) for g in gens))
            await _json(send, 200, render.whole(gens))
            return False
        return await self._stream(render, gens, receive, send)

    def _prompt_ids(self, kind: str, body: CompletionBody) -> list[int]:
        if kind == "chat":
            if body.messages is None:
                raise ApiError(400, "messages is required", param="messages")
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body.messages)
            ids = tokenize(text + "<assistant>")
        else:
            ids = tokenize(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if any(not 0 < i < len(VOCAB) for i in ids):
            raise ApiError(400, "prompt token id out of range", param="prompt")
        if len(ids) + 1 > self.max_context:
            raise ApiError(400, f"prompt of {len(ids)} tokens exceeds the context of "
                           f"{self.max_context}", code="context_length_exceeded", param="prompt")
        return ids

    async def _stream(self, render: Renderer, gens: list[Generation], receive: Any, send: Any) -> bool:
        gone = finished = False

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = not finished
            scope.cancel()

        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            for chunk in render.chunks(gens):
                if chunk.get("choices"):
                    await trio.sleep(self.token_delay)
                await send({"type": "http.response.body", "body": _sse(chunk), "more_body": True})
            finished = True
            tail = b"" if "no_done" in self.flaws else b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            nursery.cancel_scope.cancel()
        return gone

    async def _error(self, send: Any, exc: ApiError) -> None:
        doc: dict[str, Any] = {"error": {"message": exc.message, "type": "invalid_request_error"
                               if exc.status < 500 else "server_error", "param": exc.param,
                               "code": exc.code}}
        if "no_error_shape" in self.flaws:
            doc = {"detail": exc.message}
        headers = [(b"retry-after", b"1")] if exc.status == 503 and "no_retry_after" not in self.flaws else []
        await _json(send, exc.status, doc, headers)


class Renderer:
    """Turns generations into OpenAI documents: whole responses or chunks."""

    def __init__(self, kind: str, body: CompletionBody, rid: str, model: str, prompt: list[int],
                 flaws: frozenset[str]) -> None:
        self.kind, self.body, self.rid, self.model = kind, body, rid, model
        self.prompt, self.flaws = prompt, flaws
        self.counter = itertools.count()

    def _head(self, chunk: bool) -> dict[str, Any]:
        rid = f"{self.rid}-{next(self.counter)}" if chunk and "unstable_ids" in self.flaws else self.rid
        obj = {"completion": "text_completion", "chat": "chat.completion"}[self.kind]
        if chunk and self.kind == "chat":
            obj = "chat.completion.chunk"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model}

    def usage(self, gens: list[Generation]) -> dict[str, int]:
        done = sum(len(g.ids) for g in gens) + (1 if "bad_usage" in self.flaws else 0)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": done,
                "total_tokens": len(self.prompt) + done}

    def whole(self, gens: list[Generation]) -> dict[str, Any]:
        doc = {**self._head(False), "choices": [self._choice(i, g) for i, g in enumerate(gens)],
               "usage": self.usage(gens)}
        if self.body.return_token_ids and self.kind == "chat":
            doc["prompt_token_ids"] = self.prompt
        return doc

    def _choice(self, index: int, g: Generation) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": g.finish,
                                  "logprobs": self._logprobs(g, range(len(g.ids)))}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": g.text}
        else:
            choice["text"] = g.text
        if self.body.return_token_ids:
            choice["token_ids"] = g.ids
            if self.kind == "completion":
                choice["prompt_token_ids"] = self.prompt
        return choice

    def chunks(self, gens: list[Generation]) -> Any:
        for index in range(len(gens)):
            if self.kind == "chat":
                yield self._chunk(index, {"delta": {} if "no_role" in self.flaws
                                          else {"role": "assistant", "content": ""}}, first=True)
        for step in range(max(len(g.ids) for g in gens)):
            for index, g in enumerate(gens):
                if step < len(g.ids):
                    yield self._token_chunk(index, g, step)
        for index, g in enumerate(gens):
            yield self._chunk(index, self._text("") | {"finish_reason": g.finish})
        options = self.body.stream_options or {}
        if options.get("include_usage"):
            yield {**self._head(True), "choices": [], "usage": self.usage(gens)}

    def _token_chunk(self, index: int, g: Generation, step: int) -> dict[str, Any]:
        extra: dict[str, Any] = self._text(g.pieces[step])
        extra["logprobs"] = self._logprobs(g, range(step, step + 1))
        if self.body.return_token_ids:
            extra["token_ids"] = [g.ids[step]]
            if step == 0 and self.kind == "completion":
                extra["prompt_token_ids"] = self.prompt
        return self._chunk(index, extra, first=step == 0 and self.kind == "completion")

    def _text(self, piece: str) -> dict[str, Any]:
        return {"delta": {"content": piece}} if self.kind == "chat" else {"text": piece}

    def _chunk(self, index: int, fields: dict[str, Any], first: bool = False) -> dict[str, Any]:
        choice = {"index": index, "finish_reason": None, **fields}
        doc = {**self._head(True), "choices": [choice]}
        if first and self.kind == "chat" and self.body.return_token_ids:
            choice["token_ids"] = []
            doc["prompt_token_ids"] = self.prompt
        return doc

    def _logprobs(self, g: Generation, steps: range) -> Any:
        want = self.body.logprobs
        if want is None or want is False:
            return None
        k = (self.body.top_logprobs or 0) if self.kind == "chat" else int(want)
        empty = "logprob_tokens_empty" in self.flaws  # ids only, no token text (text_offset all 0)
        collide = "logprob_tokens_collide" in self.flaws  # every alternative named like the chosen token

        def name(token: int, chosen: int) -> str:
            return "" if empty else VOCAB[chosen if collide else token]

        entries = [(g.ids[i], g.logprobs[i], alternatives(g.ids[i], k - 1)) for i in steps]
        if self.kind == "chat":
            return {"content": [_chat_lp(name(t, t), lp, [name(a, t) for a in alts])
                                for t, lp, alts in entries]}
        offsets = [0] * len(entries) if empty else _offsets(g, steps)
        return {"tokens": [name(t, t) for t, _, _ in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [{name(t, t): lp} | {name(a, t): lp - 0.5 - j for j, a in enumerate(alts)}
                                 for t, lp, alts in entries],
                "text_offset": offsets}


def _offsets(g: Generation, steps: range) -> list[int]:
    """Where each token of ``steps`` starts in the choice's text."""
    pos = sum(len(p) for p in g.pieces[: steps.start])
    out = []
    for i in steps:
        out.append(pos)
        pos += len(g.pieces[i]) if i < len(g.pieces) else 0
    return out


def _chat_lp(token: str, lp: float, alts: list[str]) -> dict[str, Any]:
    top = [{"token": token, "logprob": lp, "bytes": list(token.encode())}]
    top += [{"token": a, "logprob": lp - 0.5 - j, "bytes": list(a.encode())} for j, a in enumerate(alts)]
    return {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": top}


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"


async def _read_body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _json(send: Any, status: int, doc: Any, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": msgspec.json.encode(doc)})

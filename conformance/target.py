"""The HTTP side of the suite: a client for one OpenAI-compatible target and
the probe that finds out what it claims.

Capability detection is by asking, not by configuration: the probe sends the
vLLM-style extension ``return_token_ids: true`` and looks for ``token_ids`` /
``prompt_token_ids`` in the answer, and reads ``/v1/models`` for the model
list and context length. ``--without CAP`` on the command line withdraws a
claim the probe cannot see (a backend that accepts ``seed`` but does not honour
it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from .sse import SSEStream, parse_sse

__all__ = [
    "Capabilities",
    "HttpTarget",
    "ProbeError",
    "Reply",
    "StreamReply",
    "open_client",
    "probe",
]

CAPABILITIES = ("token_ids", "seeds", "ignore_eos", "exact_resume")


class ProbeError(Exception):
    """The target could not be probed at all (unreachable, no model)."""


@dataclass
class Reply:
    status: int
    headers: httpx.Headers
    body: bytes
    json: Any = None  # decoded body, None when it is not JSON


@dataclass
class StreamReply:
    status: int
    headers: httpx.Headers
    body: bytes
    sse: SSEStream
    json: Any = None  # the decoded body of a non-2xx answer

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return self.sse.chunks


@dataclass
class Capabilities:
    token_ids: bool = False
    seeds: bool = True
    ignore_eos: bool = False
    # /v1/models says exact_resume: the target takes ``resumed_tokens`` (the
    # resume contract stream migration relies on) and continues exactly
    exact_resume: bool = False
    models: list[str] = field(default_factory=list)
    max_context: int | None = None

    def as_dict(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in CAPABILITIES}


@dataclass
class HttpTarget:
    """What an HTTP check receives: a client, the model to use, the claims and
    the knobs that size the load checks."""

    client: httpx.AsyncClient
    model: str = ""
    caps: Capabilities = field(default_factory=Capabilities)
    concurrency: int = 8
    burst: int = 32
    grace: float = 5.0  # seconds (plus 4x a short request) before capacity counts as leaked
    # A new client with the same settings: a check that must really disconnect
    # closes its own connection (httpx over HTTP/2 does not reset a stream
    # whose response is closed early; closing the connection always works).
    new_client: Callable[[], httpx.AsyncClient] | None = None

    async def get(self, path: str) -> Reply:
        response = await self.client.get(path)
        return Reply(response.status_code, response.headers, response.content, _json(response.content))

    async def post(self, path: str, body: dict[str, Any] | bytes, **kw: Any) -> Reply:
        content = body if isinstance(body, bytes) else msgspec.json.encode(body)
        headers = {"content-type": "application/json"}
        response = await self.client.post(path, content=content, headers=headers, **kw)
        return Reply(response.status_code, response.headers, response.content, _json(response.content))

    async def stream(self, path: str, body: dict[str, Any]) -> StreamReply:
        """POST with ``stream: true`` and read the whole event stream."""
        body = {**body, "stream": True}
        req = self.client.build_request("POST", path, content=msgspec.json.encode(body),
                                        headers={"content-type": "application/json"})
        response = await self.client.send(req, stream=True)
        try:
            raw = await response.aread()
        finally:
            await response.aclose()
        sse = parse_sse(raw) if response.status_code == 200 else SSEStream()
        return StreamReply(response.status_code, response.headers, raw, sse, _json(raw))

    def completion_body(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, **params}
        if self.caps.ignore_eos and body.pop("ignore_eos_if_supported", False):
            body["ignore_eos"] = True
        body.pop("ignore_eos_if_supported", None)
        if self.caps.token_ids and body.pop("token_ids_if_supported", False):
            body["return_token_ids"] = True
        body.pop("token_ids_if_supported", None)
        return body

    def chat_body(self, content: str, **params: Any) -> dict[str, Any]:
        body = self.completion_body("", **params)
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": content}]
        return body


def _json(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError:
        return None


def open_client(
    base_url: str, *, api_key: str | None = None, http: str = "auto", timeout: float = 60.0
) -> httpx.AsyncClient:
    """``http``: ``auto`` (HTTP/2 where ALPN offers it, else 1.1), ``2`` (HTTP/2
    with prior knowledge, also over cleartext) or ``1.1``."""
    if http not in {"auto", "2", "1.1"}:
        raise ValueError(f"http must be auto, 2 or 1.1, not {http!r}")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=32)
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        http1=http != "2",
        http2=http != "1.1",
        timeout=httpx.Timeout(timeout),
        limits=limits,
    )


async def probe(target: HttpTarget, without: frozenset[str] = frozenset()) -> None:
    """Fill ``target.model`` (when unset) and ``target.caps`` from the target."""
    models = await target.get("/v1/models")
    entries = _model_entries(models.json) if models.status == 200 else []
    target.caps.models = [str(e["id"]) for e in entries]
    if not target.model:
        if not target.caps.models:
            raise ProbeError(f"GET /v1/models gave {models.status} and no model; pass --model")
        target.model = target.caps.models[0]
    target.caps.max_context = target.caps.max_context or _context_length(entries, target.model)
    target.caps.exact_resume = any(e["id"] == target.model and e.get("exact_resume") is True for e in entries)
    await _probe_extensions(target)
    target.caps.exact_resume = target.caps.exact_resume and target.caps.token_ids
    for name in without:
        setattr(target.caps, name, False)


def _model_entries(doc: Any) -> list[dict[str, Any]]:
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return []
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]


def _context_length(entries: list[dict[str, Any]], model: str) -> int | None:
    """vLLM says ``max_model_len``; others ``context_length``; llama.cpp
    ``meta.n_ctx_train``."""
    for entry in entries:
        if entry["id"] != model:
            continue
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        for value in (entry.get("max_model_len"), entry.get("context_length"), meta.get("n_ctx_train")):
            if isinstance(value, int) and value > 0:
                return value
    return None


async def _probe_extensions(target: HttpTarget) -> None:
    base = {"model": target.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    reply = await target.post("/v1/completions", {**base, "return_token_ids": True, "ignore_eos": True})
    if reply.status == 200:
        target.caps.ignore_eos = True
        target.caps.token_ids = _has_token_ids(reply.json)
        return
    reply = await target.post("/v1/completions", {**base, "return_token_ids": True})
    if reply.status == 200:
        target.caps.token_ids = _has_token_ids(reply.json)
    reply = await target.post("/v1/completions", {**base, "ignore_eos": True})
    target.caps.ignore_eos = reply.status == 200


def _has_token_ids(doc: Any) -> bool:
    try:
        choice = doc["choices"][0]
    except (KeyError, IndexError, TypeError):
        return False
    prompt_ids = choice.get("prompt_token_ids", doc.get("prompt_token_ids"))
    return _int_list(choice.get("token_ids")) and _int_list(prompt_ids)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) for v in value)

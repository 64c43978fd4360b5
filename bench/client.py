"""One OpenAI-style request, timed: the unit the load generators repeat.

Times are taken from the request's *scheduled* start, not from when the client
got round to sending it, so a client that falls behind shows up as latency
(and as ``lag``) instead of hiding it: the coordinated-omission trap.

:class:`StreamTimer` is the sans-I/O part (bytes and timestamps in, a
:class:`RequestResult` out); :func:`send_request` is the httpx part. Transport
failures are counted by kind, never raised: a load test reports errors.
That holds for *any* exception out of a request, not only httpx's own: an
``h2.exceptions.ProtocolError`` escaping httpcore (issue 12, bug 4) once
killed a whole run without a report. httpx errors get a short kind
(``timeout``, ``connect``, ``protocol``...); anything else is named by its
type (``ProtocolError``), with the message in ``detail``.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx
import msgspec
import trio

from backends.h2client import H2Pool
from frontend.sse import SSEParser

__all__ = [
    "Endpoint",
    "RequestResult",
    "RequestSpec",
    "StreamTimer",
    "build_body",
    "classify",
    "leaf",
    "send_request",
]

Endpoint = Literal["completions", "chat"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What every request of a run asks for (only the prompt varies)."""

    model: str
    endpoint: Endpoint = "completions"
    max_tokens: int = 128
    stream: bool = True
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout: float = 300.0

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]


class RequestResult(msgspec.Struct, kw_only=True):
    """The outcome of one request; durations in seconds."""

    index: int
    scheduled: float  # offset of the planned start from the start of the run
    lag: float = 0.0  # how late the client actually sent it
    ttft: float | None = None  # to the first non-empty token chunk (streams only)
    e2e: float | None = None  # to the end of the response
    itl: list[float] = []  # gaps between token chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None  # None: success; else a kind such as "http_503", "timeout"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_body(spec: RequestSpec, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": spec.stream,
    }
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:  # a vLLM / headrace extension: generate exactly max_tokens
        body["ignore_eos"] = True
        body["min_tokens"] = spec.max_tokens
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


class StreamTimer:
    """Consumes an SSE completion stream and times its token chunks."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self._start = start
        self._parser = SSEParser()
        self._last: float | None = None
        self._chunks = 0
        self._usage_tokens: int | None = None
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        for event in self._parser.feed(data):
            self._event(event.data, now)

    def finish(self, now: float) -> RequestResult:
        for event in self._parser.close():
            self._event(event.data, now)
        r = self.result
        r.e2e = now - self._start
        r.output_tokens = self._usage_tokens if self._usage_tokens is not None else self._chunks
        if r.error is None and not self.done:
            r.error, r.detail = "truncated", "stream ended without [DONE]"
        return r

    def _event(self, data: str, now: float) -> None:
        if self.done or self.result.error is not None:
            return
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = msgspec.json.decode(data)
        except msgspec.DecodeError:
            self.result.error, self.result.detail = "bad_json", data[:200]
            return
        if not isinstance(chunk, dict):
            self.result.error, self.result.detail = "bad_json", data[:200]
        elif "error" in chunk:
            self.result.error, self.result.detail = "stream_error", data[:200]
        else:
            self._chunk(chunk, now)

    def _chunk(self, chunk: dict[str, Any], now: float) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage_tokens = int(usage.get("completion_tokens") or 0)
            self.result.prompt_tokens = usage.get("prompt_tokens")
        choices = chunk.get("choices") or []
        if not choices or not (_chunk_text(choices[0]) or choices[0].get("token_ids")):
            return
        if self._last is None:
            self.result.ttft = now - self._start
        else:
            self.result.itl.append(now - self._last)
        self._last = now
        self._chunks += 1


def leaf(exc: BaseException) -> BaseException:
    """The exception inside a group of one (trio wraps errors from nurseries)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def classify(exc: BaseException) -> str:
    """The error kind a failed request is counted under."""
    exc = leaf(exc)
    if not isinstance(exc, httpx.HTTPError):
        return type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.RemoteProtocolError | httpx.LocalProtocolError):
        return "protocol"
    if isinstance(exc, httpx.ReadError | httpx.WriteError | httpx.CloseError):
        return "read"
    return "transport"


async def _stream(client: httpx.AsyncClient, spec: RequestSpec, body: dict[str, Any],
                  result: RequestResult, start: float) -> None:
    async with client.stream("POST", spec.path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            result.error, result.detail = f"http_{response.status_code}", text[:200]
            result.e2e = trio.current_time() - start
            return
        timer = StreamTimer(result, start)
        async for data in response.aiter_raw():
            timer.feed(data, trio.current_time())
        timer.finish(trio.current_time())


async def _unary(client: httpx.AsyncClient, spec: RequestSpec, body: dict[str, Any],
                 result: RequestResult, start: float) -> None:
    response = await client.post(spec.path, json=body)
    result.e2e = trio.current_time() - start
    if response.status_code != 200:
        result.error, result.detail = f"http_{response.status_code}", response.text[:200]
        return
    _usage(result, response.content)


_JSON_HEADERS = [("content-type", "application/json")]


async def _lean(pool: H2Pool, spec: RequestSpec, body: dict[str, Any],
                result: RequestResult, start: float) -> None:
    """:func:`_stream` and :func:`_unary` over the lean HTTP/2 client."""
    data = msgspec.json.encode(body)
    async with pool.stream("POST", spec.path, headers=_JSON_HEADERS, body=data) as response:
        if response.status != 200 or not spec.stream:
            content = await response.read()
            result.e2e = trio.current_time() - start
            if response.status != 200:
                text = content.decode("utf-8", "replace")
                result.error, result.detail = f"http_{response.status}", text[:200]
                return
            _usage(result, content)
            return
        timer = StreamTimer(result, start)
        async for chunk in response:
            timer.feed(chunk, trio.current_time())
        timer.finish(trio.current_time())


def _usage(result: RequestResult, content: bytes) -> None:
    try:
        usage = msgspec.json.decode(content).get("usage") or {}
    except (msgspec.DecodeError, AttributeError):
        result.error, result.detail = "bad_json", content[:200].decode("utf-8", "replace")
        return
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    result.prompt_tokens = usage.get("prompt_tokens")


async def send_request(client: httpx.AsyncClient | H2Pool, spec: RequestSpec, prompt: str, *,
                       index: int, start: float, run_start: float) -> RequestResult:
    """Send one request planned for ``start`` (trio clock) and time it, with
    httpx or the lean HTTP/2 client (``backends.h2client``: ~0.35 ms of CPU a
    streamed request against httpx's ~1.3, which on two cores is the client
    leaving the CPU to the server it measures).

    Never raises for network or server faults: they become ``result.error``."""
    result = RequestResult(index=index, scheduled=start - run_start,
                           lag=max(0.0, trio.current_time() - start))
    body = build_body(spec, prompt)
    with trio.move_on_after(spec.timeout) as scope:
        try:
            if isinstance(client, H2Pool):
                await _lean(client, spec, body, result, start)
            else:
                await (_stream if spec.stream else _unary)(client, spec, body, result, start)
        except Exception as exc:  # any failure is a result, never the end of the run
            inner = leaf(exc)
            result.error, result.detail = classify(inner), f"{type(inner).__name__}: {inner}"[:200]
            result.e2e = trio.current_time() - start
    if scope.cancelled_caught:
        result.error, result.detail = "timeout", f"no complete answer within {spec.timeout} s"
        result.e2e = trio.current_time() - start
    return result

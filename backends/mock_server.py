"""``headrace mock``: the deterministic mock backend as an OpenAI-compatible
server, with faults injected at the HTTP level.

The wire format is the shared frontend's (``backends.openai_server``), so the
mock speaks exactly what the router and the engine speak. Faults live in a
small ASGI middleware around that app, :class:`FaultInjector`, which watches
the SSE chunks the frontend sends and, on a request drawn to fail (a
deterministic draw at ``--fault-rate``), breaks the response the way a real
server breaks::

    status=500|503[:retry-after=S], 429[:retry-after=S]  refuse before the app runs
    cut-after=N        after N tokens, end the app without finishing the body:
                       HTTP/1.1 closes the connection, HTTP/2 resets the stream
    stall-after=N      after N tokens, stop sending; keep the connection open
    malformed-after=N  after N tokens, send a garbage ``data:`` line and end
    no-done            end the stream without ``data: [DONE]``
    slow-first-token=MS  delay the response head (and so the first token)

``GET /stats`` reports the backend's counters (in flight, cancelled...) so a
test in another process can see a cancellation arrive.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import trio

from backends.mock import Fault, MockBackend, MockConfig, fault_applies, parse_fault
from backends.openai_server import HTTPRequest, OpenAIServer, Response, json_response
from backends.openai_wire import error_body
from backends.serving import ServeOptions, serve, wait_for_signal

__all__ = ["FaultInjector", "build_app", "main"]

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/generate"})
GARBAGE = b'data: {"choices": [{"text": "\n\n'
_DONE = b"data: [DONE]\n\n"
_STATUS_ERRORS = {
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "backend_unavailable"),
}

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _Cut(Exception):
    """Abandon the response mid-body (the transport is torn down)."""


class _Stop(Exception):
    """End the response body cleanly, now."""


class FaultInjector:
    """ASGI middleware: apply ``faults`` to a deterministic fraction ``rate``
    of generation requests; everything else passes through untouched."""

    def __init__(
        self, app: ASGIApp, faults: Sequence[Fault], *, rate: float = 1.0, seed: int = 0
    ) -> None:
        self.app, self.faults, self.rate, self.seed = app, list(faults), rate, seed
        self.requests = 0
        self.injected = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self._eligible(scope):
            await self.app(scope, receive, send)
            return
        index, self.requests = self.requests, self.requests + 1
        if not fault_applies(self.seed, index, self.rate):
            await self.app(scope, receive, send)
            return
        self.injected += 1
        status = next((f for f in self.faults if f.kind == "status"), None)
        if status is not None:
            await _refuse(status, receive, send)
            return
        try:
            await self.app(scope, receive, _FaultySend(send, self.faults))
        except* _Cut:
            pass  # returning mid-body: hypercorn closes the connection / resets the stream
        except* _Stop:
            await send({"type": "http.response.body", "body": b""})

    def _eligible(self, scope: dict[str, Any]) -> bool:
        return (
            bool(self.faults)
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_PATHS
        )


class _FaultySend:
    """Wraps ASGI ``send``: counts tokens in outgoing SSE chunks and breaks the
    response once a fault's ``after`` is reached."""

    def __init__(self, send: Any, faults: list[Fault]) -> None:
        self.send = send
        self.delay = sum(f.delay_s for f in faults if f.kind == "slow_first_token")
        self.breaking = [f for f in faults if f.kind in ("cut", "stall", "malformed")]
        self.no_done = any(f.kind == "no_done" for f in faults)
        self.sse = False
        self.tokens = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await trio.sleep(self.delay)
            headers = dict(message.get("headers", []))
            self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and message.get("body"):
            body: bytes = message["body"]
            if self.sse and body == _DONE and self.no_done:
                return
            await self._maybe_break()
            self.tokens += _count_tokens(body) if self.sse else 0
        await self.send(message)

    async def _maybe_break(self) -> None:
        due = [f for f in self.breaking if f.after <= self.tokens or not self.sse]
        if not due:
            return
        kind = due[0].kind
        if kind == "cut":
            raise _Cut
        if kind == "stall":
            await trio.sleep_forever()
        await self.send({"type": "http.response.body", "body": GARBAGE, "more_body": True})
        raise _Stop


def _count_tokens(chunk: bytes) -> int:
    """Tokens in one SSE event as the frontend frames it (one event per send)."""
    payload = chunk.strip().removeprefix(b"data:").strip()
    try:
        obj = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return 0
    if not isinstance(obj, dict):
        return 0
    if isinstance(obj.get("choices"), list):
        return sum(
            max(1, len(c.get("token_ids") or [])) for c in obj["choices"] if isinstance(c, dict)
        )
    return len(obj.get("token_ids") or [])


async def _refuse(fault: Fault, receive: Any, send: Any) -> None:
    while True:  # drain the request body first, as a real server would
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    type_, code = _STATUS_ERRORS.get(fault.status, ("server_error", None))
    body = msgspec.json.encode(
        error_body(f"injected fault: status {fault.status}", type_, None, code)
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if fault.retry_after is not None:
        headers.append((b"retry-after", str(max(0, round(fault.retry_after))).encode()))
    await send({"type": "http.response.start", "status": fault.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(
    backend: MockBackend, faults: Sequence[Fault] = (), *, fault_rate: float = 1.0, seed: int = 0
) -> FaultInjector:
    """The mock's ASGI app: the shared frontend plus ``GET /stats``, wrapped
    in the fault injector."""
    injector: FaultInjector

    async def stats(request: HTTPRequest) -> Response:
        counters = msgspec.structs.asdict(backend.statistics())
        counters.update(requests=injector.requests, faults_injected=injector.injected)
        return json_response(counters)

    server = OpenAIServer(backend, extra_routes={("GET", "/stats"): stats})
    injector = FaultInjector(server, faults, rate=fault_rate, seed=seed)
    return injector


# ---------------------------------------------------------------- command line


def _fault(spec: str) -> Fault:
    try:
        return parse_fault(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="headrace mock", description="A deterministic OpenAI-compatible mock backend."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    p.add_argument("--tpot-ms", type=float, default=0.0, help="time per output token")
    p.add_argument("--max-tokens", type=int, default=256, help="output length cap")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="served model name (repeatable)",
    )
    p.add_argument(
        "--fault",
        action="append",
        type=_fault,
        default=[],
        metavar="SPEC",
        help="see the module docs (repeatable)",
    )
    p.add_argument(
        "--fault-rate", type=float, default=1.0, help="fraction of requests hit by the faults"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for fault draws and for seedless requests"
    )
    p.add_argument("--certfile")
    p.add_argument("--keyfile")
    return p


def _config(args: argparse.Namespace) -> MockConfig:
    return MockConfig(
        ttft_s=args.ttft_ms / 1000,
        tpot_s=args.tpot_ms / 1000,
        max_tokens=args.max_tokens,
        max_context=args.max_context,
        models=tuple(args.models or ("mock",)),
        seed=args.seed,
    )


async def _serve(args: argparse.Namespace) -> None:
    backend = MockBackend(_config(args))
    app = build_app(backend, args.fault, fault_rate=args.fault_rate, seed=args.seed)
    options = ServeOptions(
        args.host, args.port, certfile=args.certfile, keyfile=args.keyfile, graceful_timeout=5.0
    )
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_signal, shutdown)
        url = await nursery.start(partial(serve, app, options, shutdown=shutdown))
        print(f"mock listening on {url}", flush=True)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    bad = [
        ("--max-tokens", args.max_tokens < 1),
        ("--max-context", args.max_context < 1),
        ("--fault-rate", not 0.0 <= args.fault_rate <= 1.0),
        ("--ttft-ms/--tpot-ms", args.ttft_ms < 0 or args.tpot_ms < 0),
        ("--certfile/--keyfile", (args.certfile is None) != (args.keyfile is None)),
    ]
    for name, is_bad in bad:
        if is_bad:
            print(f"headrace mock: bad {name}", file=sys.stderr)
            return 2
    try:
        trio.run(_serve, args)
    except KeyboardInterrupt:
        return 130
    except (OSError, BaseExceptionGroup) as exc:
        error = _os_error(exc)
        if error is None:
            raise
        print(f"headrace mock: cannot serve: {error}", file=sys.stderr)
        return 1
    return 0


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError (a port in use, a bad certificate path) inside a trio
    exception group, if that is all it holds."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None

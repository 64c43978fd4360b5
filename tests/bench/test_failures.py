"""A load generator records every failure and always writes its report.

Issue 12, bug 4: ``headrace bench`` died on an ``h2.exceptions.ProtocolError``
escaping httpcore (the client caught only ``httpx.HTTPError``) and wrote no
JSON. Any exception out of one request is now that request's error, counted
by type; and a run stopped early (Ctrl-C, a crash) still writes what it has."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import h2.exceptions
import httpx
import pytest
import trio

import bench.loadgen
from backends.h2client import H2Pool
from backends.mock import parse_fault
from bench.cli import main
from bench.client import RequestResult, RequestSpec, send_request
from bench.loadgen import LoadConfig, run_open_loop
from tests.bench.fake_openai import FakeOpenAI, serve_in_thread

SPEC = RequestSpec(model="m", max_tokens=4, timeout=5.0)


def _client(handler: httpx.MockTransport) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://test", transport=handler)


async def _send(client: httpx.AsyncClient | H2Pool, spec: RequestSpec = SPEC) -> RequestResult:
    now = trio.current_time()
    return await send_request(client, spec, "hi", index=0, start=now, run_start=now)


async def test_an_h2_protocol_error_from_the_transport_is_an_error_not_a_crash() -> None:
    def explode(request: httpx.Request) -> httpx.Response:
        raise h2.exceptions.ProtocolError("Invalid input ConnectionInputs.RECV_HEADERS")

    async with _client(httpx.MockTransport(explode)) as client:
        result = await _send(client)
    assert result.error == "ProtocolError"
    assert "RECV_HEADERS" in result.detail and result.e2e is not None


class _BreaksMidStream(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        raise h2.exceptions.StreamClosedError(1)


async def test_an_exception_mid_stream_is_recorded_by_its_type() -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_BreaksMidStream())

    async with _client(httpx.MockTransport(respond)) as client:
        result = await _send(client)
    assert result.error == "StreamClosedError" and result.ttft is not None


async def test_any_exception_counts_and_an_exception_group_is_named_by_its_leaf() -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        raise ExceptionGroup("wrapped", [ValueError("odd")])

    async with _client(httpx.MockTransport(respond)) as client:
        result = await _send(client, RequestSpec(model="m", stream=False))
    assert result.error == "ValueError" and "odd" in result.detail


async def test_an_interrupted_open_loop_run_keeps_the_results_that_finished() -> None:
    results: list[RequestResult] = []

    async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        if index == 3:
            raise KeyboardInterrupt
        return RequestResult(index=index, scheduled=planned - run_start, e2e=0.001)

    with pytest.raises((KeyboardInterrupt, BaseExceptionGroup)):  # grouped by trio's nurseries
        await run_open_loop(LoadConfig(rate=200.0, duration=1.0), send, results=results)
    assert [r.index for r in results] == [0, 1, 2]


def _crash_after(n: int, exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests after the ``n``-th raise ``exc``, once one of the first
    ``n`` has finished (on a loaded box none had within the 100 ms of four
    requests at 40/s, and the report had nothing finished to hold)."""
    real = bench.loadgen.send_request  # type: ignore[attr-defined]
    calls = 0
    finished: trio.Event | None = None

    async def flaky(*args: object, **kwargs: object) -> RequestResult:
        nonlocal calls, finished
        if finished is None:
            finished = trio.Event()
        calls += 1
        if calls > n:
            with trio.move_on_after(30):
                await finished.wait()
            raise exc
        result = await real(*args, **kwargs)  # type: ignore[arg-type]
        finished.set()
        return result

    monkeypatch.setattr(bench.loadgen, "send_request", flaky)


@pytest.mark.parametrize(("exc", "rc"), [(KeyboardInterrupt(), 130), (RuntimeError("bug"), None)])
def test_the_cli_writes_its_report_when_the_run_stops_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    exc: BaseException, rc: int | None,
) -> None:
    _crash_after(4, exc, monkeypatch)
    out = tmp_path / "r.json"
    argv = ["--rps", "40", "--duration", "1", "--max-tokens", "2", "--json", str(out), "--no-plot"]
    with serve_in_thread(FakeOpenAI(ttft=0.001, gap=0.001)) as url:
        if rc is None:
            with pytest.raises((RuntimeError, BaseExceptionGroup)):  # the crash propagates
                main(["--target", url, *argv])
        else:
            assert main(["--target", url, *argv]) == rc
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["partial"] is True and run["counts"]["ok"] >= 1
    assert type(exc).__name__ in doc["interrupted"]
    assert "stopped early" in capsys.readouterr().err


async def test_the_lean_http2_client_times_a_stream_and_counts_a_reset_by_type() -> None:
    from backends.mock import MockBackend, MockConfig
    from backends.mock_http import serve_lean
    from backends.mock_server import build_app
    from bench.connect import make_pool
    from frontend.serving import ServeOptions

    async with trio.open_nursery() as nursery:
        fine = build_app(MockBackend(MockConfig(max_tokens=5)))
        url = await nursery.start(serve_lean, fine, ServeOptions())
        cut = build_app(MockBackend(), [parse_fault("cut-after=2")])
        cut_url = await nursery.start(serve_lean, cut, ServeOptions())
        spec = RequestSpec(model="mock", max_tokens=5, timeout=5.0)
        async with make_pool(url, max_connections=1, api_key=None, timeout=5.0) as pool:
            result = await _send(pool, spec)
        assert result.ok and result.output_tokens == 5 and result.ttft is not None
        async with make_pool(cut_url, max_connections=1, api_key=None, timeout=5.0) as pool:
            result = await _send(pool, spec)
        assert result.error == "StreamReset" and result.e2e is not None
        nursery.cancel_scope.cancel()


def test_a_stop_by_several_errors_at_once_is_named_by_them() -> None:
    from bench.cli import describe_stop

    both = BaseExceptionGroup("two", [KeyboardInterrupt(), BaseExceptionGroup("inner", [KeyboardInterrupt()])])
    assert describe_stop(both).startswith("KeyboardInterrupt: ") and describe_stop(both).endswith("(and 1 more)")
    assert describe_stop(RuntimeError("bug")) == "RuntimeError: bug"

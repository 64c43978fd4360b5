"""``headrace mock`` over real HTTP: what a plain client sees for each
HTTP-level fault, ``/stats``, and the command run as a subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from contextlib import aclosing
from functools import partial

import h2.connection
import h2.events
import httpx
import pytest
import trio

from backends.base import GenerateRequest
from backends.mock import Fault, MockBackend, MockConfig, fault_applies, parse_fault
from backends.mock_http import serve_lean
from backends.mock_server import build_app, main
from backends.openai_http import OpenAIHTTPBackend
from frontend.server import OpenAIServer
from frontend.serving import ServeOptions, serve
from tests.backends.conftest import Served, eventually, serve_mock

BODY = {"prompt": "hi", "max_tokens": 8, "stream": True, "return_token_ids": True, "seed": 1}


@pytest.fixture(params=["hypercorn", "lean"])
def server(request: pytest.FixtureRequest) -> str:
    """Every HTTP-level fault behaves the same on both servers ``headrace mock`` has."""
    return str(request.param)


async def _serve(
    nursery: trio.Nursery,
    server: str,
    faults: Sequence[Fault] = (),
    *,
    config: MockConfig | None = None,
    fault_rate: float = 1.0,
) -> Served:
    if server == "hypercorn":
        return await serve_mock(nursery, config, faults, fault_rate=fault_rate)
    backend = MockBackend(config)
    app = build_app(backend, faults, fault_rate=fault_rate)
    options = ServeOptions(graceful_timeout=0.5)
    url = await nursery.start(partial(serve_lean, app, options, answer_now=app.answer_now))
    return Served(url, backend, app)


def _client(url: str, h2: bool) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, http1=not h2, http2=h2)


def _data_lines(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


async def _read_until_error(
    client: httpx.AsyncClient, body: dict[str, object]
) -> tuple[list[str], BaseException | None]:
    lines: list[str] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
    except httpx.HTTPError as exc:
        return lines, exc
    return lines, None


@pytest.mark.parametrize("h2", [False, True])
async def test_cut_after_breaks_the_transport_not_a_clean_end(
    nursery: trio.Nursery, server: str, h2: bool
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("cut-after=2")])
    async with _client(served.url, h2) as client:
        lines, exc = await _read_until_error(client, BODY)
        assert isinstance(exc, httpx.RemoteProtocolError)
        assert len(lines) == 2 and "[DONE]" not in lines
        # The server (and, over HTTP/2, the connection) survives the cut.
        r = await client.get("/health")
        assert r.status_code == 200


async def test_stall_after_keeps_the_stream_open_and_silent(
    nursery: trio.Nursery, server: str
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("stall-after=1")])
    lines: list[str] = []
    async with _client(served.url, True) as client:
        with trio.move_on_after(0.3) as scope:
            # Long enough that the backend blocks on the frontend's full buffer.
            async with client.stream(
                "POST", "/v1/completions", json=BODY | {"max_tokens": 500}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
        assert scope.cancelled_caught and len(lines) == 1
        assert served.backend.statistics().in_flight == 1
    # A plain httpx client does not reset the stream; closing its connection does.
    await eventually(lambda: served.backend.statistics().cancelled == 1, 0.1)


async def test_malformed_after_sends_a_garbage_data_line(
    nursery: trio.Nursery, server: str
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("malformed-after=2")])
    async with _client(served.url, True) as client:
        r = await client.post("/v1/completions", json=BODY)
    lines = _data_lines(r.text)
    assert len(lines) == 3
    json.loads(lines[0]), json.loads(lines[1])
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[2])


async def test_no_done_ends_cleanly_without_done(nursery: trio.Nursery, server: str) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("no-done")])
    async with _client(served.url, False) as client:
        r = await client.post(
            "/v1/completions", json=BODY | {"stream_options": {"include_usage": True}}
        )
    lines = _data_lines(r.text)
    assert "[DONE]" not in lines and len(lines) == 9  # 8 tokens + usage
    assert json.loads(lines[7])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("spec", "status", "retry_after", "code"),
    [
        ("status=500", 500, None, None),
        ("status=503:retry-after=4", 503, "4", "backend_unavailable"),
        ("429:retry-after=2", 429, "2", "rate_limit_exceeded"),
    ],
)
async def test_status_faults_answer_with_openai_errors(
    nursery: trio.Nursery,
    server: str,
    spec: str,
    status: int,
    retry_after: str | None,
    code: str | None,
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault(spec)])
    async with _client(served.url, True) as client:
        r = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == status and r.headers.get("retry-after") == retry_after
        assert r.json()["error"]["code"] == code
        assert (await client.get("/v1/models")).status_code == 200  # only generation routes fail
    assert served.backend.statistics().started == 0


async def test_slow_first_token_delays_the_response(nursery: trio.Nursery, server: str) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("slow-first-token=200")])
    async with _client(served.url, True) as client:
        start = trio.current_time()
        r = await client.post("/v1/completions", json=BODY)
    assert trio.current_time() - start >= 0.2 and r.status_code == 200
    assert _data_lines(r.text)[-1] == "[DONE]"


async def test_fault_rate_picks_requests_deterministically_and_stats_count_them(
    nursery: trio.Nursery, server: str
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("status=500")], fault_rate=0.5)
    async with _client(served.url, True) as client:
        codes = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(12)]
        stats = (await client.get("/stats")).json()
    assert codes == [500 if fault_applies(0, i, 0.5) else 200 for i in range(12)]
    assert stats["requests"] == 12 and stats["faults_injected"] == codes.count(500)
    assert stats["completed"] == codes.count(200) and stats["in_flight"] == 0


def test_main_rejects_bad_options_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--fault-rate", "2"]) == 2
    assert main(["--certfile", "x.pem"]) == 2
    with pytest.raises(SystemExit):
        main(["--fault", "explode"])
    assert "bad fault" in capsys.readouterr().err


@pytest.mark.slow
async def test_headrace_mock_subprocess_serves_reports_cancellation_and_drains_on_sigterm() -> None:
    command = [
        sys.executable,
        "-m",
        "router.cli",
        "mock",
        "--port",
        "0",
        "--tpot-ms",
        "20",
        "--model",
        "m",
    ]
    proc = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        url = await _read_url(proc)
        client = OpenAIHTTPBackend(url, stall_timeout=5)  # h2 prior knowledge, across processes
        try:
            await client.refresh()
            assert client.info().models == ("m",)
            async with aclosing(
                client.stream(GenerateRequest(prompt="x", max_tokens=200))
            ) as events:
                async for _ in events:
                    break
            async with httpx.AsyncClient(base_url=url) as plain:
                start = trio.current_time()
                while (await plain.get("/stats")).json()["cancelled"] != 1:
                    assert trio.current_time() - start < 0.1, (
                        "the cancel did not reach the server in 100 ms"
                    )
        finally:
            await client.aclose()
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _read_url(proc: trio.Process) -> str:
    assert proc.stdout is not None
    buffer = b""
    with trio.fail_after(20):
        while b"\n" not in buffer:
            chunk = await proc.stdout.receive_some()
            assert chunk, "the mock exited before printing its URL"
            buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode()
    assert line.startswith("mock listening on http://127.0.0.1:")
    return line.rsplit(" ", 1)[1]


async def test_h2_request_whose_headers_and_body_arrive_together_is_read_whole(
    nursery: trio.Nursery,
) -> None:
    url = await nursery.start(serve, OpenAIServer(MockBackend()), ServeOptions())
    stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    headers = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":scheme", "http"),
        (":authority", "x"),
    ]
    conn.send_headers(1, [*headers, ("content-type", "application/json")])
    conn.send_data(1, json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), end_stream=True)
    await stream.send_all(conn.data_to_send())  # one write: HEADERS and DATA together
    status, body = None, b""
    with trio.fail_after(5):
        while True:
            events = conn.receive_data(await stream.receive_some())
            await stream.send_all(conn.data_to_send())
            for event in events:
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers)[b":status"]
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
            if any(isinstance(e, h2.events.StreamEnded) for e in events):
                break
    await stream.aclose()
    assert status == b"200", body


@pytest.mark.parametrize("h2", [False, True])
async def test_no_done_sends_the_final_and_usage_chunks_then_ends_the_body(
    nursery: trio.Nursery, server: str, h2: bool
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("no-done")])
    async with _client(served.url, h2) as client:
        body = BODY | {"stream_options": {"include_usage": True}}
        lines, exc = await _read_until_error(client, body)
    assert exc is None and "[DONE]" not in lines and len(lines) == 9
    assert json.loads(lines[7])["choices"][0]["finish_reason"] == "length"
    assert json.loads(lines[8])["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("h2", [False, True])
async def test_no_final_ends_the_body_cleanly_right_before_the_final_chunk(
    nursery: trio.Nursery, server: str, h2: bool
) -> None:
    served = await _serve(nursery, server, faults=[parse_fault("no-final")])
    async with _client(served.url, h2) as client:
        body = BODY | {"stream_options": {"include_usage": True}}
        lines, exc = await _read_until_error(client, body)
        chunks = [json.loads(line) for line in lines]
        assert exc is None and len(chunks) == 7  # of 8 tokens: the 8th came with the finish
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1] * 7
        assert (await client.get("/health")).status_code == 200


async def test_models_say_the_mock_resumes_exactly(nursery: trio.Nursery, server: str) -> None:
    served = await _serve(nursery, server)
    async with _client(served.url, True) as client:
        data = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["token_ids"], m["exact_resume"]) for m in data] == [("mock", True, True)]
    assert "block_size" not in data[0]  # the cache model is off


async def test_no_token_ids_mock_never_sends_ids_even_when_asked(
    nursery: trio.Nursery, server: str
) -> None:
    served = await _serve(nursery, server, config=MockConfig(token_ids=False))
    async with _client(served.url, True) as client:
        chat = {"messages": [{"role": "user", "content": "x"}]}
        for path, extra, logprobs in [("/v1/completions", {}, 2), ("/v1/chat/completions", chat, True)]:
            # streamed: the fast path; not streamed, or with logprobs: the frontend
            for shape in ({"stream": True}, {"stream": False}, {"stream": True, "logprobs": logprobs}):
                body = {k: v for k, v in (BODY | extra | shape).items() if not (extra and k == "prompt")}
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                assert "token_ids" not in r.text and '"seed"' not in r.text
                assert ("[DONE]" in r.text) == shape["stream"]
        native = await client.post("/v1/generate", json={"prompt": "hi", "max_tokens": 2})
        data = (await client.get("/v1/models")).json()["data"]
    assert native.status_code == 404
    assert (data[0]["token_ids"], data[0]["exact_resume"]) == (False, False)


async def test_diverge_gives_identical_http_requests_different_text(
    nursery: trio.Nursery, server: str
) -> None:
    served = await _serve(nursery, server, config=MockConfig(faults=[parse_fault("diverge")]))
    async with _client(served.url, True) as client:
        texts = [(await client.post("/v1/completions", json=BODY | {"stream": False})).json()
                 ["choices"][0]["text"] for _ in range(3)]
        data = (await client.get("/v1/models")).json()["data"]
    assert len(set(texts)) == 3
    assert (data[0]["token_ids"], data[0]["exact_resume"]) == (True, False)


def test_the_cli_gives_diverge_and_no_token_ids_to_the_backend_and_http_faults_to_the_injector(
) -> None:
    from backends.mock_server import _config, _parser

    args = _parser().parse_args(
        ["--fault", "diverge", "--fault", "no-final", "--no-token-ids", "--fault-rate", "0.5"]
    )
    config = _config(args)
    assert config.faults == (Fault(kind="diverge"),) and config.fault_rate == 0.5
    assert not config.token_ids and _config(_parser().parse_args([])).token_ids
    with pytest.raises(ValueError, match="diverge is a fault of the backend"):
        build_app(MockBackend(), [Fault(kind="diverge")])

"""The load generator against a real streaming server on 127.0.0.1:0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from bench.cli import main
from bench.client import RequestSpec
from bench.connect import discover
from bench.loadgen import LoadConfig, run_rate
from bench.schedule import poisson_schedule
from tests.bench.fake_openai import FakeOpenAI, serve, serve_in_thread

TTFT = 0.05


async def test_a_short_open_loop_run_times_every_streamed_request_over_h2() -> None:
    app = FakeOpenAI(ttft=TTFT, gap=0.002)
    async with trio.open_nursery() as nursery:
        url, stop = await serve(nursery, app)
        target = await discover(url, "auto", None)
        assert target.http_version == "HTTP/2" and target.models == ("tiny",)
        spec = RequestSpec(model="tiny", endpoint="chat", max_tokens=6)
        config = LoadConfig(rate=8.0, duration=2.0, seed=11)
        run = await run_rate(url, target.http, spec, config)
        stop.set()
    expected = len(poisson_schedule(8.0, 2.0, seed=11))
    assert len(run.results) == expected == app.requests
    assert all(r.ok for r in run.results), [r.detail for r in run.results if not r.ok]
    assert all(r.ttft is not None and r.ttft > TTFT for r in run.results)
    assert all(r.output_tokens == 6 and len(r.itl) == 5 for r in run.results)
    assert all(b["stream_options"] == {"include_usage": True} for b in app.bodies)


async def test_the_lean_client_takes_its_requests_in_turn_over_several_connections() -> None:
    from collections import Counter

    from backends.errors import BadRequest

    app = FakeOpenAI(ttft=0.01, gap=0.001)
    spec = RequestSpec(model="tiny", max_tokens=3)
    config = LoadConfig(rate=30.0, duration=1.0, seed=2)
    async with trio.open_nursery() as nursery:
        url, stop = await serve(nursery, app)
        run = await run_rate(url, "2", spec, config, lean=True, connections=3)
        with pytest.raises(BadRequest, match="only for the lean HTTP/2 client"):
            await run_rate(url, "1.1", spec, config, connections=2)
        stop.set()
    n = len(poisson_schedule(30.0, 1.0, seed=2))
    assert len(run.results) == n and all(r.ok for r in run.results)
    per_connection = Counter(app.clients)
    assert len(per_connection) == 3 and None not in per_connection
    assert sorted(per_connection.values()) == sorted(len(range(i, n, 3)) for i in range(3))


async def test_an_unreachable_target_is_reported_as_unavailable() -> None:
    from backends.errors import BackendUnavailable

    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendUnavailable, match="cannot reach"):
        await discover(f"http://127.0.0.1:{port}", "auto", None)


def test_the_cli_compares_router_and_direct_and_writes_json_and_png(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow, fast = FakeOpenAI(ttft=0.15, gap=0.002), FakeOpenAI(ttft=TTFT, gap=0.002)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    with serve_in_thread(slow) as routed, serve_in_thread(fast) as direct:
        rc = main(["--target", routed, "--compare-direct", direct, "--rps", "6", "12",
                   "--duration", "0.7", "--max-tokens", "4", "--seed", "3",
                   "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    n = [len(poisson_schedule(r, 0.7, seed=3)) for r in (6.0, 12.0)]
    assert [run["counts"]["ok"] for run in doc["runs"]] == [n[0], n[0], n[1], n[1]]
    assert slow.requests == fast.requests == sum(n)
    assert [c["rate"] for c in doc["router_added_latency"]] == [6.0, 12.0]
    for c in doc["router_added_latency"]:  # the "router" adds 100 ms before the first token
        assert 50 < c["ttft_ms"]["p50"]["delta"] < 500
        assert c["ttft_ms"]["p50"]["ratio"] > 1.5
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "routed" in table and "direct" in table and "router added latency" in table


def test_the_cli_rejects_bad_options_with_a_clear_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--target", "ftp://x", "--rps", "1", "--duration", "1"]) == 2
    assert "http:// or https://" in capsys.readouterr().err


async def test_non_streaming_requests_over_http1_are_timed_end_to_end() -> None:
    app = FakeOpenAI(ttft=TTFT, gap=0.001)
    async with trio.open_nursery() as nursery:
        url, stop = await serve(nursery, app)
        target = await discover(url, "1.1", None)
        assert target.http_version == "HTTP/1.1"
        spec = RequestSpec(model="tiny", max_tokens=5, stream=False)
        run = await run_rate(url, target.http, spec, LoadConfig(rate=10.0, duration=0.6, seed=5))
        stop.set()
    assert len(run.results) == len(poisson_schedule(10.0, 0.6, seed=5)) > 0
    for r in run.results:
        assert r.ok and r.ttft is None and r.output_tokens == 5
        assert r.e2e is not None and r.e2e > TTFT
    assert all(b["stream"] is False and "stream_options" not in b for b in app.bodies)


def test_the_cli_runs_the_lean_client_over_h2(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft=TTFT, gap=0.002)
    out_json = tmp_path / "lean.json"
    with serve_in_thread(fake) as url:
        rc = main(["--target", url, "--http", "2", "--client", "lean", "--rps", "8", "--duration", "0.6",
                   "--max-tokens", "4", "--seed", "5", "--json", str(out_json), "--no-plot"])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    n = len(poisson_schedule(8.0, 0.6, seed=5))
    assert doc["runs"][0]["counts"]["ok"] == n == fake.requests

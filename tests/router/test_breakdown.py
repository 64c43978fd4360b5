"""The latency breakdown (issue 18): each request's phases (ingress,
queue, connect, prefill, decode, egress) from its record, per-backend
windows with quantiles, rates and errors, the ``headrace_request_phase_seconds``
histograms and ``GET /admin/breakdown`` of a live router over 127.0.0.1,
and ``headrace top --once`` (a process of its own) against it."""

from __future__ import annotations

import gc
import subprocess
import sys
import tracemalloc
from pathlib import Path

import httpx
import pytest
import trio

from backends.mock import MockConfig, parse_fault
from backends.openai_http import OpenAIHTTPBackend
from frontend.context import RequestContext
from frontend.serving import ServeOptions
from router.app import NamedBackend, Router
from router.breakdown import Breakdown
from router.config import RouterConfig, decode_config
from router.logs import RequestRecord, phases_of
from router.server import options_for, run_router
from router.top import render
from tests.backends.conftest import serve_mock

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
SLOW_TTFT = 0.2


def test_the_phases_of_a_record_split_its_time_and_add_up() -> None:
    context = RequestContext(request_id="r", arrival=10.0, span_id="a" * 16)
    context.read_at = 10.01
    r = RequestRecord(context)
    r.dispatched_at, r.answer_at, r.first_at, r.last_at, r.done_at = 10.03, 10.07, 10.17, 10.97, 11.0
    phases = phases_of(r)
    assert phases == pytest.approx({"ingress": 0.01, "queue": 0.02, "connect": 0.04, "prefill": 0.1, "decode": 0.8, "egress": 0.03})
    assert sum(phases.values()) == pytest.approx(r.done_at - context.arrival)


def test_a_refused_request_has_only_the_phases_it_reached() -> None:
    context = RequestContext(request_id="r", arrival=1.0, span_id="a" * 16)
    context.read_at = 1.5
    r = RequestRecord(context)
    r.done_at = 2.0
    assert phases_of(r) == {"ingress": 0.5, "queue": 0.5}


def test_the_breakdown_keeps_a_window_per_backend_with_quantiles_rates_and_errors() -> None:
    b = Breakdown(samples=100, window=60.0, rate_window=10.0)
    b.add("a", 0.0, {"prefill": 9.0}, False)  # older than the window at now=100: left out
    for i in range(100):
        b.add("a", 95.0 + i * 0.01, {"prefill": (i + 1) / 1000, "decode": 0.5}, i % 10 == 0)
    b.add("none", 99.0, {"ingress": 0.001, "queue": 0.002}, True)
    snap = b.snapshot(100.0, {"a": 3, "idle": 0})
    rows = {row["backend"]: row for row in snap["backends"]}
    assert set(rows) == {"a", "idle", "none"}
    a = rows["a"]
    assert a["in_flight"] == 3 and a["requests"] == 101 and a["errors"] == 10
    assert a["rps"] == pytest.approx(100 / 10.0) and a["error_rate"] == pytest.approx(0.1)
    assert a["phases"]["prefill"] == {"p50": 51.0, "p99": 100.0, "n": 100}
    assert "ingress" not in a["phases"]
    assert rows["idle"]["requests"] == 0 and rows["idle"]["phases"] == {}
    table = render(snap, "http://admin")
    assert "PREFILL p50/p99" in table and "51.0/100" in table


def test_the_ring_keeps_the_last_samples_as_rows_of_one_array() -> None:
    """A full ring overwrites its oldest rows, and what it keeps is rows of
    doubles (64 bytes a request), not a tuple, a dict and floats per request
    (about 350 bytes): those outlived every other allocation of their
    request and pinned heap pages long after the load had gone."""
    b = Breakdown(samples=50, window=1e9, rate_window=1e9)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            phases = {"ingress": i / 1e6, "queue": 0.0, "connect": 0.001, "prefill": (i % 50 + 1) / 1000,
                      "decode": 0.25, "egress": 0.002}
            b.add("a", 100.0 + i, phases, i % 5 == 0)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert kept < 50 * 64 * 2 + 1024  # the ring's 50 rows, its over-allocation and the entry
    row = b.snapshot(20_000.0, {})["backends"][0]
    assert row["requests"] == 10_000 and row["errors"] == 2_000
    # The last 50 requests only: prefill 1..50 ms once each, every fifth failed.
    assert row["phases"]["prefill"] == {"p50": 26.0, "p99": 50.0, "n": 50}
    assert row["phases"]["decode"]["n"] == 50 and row["phases"]["egress"]["p50"] == 2.0
    assert row["error_rate"] == pytest.approx(0.2)


async def serve_both(nursery: trio.Nursery, router: Router, config: RouterConfig) -> tuple[str, str]:
    """The main listener and the admin one (a free port), as ``headrace serve`` runs them."""
    url: str = await nursery.start(lambda task_status: run_router(
        router, options_for(config), shutdown=trio.Event(), admin=ServeOptions("127.0.0.1", 0, graceful_timeout=0.1),
        task_status=task_status))  # fmt: skip
    assert router.admin_url is not None
    return url, router.admin_url


async def test_a_slow_backends_prefill_shows_in_its_row_the_metrics_and_headrace_top(nursery: trio.Nursery) -> None:
    """A mock with a 200 ms first token beside a fast one: the admin
    breakdown puts the time in the slow backend's prefill; /metrics has the
    phase histograms; ``headrace top --once`` prints both rows."""
    slow = await serve_mock(nursery, MockConfig(name="slow", models=("mock",), ttft_s=SLOW_TTFT))
    fast = await serve_mock(nursery, MockConfig(name="fast", models=("mock",)))
    config = decode_config({"server": {"port": 0}, "routing": {"policy": "round_robin"}})
    router = Router(config, [NamedBackend("slow", OpenAIHTTPBackend(slow.url, name="slow")),
                             NamedBackend("fast", OpenAIHTTPBackend(fast.url, name="fast"))])  # fmt: skip
    url, admin = await serve_both(nursery, router, config)
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        for _ in range(6):
            r = await client.post("/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 4, "stream": True})
            assert r.status_code == 200
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        with trio.fail_after(5):  # each request's record closes after its last byte
            while sum(row["requests"] for row in (await client.get("/admin/breakdown")).json()["backends"]) < 6:
                await trio.sleep(0.005)
        data = (await client.get("/admin/breakdown")).json()
        metrics = (await client.get("/metrics")).text
    rows = {row["backend"]: row for row in data["backends"]}
    assert rows["slow"]["requests"] == 3 and rows["fast"]["requests"] == 3
    assert rows["slow"]["phases"]["prefill"]["p50"] >= SLOW_TTFT * 1000  # the mock slept that long before its first token
    for row in rows.values():
        assert set(row["phases"]) == {"ingress", "queue", "connect", "prefill", "decode", "egress"}
    assert 'headrace_request_phase_seconds_count{backend="slow",phase="prefill"} 3.0' in metrics
    assert 'headrace_request_phase_seconds_bucket{backend="fast",le="0.0005",phase="ingress"}' in metrics
    out = await trio.run_process([sys.executable, "-m", "router.cli", "top", "--once", "--admin", admin],
                                 capture_stdout=True, capture_stderr=True, cwd=REPO)  # fmt: skip
    text = out.stdout.decode()
    assert "PREFILL p50/p99" in text
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert set(lines) == {"fast", "slow"}
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:  # the API listener has no breakdown
        assert (await client.get("/admin/breakdown")).status_code == 404


async def test_a_failed_attempt_counts_as_connect_time_of_the_request(nursery: trio.Nursery) -> None:
    bad = await serve_mock(nursery, MockConfig(name="bad", models=("mock",)), [parse_fault("status=500")])
    good = await serve_mock(nursery, MockConfig(name="good", models=("mock",)))
    config = decode_config({"server": {"port": 0}, "routing": {"policy": "round_robin"}, "breaker": {"enabled": False},
                            "retry": {"backoff_base": 0.05, "backoff_cap": 0.05}})  # fmt: skip
    router = Router(config, [NamedBackend("bad", OpenAIHTTPBackend(bad.url, name="bad")),
                             NamedBackend("good", OpenAIHTTPBackend(good.url, name="good"))])  # fmt: skip
    url, admin = await serve_both(nursery, router, config)
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        r = await client.post("/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    async with httpx.AsyncClient(base_url=admin, timeout=20) as client:
        with trio.fail_after(5):
            while not (rows := {r["backend"]: r for r in (await client.get("/admin/breakdown")).json()["backends"]}).get("good", {}).get("requests"):
                await trio.sleep(0.005)
    # The retry slept a full-jitter backoff of up to 50 ms after the 500: that, and the failed
    # attempt, are the connect phase; the request is the good backend's.
    assert rows["good"]["phases"]["connect"]["p50"] > 0
    assert rows.get("bad", {}).get("requests", 0) == 0


def test_headrace_top_says_when_the_router_is_not_there() -> None:
    out = subprocess.run([sys.executable, "-m", "router.cli", "top", "--once", "--admin", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=30, cwd=REPO, check=False)  # fmt: skip
    assert out.returncode == 1 and "headrace top: http://127.0.0.1:9/admin/breakdown" in out.stderr

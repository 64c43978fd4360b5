"""bench/relay_budget.py and bench/null_relay.py: the CPU budget an added-TTFT
target leaves the router, read off a null relay's curve."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio

from backends.errors import ClientError
from bench import relay_budget
from bench.procs import start_server
from bench.router_bench import mock_argv

RELAY = Path(relay_budget.__file__).with_name("null_relay.py")


def _row(front: str, cpu: float | None, p99: float | None, errors: int = 0) -> dict[str, object]:
    return {"front": front, "cpu_ms_per_request": cpu, "added_ttft_p99": p99, "errors": errors}


def test_the_budget_is_where_the_relays_cross_the_target_interpolated() -> None:
    rows = [_row("relay", 0.4, 1.0), _row("relay", 0.6, 3.0), _row("relay", 0.8, 7.0), _row("relay", 1.0, 9.0),
            _row("router", 1.1, 6.5)]
    b = relay_budget.budget(rows, 5.0)
    assert b["cpu_ms_per_request"] == pytest.approx(0.7)  # halfway from (0.6, 3) to (0.8, 7)
    assert not b["at_least"]
    assert b["router_cpu_ms_per_request"] == 1.1 and b["router_added_ttft_p99"] == 6.5


def test_the_budget_when_no_relay_or_every_relay_is_within_the_target() -> None:
    assert relay_budget.budget([_row("relay", 0.4, 6.0), _row("relay", 0.6, 8.0)], 5.0)["cpu_ms_per_request"] is None
    b = relay_budget.budget([_row("relay", 0.4, 1.0), _row("relay", 0.6, 2.0)], 5.0)
    assert b["cpu_ms_per_request"] == 0.6 and b["at_least"]
    assert b["router_cpu_ms_per_request"] is None


def test_a_relay_with_errors_or_no_numbers_is_not_a_point_of_the_curve() -> None:
    rows = [_row("relay", 0.4, 1.0), _row("relay", 0.5, 2.0, errors=3), _row("relay", None, None), _row("relay", 0.8, 9.0)]
    assert relay_budget.budget(rows, 5.0)["cpu_ms_per_request"] == pytest.approx(0.4 + 0.4 * 4 / 8)


def test_medians_take_each_fronts_rounds_in_the_order_first_run() -> None:
    def run(label: str, front: str, cpu: float | None, p99: float | None, errors: int = 0) -> dict[str, object]:
        return {"label": label, "front": front, "burn_ms": 0.0 if front == "relay" else None,
                "cpu_ms_per_request": cpu, "added_ttft_p50": 1.0, "added_ttft_p99": p99, "errors": errors}

    rows = [run("relay +0 ms", "relay", 0.4, 1.0), run("router", "router", 1.1, 6.0),
            run("router", "router", 1.3, 20.0, errors=2), run("relay +0 ms", "relay", 0.5, 3.0),
            run("relay +0 ms", "relay", None, 2.0), run("router", "router", 1.2, 7.0)]
    relay, router = relay_budget.medians(rows)
    assert relay["label"] == "relay +0 ms" and router["label"] == "router"
    assert relay["cpu_ms_per_request"] == pytest.approx(0.45) and relay["added_ttft_p99"] == 2.0
    assert relay["rounds"] == 3 and relay["added_ttft_p99_by_round"] == [1.0, 3.0, 2.0]
    assert router["cpu_ms_per_request"] == 1.2 and router["added_ttft_p99"] == 7.0 and router["errors"] == 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ClientError):
        relay_budget.main(["--burn-ms", "0,x"])
    with pytest.raises(ClientError):
        relay_budget.main(["--burn-ms", "-1"])
    with pytest.raises(ClientError):
        relay_budget.main(["--burn-ms", "", "--no-router"])
    with pytest.raises(ClientError):
        relay_budget.main(["--rps", "0"])
    with pytest.raises(ClientError):
        relay_budget.main(["--rounds", "0"])


async def _through_the_relay(tmp_path: Path, burn_ms: float) -> tuple[bytes, bytes, float]:
    """One streamed completion from a real mock, directly and through a relay
    with ``burn_ms``; the relay's time for it."""
    mock = await start_server("mock", mock_argv(0, 5), tmp_path)
    relay = await start_server("relay", [sys.executable, str(RELAY), "--port", "0", "--burn-ms", f"{burn_ms:g}",
                                         "--backend", mock.url], tmp_path)
    body = {"model": "mock", "prompt": "one two three", "max_tokens": 5, "stream": True, "seed": 7}
    try:
        async with httpx.AsyncClient(http1=False, http2=True, trust_env=False, timeout=10) as client:
            direct = (await client.post(f"{mock.url}/v1/completions", json=body)).content
            start = time.perf_counter()
            relayed = await client.post(f"{relay.url}/v1/completions", json=body)
            took = time.perf_counter() - start
            assert relayed.status_code == 200 and relayed.headers["content-type"].startswith("text/event-stream")
            return direct, relayed.content, took
    finally:
        with trio.CancelScope(shield=True):
            await relay.stop()
            await mock.stop()


def _without_ids(sse: bytes) -> list[dict[str, object]]:
    events = [json.loads(line[6:]) for line in sse.split(b"\n") if line.startswith(b"data: {")]
    for e in events:
        e.pop("id", None)
        e.pop("created", None)
    return events


async def test_the_relay_passes_the_upstream_stream_through_and_burns_what_it_is_told(tmp_path: Path) -> None:
    direct, relayed, _ = await _through_the_relay(tmp_path, 0)
    assert relayed.endswith(b"data: [DONE]\n\n") and direct.endswith(b"data: [DONE]\n\n")
    assert len(_without_ids(relayed)) >= 5 and _without_ids(relayed) == _without_ids(direct)
    _, _, took = await _through_the_relay(tmp_path, 300)
    assert took >= 0.3  # the burn is spun on the request's path, before its upstream


def test_a_short_run_measures_each_front_every_round_and_writes_the_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "budget.json"
    argv = ["--rps", "20", "--duration", "1", "--burn-ms", "0,5", "--rounds", "2", "--max-tokens", "3",
            "--json", str(out), "--plot", str(tmp_path / "budget.png")]
    assert relay_budget.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "budget" and "interrupted" not in doc
    fronts = [("relay", 0), ("relay", 5), ("router", None)]
    # every front each round, the order reversed in the second, a new schedule each round
    assert [(r["front"], r["burn_ms"], r["round"]) for r in doc["rows"]] == (
        [(*f, 0) for f in fronts] + [(*f, 1) for f in fronts[::-1]])
    for r in doc["rows"]:
        assert r["errors"] == 0 and r["routed"]["counts"]["ok"] == r["routed"]["counts"]["scheduled"] > 0
        assert r["cpu_ms_per_request"] > 0 and r["added_ttft_p50"] is not None
        assert r["routed"]["seed"] == r["round"]
    relay0, relay1, router = doc["fronts"]
    assert relay1["cpu_ms_per_request"] > relay0["cpu_ms_per_request"] + 3  # 5 ms spun a request
    assert router["rounds"] == 2 and doc["budget"]["router_cpu_ms_per_request"] == router["cpu_ms_per_request"]
    printed = capsys.readouterr()
    assert "CPU ms/req" in printed.out and "median of rounds" in printed.out and "router:" in printed.out
    assert f"wrote {out}" in printed.err and f"wrote {tmp_path / 'budget.png'}" in printed.err
    assert (tmp_path / "budget.png").stat().st_size > 0

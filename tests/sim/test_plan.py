"""``headrace plan`` (sim/plan.py): the M/M/c plan, its table and plot, the
command line's errors, and ``--measure`` against a live mock over loopback."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from backends.mock import MockBackend, MockConfig
from backends.mock_server import build_app
from bench.service_rate import measure_service
from frontend.serving import ServeOptions, serve
from policies.erlang import response_quantile
from sim.plan import main, plan


def test_the_plan_is_the_fewest_replicas_that_meet_the_target() -> None:
    p = plan(rps=40, p99=12.0, concurrency=8, service_time=2.0)
    assert p.replicas == 11 and p.utilisation == pytest.approx(40 / (0.5 * 88))
    by_n = {r.replicas: r for r in p.rows}
    assert by_n[10].utilisation >= 1 and math.isinf(by_n[10].p99) and not by_n[10].meets
    assert by_n[11].meets and by_n[11].p99 == pytest.approx(response_quantile(0.99, 88, 40, 0.5))
    assert [r.p99 for r in p.rows[1:]] == sorted((r.p99 for r in p.rows[1:]), reverse=True)  # falls as replicas are added
    assert p.service_rate == pytest.approx(4.0)  # 8 streams of 2 s


def test_fixed_service_times_need_no_more_replicas_than_exponential_ones() -> None:
    exp = plan(rps=40, p99=5.0, concurrency=8, service_time=2.0)
    fixed = plan(rps=40, p99=5.0, concurrency=8, service_time=2.0, fixed=True)
    assert exp.replicas is None  # ln(100) x 2 s = 9.2 s > 5 s whatever the count
    assert fixed.replicas == 11 and all(r.p99 >= 2.0 for r in fixed.rows)


def test_the_command_prints_the_table_and_writes_the_plot_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    rc = main(["--rps", "40", "--p99-ms", "12000", "--prompt-tokens", "512", "--output-tokens", "256",
               "--service-rate", "4", "--concurrency", "8", "--plot", str(png), "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "replicas needed: 11 (utilisation 90.9%)" in text and "     11      88  90.9%" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out.read_text())
    assert doc["replicas"] == 11 and doc["rows"][0]["p99"] is None  # the unstable row: no infinity in JSON


def test_token_rates_give_the_service_time(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--rps", "2", "--p99-ms", "60000", "--prompt-tokens", "1000", "--output-tokens", "200",
               "--prefill-tps", "2000", "--decode-tps", "40", "--concurrency", "4", "--plot", ""])  # fmt: skip
    assert rc == 0 and "service: 5500 ms a request at 4 streams" in capsys.readouterr().out  # 0.5 s + 5 s


@pytest.mark.parametrize(
    "argv",
    [
        ["--rps", "0", "--service-time", "1"],
        ["--rps", "5", "--service-time", "-1"],
        ["--rps", "5", "--service-rate", "0"],
        ["--rps", "5", "--decode-tps", "0"],
    ],
)
def test_bad_numbers_are_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*argv, "--p99-ms", "1000", "--prompt-tokens", "10", "--output-tokens", "10", "--plot", ""])
    assert rc == 2 and capsys.readouterr().err.startswith("headrace plan: ")


def test_an_unreachable_target_says_why_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--rps", "40", "--p99-ms", "5000", "--prompt-tokens", "1", "--output-tokens", "1", "--service-time", "2", "--plot", ""])
    assert rc == 1 and "the service time alone has a p99 of 9210 ms" in capsys.readouterr().out


def test_an_unreachable_backend_to_measure_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "plan", "--rps", "1", "--p99-ms", "1000", "--prompt-tokens", "8",
         "--output-tokens", "4", "--measure", "http://127.0.0.1:9", "--duration", "0.5", "--plot", ""],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "headrace plan: --measure http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_measure_finds_a_live_backends_service_time_and_rate() -> None:
    """A mock with 50 ms to the first token and 10 ms per token, 5 tokens: a
    request takes at least 90 ms; four closed-loop streams complete at most
    four per service time (Little's law, less what was in flight at the end)."""
    app = build_app(MockBackend(MockConfig(ttft_s=0.05, tpot_s=0.01)))
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve, app, ServeOptions("127.0.0.1", 0), shutdown=shutdown))
        m = await measure_service(url, prompt_tokens=8, output_tokens=5, concurrency=4, duration=0.6)
        shutdown.set()
    assert m.errors == 0 and m.completed >= 4 and m.output_tokens == 5
    assert m.service_time >= 0.09
    assert m.throughput * m.service_time <= 4 * 1.001
    assert m.per_stream == pytest.approx(1 / m.service_time)


def test_the_plan_table_reproduces_the_published_erlang_c_example() -> None:
    """The call-centre example of tests/policies/test_erlang.py through the
    planner: 360 calls per half hour (0.2/s) of 240 s each, one server per
    agent; at 55 agents the published figures are 87.3% occupancy, 23.9%
    probability of waiting and 8.2 s mean answer time."""
    p = plan(rps=0.2, p99=3600.0, concurrency=1, service_time=240.0, extra_rows=10)
    row = next(r for r in p.rows if r.servers == 55)
    assert (round(100 * row.utilisation, 1), round(100 * row.p_wait, 1), round(row.mean_wait, 1)) == (87.3, 23.9, 8.2)

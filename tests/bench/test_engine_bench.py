"""The closed-loop engine benchmark: fixed concurrency, throughput per level."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from bench.cli import main
from bench.client import RequestResult
from bench.engine_bench import run_closed_loop, summarize_level
from tests.bench.fake_openai import FakeOpenAI, serve_in_thread


async def test_the_closed_loop_keeps_exactly_c_requests_in_flight_until_the_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    in_flight, peak = 0, 0

    async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await trio.sleep(1.0)
        in_flight -= 1
        return RequestResult(index=index, scheduled=planned - run_start, output_tokens=10,
                             ttft=0.1, e2e=1.0)

    wall, results = await run_closed_loop(4, 10.0, send)
    assert peak == 4
    assert len(results) == 40 and wall == pytest.approx(10.0)  # 4 streams x 10 back-to-back
    level = summarize_level(4, wall, results)
    assert level["aggregate_tok_s"] == pytest.approx(40.0)
    assert level["per_stream_tok_s"]["p50"] == pytest.approx(10.0)  # 9 tokens in 0.9 s
    assert level["ttft_ms"]["p50"] == pytest.approx(100.0)


async def test_every_stream_sends_at_least_once_even_past_a_short_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    async def send(index: int, prompt: str, planned: float, run_start: float) -> RequestResult:
        await trio.sleep(5.0)
        return RequestResult(index=index, scheduled=0.0, error="http_503")

    wall, results = await run_closed_loop(3, 1.0, send)
    assert len(results) == 3 and wall == pytest.approx(5.0)
    assert summarize_level(3, wall, results)["errors"] == {"http_503": 3}


def test_engine_cli_against_a_streaming_server_writes_a_table_json_and_png(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app = FakeOpenAI(ttft=0.02, gap=0.004)
    with serve_in_thread(app) as url:
        rc = main(["engine", "--target", url, "--concurrency", "1", "3", "--duration", "0.5",
                   "--max-tokens", "8", "--results-dir", str(tmp_path),
                   "--roofline", "bf16-packed", "--bandwidth-mib", "16"])
    assert rc == 0
    (report,) = tmp_path.glob("engine-*.json")
    doc = json.loads(report.read_text())
    roof = doc["roofline"]  # the c=1 per-stream decode rate over this box's ceiling
    single = doc["levels"][0]["per_stream_tok_s"]["p50"]
    assert roof["dtype"] == "bf16-packed" and roof["bandwidth_gb_s"] > 0
    assert roof["measured_tok_s"] == single
    assert roof["achieved_fraction"] == pytest.approx(single / roof["ceiling_tok_s"])
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 3]
    assert all(lv["ok"] == lv["requests"] > 0 for lv in doc["levels"])
    # Each level reports its aggregate rate (which is faster is the benchmark's
    # finding, not this test's: on a loaded CI box c=3 can come out slower).
    assert all(lv["aggregate_tok_s"] > 0 for lv in doc["levels"])
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 8 for b in app.bodies)
    assert next(tmp_path.glob("engine-*.png")).read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "agg tok/s" in out and "% of the ceiling" in out


def test_ratios_against_transformers_one_at_a_time_and_batched() -> None:
    from bench.engine_bench import baseline_ratios, format_ratios

    levels = [{"concurrency": c, "aggregate_tok_s": t} for c, t in ((1, 30.0), (4, 80.0), (16, 160.0))]
    baseline = {"results": [{"batch": 1, "tok_s": 20.0}, {"batch": 16, "tok_s": 200.0}]}
    ratios = {r["concurrency"]: r for r in baseline_ratios(levels, baseline)}
    assert ratios[1]["vs_sequential"] == 1.5 and ratios[1]["vs_batched"] == 1.5
    assert ratios[4]["vs_sequential"] == 4.0 and "vs_batched" not in ratios[4]
    assert ratios[16]["vs_sequential"] == 8.0 and ratios[16]["vs_batched"] == 0.8
    table = format_ratios(list(ratios.values()))
    assert "8.00x (20.0)" in table and "0.80x (200.0)" in table
    assert baseline_ratios(levels, {"results": []}) == []


def test_roofline_fraction_needs_a_single_stream_level() -> None:
    from bench.engine_bench import roofline_fraction
    from bench.roofline import format_report

    ceiling = {"device": "cpu", "copy_gb_s": 20.0, "read_gb_s": 18.0, "bandwidth_gb_s": 20.0,
               "dtype": "bf16", "weights": None, "weight_bytes": 200_000_000,
               "floor_ms_per_step": 10.0, "ceiling_tok_s": 100.0}
    levels = [{"concurrency": c, "per_stream_tok_s": {"p50": r}} for c, r in ((1, 40.0), (4, 30.0))]
    assert roofline_fraction(levels, ceiling)["achieved_fraction"] == pytest.approx(0.4)
    assert "40.0% of the ceiling" in format_report(roofline_fraction(levels, ceiling))
    alone = roofline_fraction(levels[1:], ceiling)
    assert alone["achieved_fraction"] is None
    assert "no concurrency-1 level" in format_report(alone)

"""Summaries and the router-vs-direct comparison."""

from __future__ import annotations

import pytest

from bench.client import RequestResult
from bench.loadgen import LoadConfig, RunResult
from bench.report import compare, format_compare, format_table, summarize_run


def _run(ttft: float, n: int = 10) -> RunResult:
    results = [RequestResult(index=i, scheduled=i * 0.1, ttft=ttft, e2e=ttft + 0.2,
                             itl=[0.1, 0.1], output_tokens=3) for i in range(n)]
    results.append(RequestResult(index=n, scheduled=1.0, error="dropped"))
    results.append(RequestResult(index=n + 1, scheduled=1.0, error="http_503", e2e=0.01))
    return RunResult(config=LoadConfig(rate=10.0, duration=1.0), wall=2.0, results=results)


def test_a_run_summary_counts_errors_by_kind_and_times_only_successes() -> None:
    s = summarize_run(_run(0.05), label="target")
    assert s["counts"] == {"scheduled": 12, "ok": 10, "errors": 2}
    assert s["errors"] == {"dropped": 1, "http_503": 1}
    assert s["ttft_ms"]["p99"] == pytest.approx(50.0) and s["e2e_ms"]["n"] == 10
    assert s["itl_ms"]["n"] == 20 and s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["throughput"]["req_s"] == pytest.approx(5.0)
    assert s["throughput"]["output_tok_s"] == pytest.approx(15.0)
    assert s["throughput"]["offered_req_s"] == pytest.approx(12.0)


def test_router_added_latency_is_the_difference_and_ratio_to_direct() -> None:
    routed, direct = summarize_run(_run(0.06), label="routed"), summarize_run(_run(0.05), label="direct")
    c = compare(routed, direct)
    assert c["ttft_ms"]["p50"]["delta"] == pytest.approx(10.0)
    assert c["ttft_ms"]["p99"]["ratio"] == pytest.approx(1.2)
    assert c["e2e_ms"]["p50"]["delta"] == pytest.approx(10.0)
    assert "+10.00" in format_compare([c])
    table = format_table([routed, direct])
    assert "dropped=1, http_503=1" in table and table.count("\n") == 3

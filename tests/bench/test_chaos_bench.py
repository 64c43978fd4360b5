"""bench chaos: answers are judged against their references, the router's
histograms are split by route group and bucket quantiles interpolate as
Prometheus does, and a short run with one kill writes a report in which every stream
is counted and, the mock being exact, every answer is identical."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from bench.chaos_bench import (
    Slot,
    Workload,
    _parser,
    _router_health,
    _series,
    fleet_codes,
    heap_diff,
    histogram_quantile,
    judge,
    main,
    metrics_delta,
    parse_metrics,
    router_config,
    traced_argv,
)
from router.config import decode_config


def test_an_answer_is_identical_truncated_different_or_an_error() -> None:
    ref = " the river runs"
    assert judge(ref, None, ref) == "identical"
    assert judge(" the river", None, ref) == "truncated"  # a cut answer that ended with [DONE]
    assert judge(ref, "truncated", ref) == "truncated"  # all the text, but no [DONE]
    assert judge(" the stone runs", None, ref) == "different"
    assert judge(ref + " under", None, ref) == "different"
    assert judge("", "stream_error", ref) == "error"
    assert judge("", "http_503", ref) == "error"


def test_bucket_quantiles_interpolate_inside_the_bucket_like_prometheus() -> None:
    buckets = [(0.01, 0.0), (0.05, 50.0), (0.1, 90.0), (math.inf, 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.05)
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.03)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.075)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.1)  # in +Inf: the last finite bound
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None
    assert histogram_quantile([], 0.5) is None


def test_metrics_are_summed_per_route_group_and_the_chaos_phase_is_end_less_base() -> None:
    def text(resumed: float, a_fast: float, cold_fast: float) -> str:
        return "\n".join([
            "# TYPE headrace_migrations_total counter",  # as generate_latest writes it
            f'headrace_migrations_total{{reason="broken",outcome="resumed"}} {resumed}',
            'headrace_migrations_total{reason="stall",outcome="failed"} 1.0',
            "# TYPE headrace_resume_gap_seconds histogram",
            f'headrace_resume_gap_seconds_bucket{{backend="mock0",le="0.1"}} {a_fast}',
            f'headrace_resume_gap_seconds_bucket{{backend="mock0",le="+Inf"}} {a_fast + 1}',
            'headrace_resume_gap_seconds_bucket{backend="mock1",le="0.1"} 1.0',
            'headrace_resume_gap_seconds_bucket{backend="mock1",le="+Inf"} 1.0',
            f'headrace_resume_gap_seconds_bucket{{backend="mock1-cold",le="0.1"}} {cold_fast}',
            'headrace_resume_gap_seconds_bucket{backend="mock1-cold",le="+Inf"} 5.0',
            'headrace_resume_gap_seconds_count{backend="mock0"} 2.0',
            "# TYPE headrace_backend_in_flight gauge",
            'headrace_backend_in_flight{backend="mock0"} 0.0',
            'headrace_backend_in_flight{backend="mock1"} 2.0',
            "",
        ])

    base, end = parse_metrics(text(1.0, 1.0, 0.0)), parse_metrics(text(4.0, 3.0, 2.0))
    assert end["migrations"] == {"broken:resumed": 4, "stall:failed": 1}
    assert end["histograms"]["headrace_resume_gap_seconds"] == {
        "held": [(0.1, 4.0), (math.inf, 5.0)], "cold": [(0.1, 2.0), (math.inf, 5.0)]}
    assert end["gauges"] == {"headrace_backend_in_flight": 2.0}
    delta = metrics_delta(end, base)
    assert delta["migrations"] == {"broken:resumed": 3}
    assert delta["histograms"]["headrace_resume_gap_seconds"] == {
        "held": [(0.1, 2.0), (math.inf, 2.0)], "cold": [(0.1, 2.0), (math.inf, 0.0)]}


def test_labelled_resume_gaps_split_the_shared_route_by_what_the_new_backend_held() -> None:
    """The router's ``prefix`` label (by the continuation's usage): the held
    series is the shared route's ``held`` gaps only; its ``missed`` and
    ``unknown`` ones are the shared route's others; the fresh route is apart."""
    rows = []
    for backend, prefix, fast, total in (("mock0", "held", 3, 4), ("mock1", "held", 1, 1), ("mock0", "missed", 0, 2),
                                         ("mock1", "unknown", 1, 1), ("mock0-cold", "missed", 0, 3)):
        rows += [f'headrace_resume_gap_seconds_bucket{{backend="{backend}",prefix="{prefix}",le="0.1"}} {fast}',
                 f'headrace_resume_gap_seconds_bucket{{backend="{backend}",prefix="{prefix}",le="+Inf"}} {total}']
    metrics = parse_metrics("\n".join(["# TYPE headrace_resume_gap_seconds histogram", *rows, ""]))
    series = _series(metrics)
    assert series["resume_gap_held"] == [(0.1, 4.0), (math.inf, 5.0)]
    assert series["resume_gap_shared_missed"] == [(0.1, 1.0), (math.inf, 3.0)]
    assert series["resume_gap_not_held"] == [(0.1, 0.0), (math.inf, 3.0)]
    assert series["resume_gap_all"] == [(0.1, 5.0), (math.inf, 11.0)]


def test_the_workload_is_seeded_with_a_few_shared_shapes_and_some_cold_prompts() -> None:
    args = _parser().parse_args(["--prompts", "3", "--seeds", "2", "--cold-fraction", "0.2", "--prompt-tokens", "300"])
    a, b = Workload(args), Workload(args)
    picks = [a.pick(i) for i in range(500)]
    assert picks == [b.pick(i) for i in range(500)]
    assert len(a.shared) == 6 and all(len(s.prompt) == 300 and 50 <= s.max_tokens <= 100 for s in a.shared)
    cold = [shape for key, shape in picks if key is None]
    assert 60 <= len(cold) <= 140 and len({s.prompt for s in cold}) == len(cold)
    assert not {s.prompt for s in cold} & set(a.prompts)
    assert {key for key, _ in picks if key is not None} == set(range(6))


@pytest.mark.slow
def test_a_short_run_with_one_kill_counts_every_stream_and_all_are_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two mocks, ten streams, one SIGKILL: the streams on the victim migrate
    and, the mock resuming exactly, every answer equals its reference."""
    out = tmp_path / "chaos.json"
    rc = main(["--backends", "2", "--concurrency", "10", "--warmup", "0.5", "--settle", "1", "--duration", "2.5",
               "--interval", "1", "1", "--max-kills", "1", "--tpot-ms", "10", "--max-tokens", "50", "100",
               "--prompts", "2", "--seeds", "2", "--cold-fraction", "0.1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["streams"]
    assert s["total"] > 10
    assert s["identical"] + s["truncated"] + s["different"] + s["errored"] == s["total"]
    assert s["identical"] == s["total"], s["not_identical"]
    assert len(doc["kills"]) == 1 and "back_s" in doc["kills"][0]
    assert doc["bed"]["oracle_agrees"] is True
    assert doc["migrations"]["failed"] == 0
    for key in ("rss_growth_pct", "fds_growth", "idle_before", "idle_after", "in_flight_after_drain"):
        assert key in doc["router"]
    for idle in (doc["router"]["idle_before"], doc["router"]["idle_after"]):  # /admin/memory and the task gauge beside RSS
        assert idle["heap_in_use_mib"] > 0 and idle["heap_free_mib"] >= 0 and idle["python_blocks"] > 10_000
        assert idle["tasks"] >= 10  # trio's, hypercorn's, the actors', the services'
    assert doc["router"]["tasks_growth"] == doc["router"]["idle_after"]["tasks"] - doc["router"]["idle_before"]["tasks"]
    assert doc["targets"]["router tasks not grown (<= 1 per backend entry)"] is True
    assert doc["migrations"]["resumed"] >= 1  # ten streams on two backends: some were on the victim
    gaps = doc["router_ms"]
    assert gaps["resume_gap_held"]["n"] + gaps["resume_gap_not_held"]["n"] == doc["migrations"]["resumed"]
    assert doc["router_ms"]["ttft_cold"]["n"] == s["cold_prompts"]
    assert {"resume_gap_held_p50_over_cold_ttft_p50", "resume_gap_all_p99_over_cold_ttft_p99"} <= set(doc["ratios"])
    assert doc["cpu"]["cores"] >= 1 and doc["cpu"]["model"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "identical to the reference" in printed and "C heap in use" in printed


def test_the_router_config_lists_each_mock_twice_in_two_routes_and_decodes() -> None:
    args = _parser().parse_args(["--backends", "3"])
    slots = [Slot(i, ["mock"], 9000 + i) for i in range(3)]
    config = decode_config(tomllib.loads(router_config(args, slots)))
    assert [b.name for b in config.backends] == ["mock0", "mock0-cold", "mock1", "mock1-cold", "mock2", "mock2-cold"]
    assert {b.url for b in config.backends} == {"http://127.0.0.1:9000", "http://127.0.0.1:9001", "http://127.0.0.1:9002"}
    routes = {m.name: m for m in config.models}
    assert routes["mock"].backends == ("mock0", "mock1", "mock2")
    assert routes["cold"].backends == ("mock0-cold", "mock1-cold", "mock2-cold")
    assert routes["cold"].upstream_model == "mock"
    assert config.server.max_concurrent_streams == 10 and config.health.interval == 0.5


def test_the_fleet_is_one_letter_per_backend_of_the_shared_route() -> None:
    listing = [
        {"name": "mock1", "up": True, "breaker": {"state": "open"}},
        {"name": "mock0", "up": True, "breaker": {"state": "closed"}},
        {"name": "mock0-cold", "up": False, "breaker": None},
        {"name": "mock2", "up": False, "breaker": {"state": "closed"}},
        {"name": "mock3", "up": True, "breaker": {"state": "half_open"}},
        {"name": "mock4", "up": True, "breaker": None},
        {"name": "mock5", "up": False, "state": "ejected", "breaker": {"state": "open"}},
        {"name": "mock6", "up": True, "state": "half_open", "breaker": None},
    ]
    assert "".join(fleet_codes(listing).values()) == "UEDHUEH"


def test_the_traced_router_runs_router_cli_under_tracemalloc_and_answers_snapshot_requests() -> None:
    argv = traced_argv(5, Path("/tmp/heap"), ["/usr/bin/python3", "-m", "router.cli", "serve", "--port", "0"])
    assert argv[:2] == ["/usr/bin/python3", "-c"] and "tracemalloc.start(frames)" in argv[2]
    assert argv[3:] == ["5", "/tmp/heap", "serve", "--port", "0"]
    with pytest.raises(AssertionError):
        traced_argv(5, Path("/tmp/heap"), ["python", "-m", "bench.cli"])


def test_a_heap_diff_names_the_site_that_grew(tmp_path: Path) -> None:
    import tracemalloc

    tracemalloc.start(4)
    try:
        tracemalloc.take_snapshot().dump(str(tmp_path / "a.snap"))
        kept = [bytearray(1000) for _ in range(300)]  # ~300 KB from this line
        tracemalloc.take_snapshot().dump(str(tmp_path / "b.snap"))
    finally:
        tracemalloc.stop()
    diff = heap_diff(tmp_path / "a.snap", tmp_path / "b.snap")
    top = diff["top_sites"][0]
    assert "test_chaos_bench.py" in top["site"] and top["growth_kib"] >= 290 and top["count_growth"] >= 300
    assert diff["growth_kib"] >= 290 and diff["top_tracebacks"][0]["traceback"][-1] == top["site"]
    assert len(kept) == 300


def test_rss_growth_is_reported_per_phase_against_the_idle_rss_before_the_chaos() -> None:
    doc = {"config": {"duration": 10.0, "backends": 2}, "timeline": [],
           "router": {"idle_before": {"rss_mib": 100.0, "fds": 20}, "idle_after": {"rss_mib": 108.0, "fds": 20},
                      "idle_after_phase": [{"rss_mib": 108.0, "fds": 20}, {"rss_mib": 109.0, "fds": 21}]}}
    _router_health(doc)
    assert doc["router"]["rss_growth_pct"] == pytest.approx(8.0)
    assert doc["router"]["rss_growth_per_phase_pct"] == pytest.approx([8.0, 1.0])  # a warm-up, not a leak

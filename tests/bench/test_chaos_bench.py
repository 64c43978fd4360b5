"""bench chaos: answers are judged against their references, migrations are
told from gaps that span a kill, bucket quantiles interpolate as Prometheus
does, and a short run with one kill writes a report in which every stream
is counted and, the mock being exact, every answer is identical."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.chaos_bench import (
    Workload,
    _parser,
    histogram_quantile,
    judge,
    main,
    migration_gap,
    parse_metrics,
)
from bench.client import RequestResult


def test_an_answer_is_identical_truncated_different_or_an_error() -> None:
    ref = " the river runs"
    assert judge(ref, None, ref) == "identical"
    assert judge(" the river", None, ref) == "truncated"  # a cut answer that ended with [DONE]
    assert judge(ref, "truncated", ref) == "truncated"  # all the text, but no [DONE]
    assert judge(" the stone runs", None, ref) == "different"
    assert judge(ref + " under", None, ref) == "different"
    assert judge("", "stream_error", ref) == "error"
    assert judge("", "http_503", ref) == "error"


def test_a_migration_is_a_long_gap_that_spans_a_kill() -> None:
    # Tokens at 1.0, 1.02, 1.04, then 1.30 (a 260 ms gap), 1.32.
    result = RequestResult(index=0, scheduled=0.0, ttft=0.5, itl=[0.02, 0.02, 0.26, 0.02])
    assert migration_gap(result, 0.5, kills=[1.1], threshold=0.06) == pytest.approx(0.26)
    assert migration_gap(result, 0.5, kills=[1.0], threshold=0.06) == pytest.approx(0.26)  # the last relayed token came just after
    assert migration_gap(result, 0.5, kills=[0.5], threshold=0.06) is None  # long before
    assert migration_gap(result, 0.5, kills=[1.1], threshold=0.3) is None  # not long enough
    assert migration_gap(result, 0.5, kills=[], threshold=0.06) is None
    assert migration_gap(RequestResult(index=0, scheduled=0.0), 0.5, kills=[1.1], threshold=0.06) is None


def test_bucket_quantiles_interpolate_inside_the_bucket_like_prometheus() -> None:
    buckets = [(0.01, 0.0), (0.05, 50.0), (0.1, 90.0), (math.inf, 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.05)
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.03)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.075)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.1)  # in +Inf: the last finite bound
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None
    assert histogram_quantile([], 0.5) is None


def test_metrics_are_summed_over_backends() -> None:
    text = "\n".join([
        "# TYPE headrace_migrations_total counter",  # as generate_latest writes it
        'headrace_migrations_total{reason="broken",outcome="resumed"} 3.0',
        'headrace_migrations_total{reason="stall",outcome="failed"} 1.0',
        "# TYPE headrace_resume_gap_seconds histogram",
        'headrace_resume_gap_seconds_bucket{backend="a",le="0.1"} 1.0',
        'headrace_resume_gap_seconds_bucket{backend="a",le="+Inf"} 2.0',
        'headrace_resume_gap_seconds_bucket{backend="b",le="0.1"} 1.0',
        'headrace_resume_gap_seconds_bucket{backend="b",le="+Inf"} 1.0',
        'headrace_resume_gap_seconds_count{backend="a"} 2.0',
        'headrace_resume_gap_seconds_sum{backend="a"} 0.3',
        "# TYPE headrace_backend_in_flight gauge",
        'headrace_backend_in_flight{backend="a"} 0.0',
        'headrace_backend_in_flight{backend="b"} 2.0',
        "",
    ])
    m = parse_metrics(text)
    assert m["migrations"] == {"broken:resumed": 3, "stall:failed": 1}
    assert m["histograms"]["headrace_resume_gap_seconds"] == [(0.1, 2.0), (math.inf, 3.0)]
    assert m["gauges"] == {"headrace_backend_in_flight": 2.0}


def test_the_workload_is_seeded_with_a_few_shared_shapes_and_some_cold_prompts() -> None:
    args = _parser().parse_args(["--prompts", "3", "--seeds", "2", "--cold-fraction", "0.2", "--prompt-tokens", "300"])
    a, b = Workload(args), Workload(args)
    picks = [a.pick(i) for i in range(500)]
    assert picks == [b.pick(i) for i in range(500)]
    assert len(a.shared) == 6 and all(len(s.prompt) == 300 and 100 <= s.max_tokens <= 200 for s in a.shared)
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
    rc = main(["--backends", "2", "--concurrency", "10", "--warmup", "0.5", "--duration", "2.5",
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
    assert set(doc["resume_gap_ms"]) == {"n", "p50", "p99"}
    assert {"resume_gap_p50_over_cold_ttft_p50", "client_gap_warm_p50_over_cold_ttft_p50"} <= set(doc["ratios"])
    assert doc["cpu"]["cores"] >= 1 and doc["cpu"]["model"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "identical to the reference" in capsys.readouterr().out

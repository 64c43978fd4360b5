"""``headrace bench router``: a whole run in a tiny configuration (real
processes on 127.0.0.1), and its pure parts: the rate search and the parsers
of wrk's and h2load's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import router_bench
from bench.cli import main as bench_main
from bench.drivers import parse_h2load, parse_wrk
from bench.loadgen import LoadConfig
from bench.router_bench import next_rate, passes

WRK = """Running 3s test @ http://127.0.0.1:1/v1/completions
  1 threads and 16 connections
  928 requests in 3.02s, 3.81MB read
  Non-2xx or 3xx responses: 3
  Socket errors: connect 0, read 2, write 0, timeout 1
Requests/sec:    306.90
incomplete: 4
"""
H2LOAD = """finished in 3.00s, 687.00 req/s, 2.74MB/s
requests: 2080 total, 2096 started, 2080 done, 2074 succeeded, 6 failed, 0 errored, 0 timeout
status codes: 2072 2xx, 0 3xx, 0 4xx, 2 5xx
"""


def test_wrk_output_counts_bad_statuses_and_bodies_without_done_as_errors() -> None:
    got = parse_wrk(WRK)
    assert got["requests"] == 928 and got["ok"] == 928 - 3 - 4
    assert got["errors"] == {"http_non_2xx": 3, "incomplete": 4, "socket_read": 2,
                             "socket_timeout": 1}


def test_h2load_output_counts_failures_and_non_2xx() -> None:
    got = parse_h2load(H2LOAD)
    assert got["ok"] == 2074 - 2 and got["errors"] == {"failed": 6, "http_non_2xx": 2}


def test_the_rate_search_doubles_until_a_failure_then_bisects_to_15_percent() -> None:
    assert next_rate(100, True, 100, None) == 200
    assert next_rate(400, False, 200, 400) == 300
    assert next_rate(300, True, 300, 400) == 350
    assert next_rate(350, True, 350, 400) is None  # 400 / 350 < 1.15
    assert next_rate(100, False, None, 100) == 50


def test_a_rate_passes_only_under_the_p99_limit_and_without_errors() -> None:
    def run(p99: float | None, errors: int) -> dict[str, object]:
        return {"e2e_ms": {"p99": p99}, "counts": {"errors": errors}}

    assert passes(run(120.0, 0), 500.0)
    assert not passes(run(120.0, 1), 500.0)
    assert not passes(run(650.0, 0), 500.0)
    assert not passes(run(None, 0), 500.0)


def test_a_tiny_router_bench_run_writes_the_json_with_cpu_per_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "router.json"
    rc = bench_main(["router", "--client", "python", "--concurrency", "2", "--duration", "1",
                     "--open-duration", "0.5", "--open-steps", "2", "--open-start", "20",
                     "--half-rounds", "2", "--open-connections", "2", "--vllm-router", "none", "--json", str(out), "--plot",
                     str(tmp_path / "router.png")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "router" and doc["cpu"]["cores"] >= 1 and "interrupted" not in doc
    rows = {(r["target"], r["http"]): r for r in doc["closed_loop"]}
    assert set(rows) == {("router", "1.1"), ("router", "2"), ("bare", "1.1"), ("bare", "2")}
    for r in rows.values():
        assert r["ok"] > 0 and r["errors"] == {} and r["req_s"] > 0
        assert r["cpu_ms_per_request"] > 0 and r["client"] == "python"
    assert rows["router", "2"]["mock_cpu_ms_per_request"] > 0
    assert set(doc["cpu_ratio_router_over_bare"]) == {"1.1", "2"}
    loop = doc["open_loop"]
    assert {r["label"] for r in loop["runs"]} == {"router", "direct"}
    assert loop["router_max_rate"] and loop["direct_max_rate"]  # 20-40 req/s pass on any box
    assert loop["at_half"]["added"]["ttft_ms"]["p50"]["delta"] is not None
    rounds = loop["at_half_rounds"]
    assert [r["first"] for r in rounds] == ["router", "direct"] and loop["at_half"] == rounds[0]
    assert loop["added_ttft_median_ms"] == router_bench.added_medians(rounds)
    for r in rounds:  # the router's CPU is measured over its runs, not the direct ones'
        assert 0 < r["router"]["server_cpu_share"] < 4 and r["router"]["server_cpu_ms_per_request"] > 0
        assert "server_cpu_share" not in r["direct"]
    assert all("server_cpu_share" in r for r in loop["runs"] if r["label"] == "router")
    assert loop["router_cpu_share"] == router_bench.cpu_shares(loop) and loop["router_cpu_share"]["at_judged"] > 0
    assert "skipped" in doc["vllm_router"]
    assert (tmp_path / "router.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "router CPU per request / bare hypercorn app's" in table and "open loop" in table
    assert "router CPU share (1.0: a core busy)" in table
    assert loop["connections"] == 2 and "open loop (Poisson, h2c, 2 connections)" in table


def test_the_bare_app_runs_on_stock_hypercorn_and_refuses_our_patches() -> None:
    """The yardstick must not be served by frontend/serving.py's patches:
    started as bench's module (the package imports them) it refuses; the
    bench starts it as a file, which imports none of headrace."""
    import subprocess
    import sys

    refused = subprocess.run([sys.executable, "-m", "bench.bare_app", "--port", "0"], capture_output=True,
                             text=True, timeout=60, cwd=router_bench.BARE_APP.parents[1])
    assert refused.returncode == 2 and "patched hypercorn" in refused.stderr
    probe = ("import runpy, sys; sys.argv = ['bare_app.py', '--help']\n"
             "try:\n    runpy.run_path(sys.argv_path, run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('frontend', 'backends', 'router', 'bench')))")
    probe = probe.replace("sys.argv_path", repr(str(router_bench.BARE_APP)))
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert loaded.returncode == 0 and loaded.stdout.strip().endswith("[]"), loaded.stdout + loaded.stderr


def test_the_added_ttft_is_the_median_over_the_rounds() -> None:
    def round_(p50: float | None, p99: float) -> dict[str, object]:
        return {"added": {"ttft_ms": {"p50": {"delta": p50}, "p99": {"delta": p99}}}}

    rounds = [round_(2.0, 7.0), round_(1.5, 18.0), round_(None, 4.0)]
    assert router_bench.added_medians(rounds) == {"p50": 1.75, "p99": 7.0}  # an unknown p50 is left out


def _run(rate: float, share: float | None = None, label: str = "router") -> dict[str, object]:
    """An open-loop run's summary as far as the CPU share goes."""
    return {"label": label, "rate": rate, **({} if share is None else {"server_cpu_share": share})}


def test_the_router_cpu_share_is_read_at_its_highest_rate_and_over_the_judged_rounds() -> None:
    loop = {"router_max_rate": 800.0,
            "runs": [_run(400.0, 0.31), _run(800.0, 0.88), _run(1600.0, 1.0), _run(800.0, label="direct")],
            "at_half_rounds": [{"router": {"server_cpu_share": s}} for s in (0.62, 0.71, 0.55)]}
    assert router_bench.cpu_shares(loop) == {"at_max": 0.88, "at_judged": 0.62}
    assert router_bench.cpu_shares({"router_max_rate": None, "runs": [_run(100.0, 0.9)]}) == {
        "at_max": None, "at_judged": None}  # nothing passed, no rounds


def test_the_rate_at_a_cpu_share_is_interpolated_over_the_passing_router_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = [_run(100.0, 0.1), _run(400.0, 0.3), _run(800.0, 0.7), _run(1600.0, 1.0), _run(1200.0, 0.99),
            _run(800.0, 0.05, "direct")]
    at = router_bench.rate_at_share
    assert at(runs, 0.5, 1200.0) == 600.0  # halfway between 400 (0.3) and 800 (0.7)
    assert at(runs, 0.05, 1200.0) == 50.0  # below the lowest: scaled down from it
    assert at(runs, 0.99, 1200.0) == 1200.0
    assert at(runs, 0.995, 1200.0) is None  # not that busy within the p99 limit (1600 failed)
    assert at(runs, 0.5, None) is None  # nothing passed
    assert router_bench.judged_rate(at(runs, 0.5, 1200.0), 1200.0, [100.0]) == 600.0
    assert bench_main(["router", "--added-at-share", "1.5", "--vllm-router", "none"]) == 2
    assert "--added-at-share must be between 0 and 1" in capsys.readouterr().err
    assert bench_main(["router", "--added-at", "450", "--added-at-share", "0.5", "--vllm-router", "none"]) == 2
    assert "one or the other" in capsys.readouterr().err


async def test_the_open_loop_judges_at_the_rate_of_the_share_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring from --added-at-share to the rounds' rate (the search and
    the runs faked: a router whose CPU share is its rate / 1,000)."""
    from types import SimpleNamespace

    from bench.client import RequestResult
    from bench.loadgen import RunResult
    from bench.report import summarize_run

    async def search(url: str, label: str, spec: object, *, runs: list[dict[str, object]], **_: object) -> float:
        if label == "router":
            runs.extend(_run(r, r / 1000) for r in (100.0, 400.0, 800.0))
        return 800.0 if label == "router" else 4000.0

    async def timed(url: str, spec: object, config: LoadConfig, label: str, *_: object) -> dict[str, object]:
        result = RequestResult(index=0, scheduled=0.0, ttft=0.002, e2e=0.003, output_tokens=2)
        summary = summarize_run(RunResult(config=config, wall=1.0, results=[result]), label=label)
        return {**summary, "server_cpu_share": config.rate / 1000} if label == "router" else summary

    monkeypatch.setattr(router_bench, "search_max_rate", search)
    monkeypatch.setattr(router_bench, "timed_run", timed)
    bed = SimpleNamespace(router=SimpleNamespace(url="http://r"), mocks=[SimpleNamespace(url="http://m")])
    for argv, rate, how in ((["--added-at-share", "0.5"], 500.0, "share 0.5"),
                            ([], 400.0, "half the router's highest rate")):
        out: dict[str, object] = {}
        await router_bench.open_loop(router_bench._parser().parse_args([*argv, "--half-rounds", "1"]), bed, out)  # type: ignore[arg-type]
        assert out["at_half"]["rate"] == rate and out["added_at"] == how  # type: ignore[index]


def test_the_added_ttft_is_judged_at_a_fixed_rate_when_given_else_at_half_the_maximum(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert router_bench.judged_rate(450.0, 1100.0, [100.0, 200.0]) == 450.0
    assert router_bench.judged_rate(None, 1100.0, [100.0, 200.0]) == 550.0
    assert router_bench.judged_rate(None, None, [200.0, 100.0]) == 50.0  # none passed: half the lowest tried
    assert bench_main(["router", "--added-at", "0", "--vllm-router", "none"]) == 2  # refused before anything starts
    assert "--added-at and --open-connections must be positive" in capsys.readouterr().err

"""headrace bench overload's pure parts: the slotted mock runs S streams at
once in arrival order, the plans are seeded Poisson schedules, the summary
counts goodput and refusals per class, the verdicts check the issue's
targets, and the router config it writes decodes."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import trio
import trio.testing

from backends.base import GenerateRequest
from backends.mock import MockBackend, MockConfig
from bench.overload_bench import (
    Outcome,
    Slotted,
    cpu_layout,
    fairness_plan,
    mixed_plan,
    pin,
    plot,
    router_config,
    schedule,
    summarize,
    summarize_probe,
    verdicts,
)
from bench.procs import Server
from bench.refusal_probe import run_queue_wait
from router.config import decode_config


async def test_the_slotted_mock_runs_its_slots_at_once_and_the_rest_in_order(autojump_clock: trio.testing.MockClock) -> None:
    backend = Slotted(MockBackend(MockConfig(ttft_s=1.0, max_tokens=1, models=("m",))), 2)
    done: list[tuple[int, float]] = []

    async def one(i: int) -> None:
        async for _ in backend.stream(GenerateRequest(model="m", prompt="x", max_tokens=1)):
            pass
        done.append((i, trio.current_time()))

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(one, i)
            await trio.sleep(0.01)
    assert [i for i, _ in done] == [0, 1, 2, 3, 4]
    assert [round(t) for _, t in done] == [1, 1, 2, 2, 3]


def test_plans_are_seeded_poisson_schedules_with_the_mix_and_a_20x_flood() -> None:
    times = schedule(50.0, 100.0, random.Random(1))
    assert 4500 < len(times) < 5500 and times == sorted(times) and times[-1] < 100
    plan = mixed_plan(20.0, 50.0, [0.2, 0.3, 0.5], seed=3)
    assert plan == mixed_plan(20.0, 50.0, [0.2, 0.3, 0.5], seed=3)
    share = sum(1 for _, _, c in plan if c == "batch") / len(plan)
    assert 0.45 < share < 0.55 and {(t, c) for _, t, c in plan} == {("chat", "interactive"), ("app", "default"), ("bulk", "batch")}
    fair = fairness_plan(2.0, 100.0, seed=0, flood=True)
    quiet, flood = sum(1 for _, t, _ in fair if t == "quiet"), sum(1 for _, t, _ in fair if t == "flood")
    assert 15 < flood / quiet < 25


def test_the_summary_counts_goodput_refusals_and_their_latency_per_class() -> None:
    outcomes = [
        Outcome(tenant="chat", cls="interactive", scheduled=0, status=200, ttft=0.1, e2e=1.0, good=True),
        Outcome(tenant="chat", cls="interactive", scheduled=1, status=200, ttft=2.0, e2e=3.0, error="deadline"),
        Outcome(tenant="bulk", cls="batch", scheduled=2, status=503, code="shed", e2e=0.004),
        Outcome(tenant="bulk", cls="batch", scheduled=3, status=503, code="queue_full", e2e=0.002),
    ]
    s = summarize(outcomes)
    assert s["classes"]["interactive"]["goodput"] == 0.5 and s["classes"]["interactive"]["gave_up"] == 1
    assert s["classes"]["batch"]["refused"] == {"shed": 1, "queue_full": 1}
    assert s["goodput"] == 0.25 and s["refusal_ms"]["count"] == 2
    assert s["refusal_ms"]["p50"] == pytest.approx(3.0)
    fair = {"count": 1, "ttft_ms": {"p50": 100.0, "p99": 110.0}}
    doc = {"mixed": {"on": s, "off": {**s, "goodput": 0.1}}, "fairness": {"solo": fair, "flooded": {**fair, "ttft_ms": {"p50": 1, "p99": 140.0}}}}
    v = verdicts(doc)
    assert v["total_goodput_on_vs_off"]["ok"] and not v["refusal_p99_ms"]["ok"]  # no probe ran: no verdict
    assert not v["interactive_goodput_on"]["ok"] and not v["quiet_ttft_p99_ratio"]["ok"]
    # The refusal verdict is the probe's, in its own process; admitted probes are not refusals.
    answers = [{"status": 503, "code": "shed", "ms": 4.0}, {"status": 503, "code": "shed", "ms": 6.0},
               {"status": 200, "code": None, "ms": 900.0}]  # fmt: skip
    probe = summarize_probe(answers, argparse.Namespace(probe_rate=5.0))
    assert probe["sent"] == 3 and probe["refused"] == {"shed": 2} and probe["refusal_ms"]["count"] == 2
    assert verdicts({**doc, "mixed": {**doc["mixed"], "on": {**s, "probe": probe}}})["refusal_p99_ms"]["ok"]
    slow = summarize_probe([*answers, {"status": 429, "code": "rate_limited", "ms": 40.0}], argparse.Namespace(probe_rate=5.0))
    assert not verdicts({**doc, "mixed": {**doc["mixed"], "on": {**s, "probe": slow}}})["refusal_p99_ms"]["ok"]


def test_the_router_config_it_writes_decodes() -> None:
    args = argparse.Namespace(deadlines=[3.0, 8.0, 20.0], slots=4)
    mocks = [Server(f"mock{i}", None, f"http://127.0.0.1:{9000 + i}", None) for i in range(2)]  # type: ignore[arg-type]
    for admission in (True, False):
        config = decode_config(tomllib.loads(router_config(mocks, args, admission=admission, reserve=4)))
        assert config.admission.enabled is admission and config.admission.reserve_slots == 4
        assert [b.max_concurrency for b in config.backends] == [4, 4]
        assert config.tenants["bulk"].max_priority == "batch" and len(config.auth.api_keys) == 6


def test_the_probe_reads_run_queue_waits_and_the_samples_and_plot_carry_them(tmp_path: Path) -> None:
    """A thread's run-queue wait is read from /proc (and grows while two
    threads want one CPU); the summary keeps each refusal's waits; the plot
    draws a run with admission on only (--skip-off)."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:1])
    try:
        before = run_queue_wait(None)
        assert before > 0 and run_queue_wait(os.getpid()) > 0
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the same (inherited) CPU
        try:
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                pass
        finally:
            spin.kill()
            spin.wait()
        assert run_queue_wait(None) - before > 0.05  # it waited while the other ran
    finally:
        os.sched_setaffinity(0, allowed)
    assert run_queue_wait(2**22 + 12345) == 0.0  # no such process
    answers = [{"status": 503, "code": "shed", "ms": 4.0, "at": 1.0, "probe_wait_ms": 0.5, "router_wait_ms": 1.0}]
    probe = summarize_probe(answers, argparse.Namespace(probe_rate=5.0))
    assert probe["samples"] == [[1.0, 4.0, "shed", 0.5, 1.0]]
    s = summarize([Outcome(tenant="chat", cls="interactive", scheduled=0, status=200, ttft=0.1, e2e=1.0, good=True)])
    empty = {"count": 0, "ttft_ms": {"p50": None, "p99": None}, "ttfts_ms": []}
    doc = {"bed": {"load": 2.0}, "cpu": {"model": "x"}, "mixed": {"on": {**s, "probe": probe}},
           "fairness": {"solo": empty, "flooded": empty}}  # fmt: skip
    assert plot(doc, tmp_path / "p.png").stat().st_size > 1000


def test_pinned_the_router_has_a_cpu_of_its_own() -> None:
    assert cpu_layout(False) is None
    cpus = sorted(os.sched_getaffinity(0))
    layout = cpu_layout(True)
    if len(cpus) < 2:
        assert layout is None
        return
    assert layout == {"router": cpus[:1], "others": cpus[1:]}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pin(child.pid, layout["router"])
        assert os.sched_getaffinity(child.pid) == set(cpus[:1])
    finally:
        child.kill()
        child.wait()

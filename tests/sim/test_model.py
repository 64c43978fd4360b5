"""The simulator's model (``sim.model``): exact times on a hand-worked case,
the same answer for the same seed, a sticky policy beating round robin on
the shared-prefix workload, and policies hearing what the router would tell
them (feedback in order, KV events that rebuild each backend's cache)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from policies.base import BackendView, KVEventView, RouteRequest
from policies.registry import create_policy
from sim.model import ModelConfig, SimResult, simulate
from sim.report import summarize_result
from sim.trace import TraceRecord, prepare
from sim.workloads import SharedPrefix, shared_prefix

SMALL = SharedPrefix(requests=800, rate=30.0, think_s=2.0)
MODEL = ModelConfig(backends=4, cache_blocks=400)


def _run(policy: object, model: ModelConfig = MODEL, seed: int = 0) -> SimResult:
    return simulate(policy, prepare(shared_prefix(SMALL, seed=seed), model.block_size), model)


class Sticky:
    """Every request of a group (same first block) to one backend."""

    def pick(self, candidates: Sequence[BackendView], request: RouteRequest, now: float) -> str | None:
        names = sorted(c.name for c in candidates)
        return names[request.block_hashes[0] % len(names)]


def test_one_backend_gives_the_hand_computed_first_token_and_finish_times() -> None:
    """ttft 10 ms, 1 ms per uncached token, blocks of 4, decode 10 ms a step
    at batch 1 and 15 ms at batch 2 (slope 0.5).

    r1 (40 tokens, 3 out) at 0: lane 10-50 ms; decodes from 50 ms.
    r2 (shares r1's first 32 tokens, 40, 2 out) at 10 ms: lane waits for r1,
    32 cached, 8 ms: first token 58 ms. r1 has done 0.8 of a step by then;
    at batch 2 r2's step ends at 58 + 15 = 73 ms, r1's last 0.2 at 75 ms.
    r3 (20 tokens, 1 out) at 20 ms: lane 58-78 ms, done with its first token."""
    a = list(range(40))
    records = [
        TraceRecord(t=0.0, prompt_token_ids=a, output_tokens=3, id="r1"),
        TraceRecord(t=0.01, prompt_token_ids=a[:32] + list(range(100, 108)), output_tokens=2, id="r2"),
        TraceRecord(t=0.02, prompt_token_ids=list(range(200, 220)), output_tokens=1, id="r3"),
    ]
    model = ModelConfig(backends=1, block_size=4, cache_blocks=100, ttft_s=0.01,
                        prefill_s_per_token=0.001, decode_step_s=0.01, batch_slope=0.5, max_running=0)
    result = simulate(create_policy("round_robin"), prepare(records, 4), model, record=True)
    assert result.records is not None
    got = {r.request_id: (r.first_token - r.arrival, r.done, r.cached_tokens) for r in result.records}
    assert got == {
        "r1": (pytest.approx(0.050), pytest.approx(0.075), 0),
        "r2": (pytest.approx(0.048), pytest.approx(0.073), 32),
        "r3": (pytest.approx(0.058), pytest.approx(0.078), 0),
    }
    assert (result.prompt_tokens, result.cached_tokens, result.makespan_s) == (100, 32, pytest.approx(0.078))


def test_a_full_backend_queues_requests_until_one_finishes() -> None:
    records = [TraceRecord(t=0.0, prompt_token_ids=[i] * 10, output_tokens=5, id=f"r{i}") for i in range(2)]
    model = ModelConfig(backends=1, block_size=4, ttft_s=0.0, prefill_s_per_token=0.001,
                        decode_step_s=0.01, batch_slope=0.0, max_running=1)
    result = simulate(create_policy("round_robin"), prepare(records, 4), model, record=True)
    assert result.records is not None
    # r0: prefill 10 ms, 4 steps: done at 50 ms; r1 only starts then.
    assert [(r.first_token, r.done) for r in result.records] == [
        (pytest.approx(0.010), pytest.approx(0.050)), (pytest.approx(0.060), pytest.approx(0.100))
    ]


def test_the_same_seed_gives_the_same_results_and_another_seed_does_not() -> None:
    def numbers(seed: int) -> dict[str, object]:
        summary = summarize_result("rr", _run(create_policy("round_robin"), seed=seed))
        summary.pop("sim_wall_s")
        return summary

    assert numbers(1) == numbers(1)
    assert numbers(1) != numbers(2)


def test_a_sticky_policy_hits_the_prefix_cache_far_more_than_round_robin() -> None:
    sticky, rr = _run(Sticky()), _run(create_policy("round_robin"))
    assert sticky.requests == rr.requests == 800 and sticky.completed == 800
    hit = {k: r.cached_tokens / r.prompt_tokens for k, r in (("sticky", sticky), ("rr", rr))}
    assert hit["sticky"] > 1.5 * hit["rr"], hit
    assert sorted(sticky.ttft_s)[400] < sorted(rr.ttft_s)[400]


class Recorder(Sticky):
    """Sticky, plus every optional method, checking what it hears."""

    def __init__(self) -> None:
        self.cached: dict[str, set[int]] = {}
        self.last_seq: dict[str, int] = {}
        self.state: dict[str, str] = {}
        self.subscribed: list[str] = []

    def kv_since(self, backend: str) -> int:
        self.subscribed.append(backend)
        return self.last_seq.get(backend, -1)

    def on_kv_events(self, backend: str, events: Sequence[KVEventView], now: float) -> bool:
        blocks = self.cached.setdefault(backend, set())
        for e in events:
            assert e.seq == self.last_seq.get(backend, 0) + 1
            self.last_seq[backend] = e.seq
            (blocks.update if e.kind == "stored" else blocks.difference_update)(e.block_hashes)
        assert len(blocks) <= MODEL.cache_blocks
        return True

    def on_dispatch(self, backend: str, request: RouteRequest, now: float) -> None:
        assert request.request_id not in self.state
        self.state[request.request_id] = "dispatched"

    def on_first_token(self, backend: str, request: RouteRequest, now: float) -> None:
        assert self.state[request.request_id] == "dispatched"
        self.state[request.request_id] = "first"
        assert set(request.block_hashes) <= self.cached[backend]  # just stored, and heard

    def on_complete(self, backend: str, request: RouteRequest, now: float, *, ok: bool,
                    cached_tokens: int | None) -> None:
        assert ok and cached_tokens is not None and self.state[request.request_id] == "first"
        self.state[request.request_id] = "done"


def test_a_policy_hears_dispatch_first_token_complete_and_kv_events_as_from_the_router() -> None:
    recorder = Recorder()
    result = _run(recorder)
    assert sorted(recorder.subscribed) == ["b0", "b1", "b2", "b3"]
    assert set(recorder.state.values()) == {"done"} and len(recorder.state) == result.requests
    assert result.kv_events == sum(recorder.last_seq.values()) and result.kv_resyncs == 0

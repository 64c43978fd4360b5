"""How much to speculate: the allocation rule (k grows with acceptance, shrinks
with cost and batch size, never exceeds caps or the step budget, and is the best
allocation there is), the online step-cost fit, the per-match-length acceptance
estimates, and the draft model's per-request AdaptiveK."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.spec_policy import (
    Candidate,
    MatchAcceptance,
    StepCost,
    match_bucket,
    plan_drafts,
)
from backends.engine.speculative import AdaptiveK, SpecConfig, best_k

# Measured on this project's CPU (SmolLM2-135M, 2 threads): a one-row step ~50 ms,
# each more row ~4 ms at batch 1 (float32).
A, B = 0.050, 0.004


def line(a: float, b: float) -> Callable[[int], float]:
    return lambda rows: a + b * rows


def plan(cands: list[Candidate], tokens: float, rows: int, max_rows: int = 512) -> list[int]:
    return plan_drafts(cands, tokens=tokens, rows=rows, step_time=line(A, B), max_rows=max_rows)


def test_a_sure_match_alone_verifies_every_draft_it_has() -> None:
    assert plan([Candidate(0.98, 0.97, 15)], tokens=1, rows=1) == [15]


def test_k_grows_with_acceptance() -> None:
    ks = [plan([Candidate(q, q, 15)], tokens=1, rows=1)[0] for q in (0.02, 0.3, 0.6, 0.9)]
    assert ks[0] == 0
    assert ks == sorted(ks) and ks[-1] > ks[1]


def test_k_shrinks_as_rows_get_dearer() -> None:
    c = [Candidate(0.7, 0.8, 15)]
    ks = [plan_drafts(c, tokens=1, rows=1, step_time=line(A, b), max_rows=512)[0]
          for b in (0.001, 0.004, 0.02, 0.1)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_a_large_batch_turns_speculation_off_for_what_pays_alone() -> None:
    """Batch 16 at bfloat16-like costs (a step ~60 ms, a row ~1.5 ms): a 1-token
    match (q ~ 0.25) pays for a lone request, not next to 15 others."""
    weak = Candidate(0.25, 0.7, 15)
    cost = line(0.060, 0.0015)
    alone = plan_drafts([weak], tokens=1, rows=1, step_time=cost, max_rows=512)
    crowd = plan_drafts([weak] * 16, tokens=16, rows=16, step_time=cost, max_rows=512)
    assert alone[0] > 0 and crowd == [0] * 16
    sure = plan_drafts([Candidate(0.95, 0.95, 15)] * 16, tokens=16, rows=16, step_time=cost,
                       max_rows=512)
    assert all(k > 0 for k in sure)  # copying requests still speculate in a crowd


def test_a_jump_in_step_time_is_planned_around() -> None:
    """CPU kernels: 2 and 3 rows cost little more than 1, 4 rows a lot more. A
    middling proposal verifies 2 drafts; a sure one jumps the step and takes all."""
    def bumpy(rows: int) -> float:
        return 0.040 * (1.0 + 0.05 * (rows - 1)) if rows <= 3 else 0.064 + 0.004 * rows
    middling = plan_drafts([Candidate(0.6, 0.7, 15)], tokens=1, rows=1, step_time=bumpy, max_rows=64)
    sure = plan_drafts([Candidate(0.98, 0.98, 15)], tokens=1, rows=1, step_time=bumpy, max_rows=64)
    assert middling == [2] and sure == [15]


def test_a_plan_that_barely_pays_is_dropped_under_a_margin() -> None:
    """One draft right 1 time in 8 adds 0.125 tokens; if its row costs 1 % more time
    that is 11 % more tokens/s: kept under a 5 % margin, dropped under 20 %."""
    c = [Candidate(0.125, 0.5, 1)]
    cheap = line(0.050, 0.0005)
    assert plan_drafts(c, tokens=1, rows=1, step_time=cheap, max_rows=64, min_gain=0.05) == [1]
    assert plan_drafts(c, tokens=1, rows=1, step_time=cheap, max_rows=64, min_gain=0.2) == [0]


def test_the_row_budget_and_each_cap_are_respected() -> None:
    ks = plan([Candidate(0.99, 0.99, 15)] * 4, tokens=4, rows=4, max_rows=20)
    assert sum(ks) == 16 and all(k <= 15 for k in ks)
    assert plan([Candidate(0.99, 0.99, 2), Candidate(0.99, 0.99, 0)], tokens=2, rows=2) == [2, 0]


def _throughput(cands: list[Candidate], ks: tuple[int, ...], tokens: float, rows: int,
                cost: Callable[[int], float]) -> float:
    n = tokens + sum(sum(c.q * c.beta**j for j in range(k)) for c, k in zip(cands, ks, strict=True))
    return n / cost(rows + sum(ks))


@settings(max_examples=80, deadline=None)
@given(
    cands=st.lists(
        st.builds(Candidate, st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 4)),
        min_size=1, max_size=3,
    ),
    extra=st.integers(0, 20),
    bumps=st.lists(st.floats(0.0, 0.05), min_size=40, max_size=40),
)
def test_the_plan_is_the_best_allocation(cands: list[Candidate], extra: int,
                                         bumps: list[float]) -> None:
    """No allocation within the caps gives more expected tokens per second, for any
    step time that grows with the rows (bumps included)."""
    steps = itertools.accumulate(bumps, initial=A)
    table = list(steps)

    def cost(rows: int) -> float:
        return table[rows] + B * rows

    tokens, rows = len(cands), len(cands) + extra
    best = max(
        _throughput(cands, ks, tokens, rows, cost)
        for ks in itertools.product(*[range(c.cap + 1) for c in cands])
    )
    ks = plan_drafts(cands, tokens=tokens, rows=rows, step_time=cost, max_rows=512)
    assert all(0 <= k <= c.cap for k, c in zip(ks, cands, strict=True))
    assert _throughput(cands, tuple(ks), tokens, rows, cost) >= best * (1 - 1e-9)


def test_the_cost_fit_recovers_a_linear_step_time() -> None:
    cost = StepCost()
    for i in range(60):
        rows = 1 + (i * 7) % 16
        cost.observe(rows, 0.040 + 0.003 * rows)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.040, rel=0.05) and b == pytest.approx(0.003, rel=0.05)


def test_before_the_data_vary_the_prior_slope_holds() -> None:
    cost = StepCost(prior_row_cost=0.1)
    assert cost.coefficients() == (1.0, 0.1)
    for _ in range(30):
        cost.observe(1, 0.050)  # only one-row steps: the slope is not identified
    assert cost.predict(1) == pytest.approx(0.050, rel=0.02)
    assert cost.coefficients()[1] == pytest.approx(0.005, rel=0.2)  # 10 % of a one-row step


def test_one_stalled_step_moves_the_fit_only_a_little() -> None:
    cost = StepCost()
    for i in range(40):
        cost.observe(1 + i % 8, 0.040 + 0.003 * (1 + i % 8))
    before = cost.predict(4)
    cost.observe(4, 5.0)  # the machine was busy elsewhere for five seconds
    assert cost.predict(4) < 1.5 * before


def test_where_the_table_has_data_it_beats_the_line() -> None:
    cost = StepCost()
    measured = {1: 0.040, 2: 0.042, 3: 0.046, 4: 0.064, 5: 0.068, 8: 0.080}
    for _ in range(20):
        for rows, t in measured.items():
            cost.observe(rows, t)
    assert all(cost.predict(r) == pytest.approx(t, rel=1e-3) for r, t in measured.items())
    a, b = cost.coefficients()
    assert cost.predict(6) == pytest.approx(a + b * 6)  # no data: the line


def test_old_regimes_fade() -> None:
    cost = StepCost()
    for i in range(100):
        cost.observe(1 + i % 8, 0.040 + 0.003 * (1 + i % 8))
    for i in range(200):
        cost.observe(1 + i % 8, 0.080 + 0.001 * (1 + i % 8))
    a, b = cost.coefficients()
    assert a == pytest.approx(0.080, rel=0.05) and b == pytest.approx(0.001, rel=0.1)


def test_match_buckets_order_match_lengths() -> None:
    assert [match_bucket(m) for m in (0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 40)] == [
        0, 1, 2, 3, 4, 5, 5, 6, 6, 7, 7]


def test_acceptance_is_learned_per_match_length_and_per_greedy() -> None:
    acc = MatchAcceptance()
    for _ in range(200):
        acc.observe(True, 1, 4, 0)  # one-token matches: always wrong
        acc.observe(True, 12, 8, 8)  # long matches: always right
    q1, _ = acc.estimate(True, 1)
    q12, beta12 = acc.estimate(True, 12)
    assert q1 < 0.05 and q12 > 0.95 and beta12 > 0.95
    assert acc.estimate(False, 12) == MatchAcceptance().estimate(False, 12)  # sampled: untouched


def test_beta_counts_the_drafts_after_the_first() -> None:
    acc = MatchAcceptance(prior_weight=1e-9)
    acc.observe(True, 4, 5, 3)  # d0, d1, d2 accepted, d3 rejected: beta = 2 / 3
    assert acc.estimate(True, 4) == pytest.approx((1.0, 2 / 3))


def test_a_skipped_bucket_is_probed_now_and_then() -> None:
    acc = MatchAcceptance(probe_interval=4)
    assert [acc.probe(True, 1, 0) for _ in range(8)] == [False, False, False, True] * 2
    acc.probe(True, 1, 0)
    assert acc.probe(True, 1, 3) is False  # planned drafts reset the count
    assert [acc.probe(True, 1, 0) for _ in range(4)] == [False, False, False, True]


def test_the_engine_config_defaults_k_by_method() -> None:
    assert SpecConfig(method="ngram").k_max == 15
    assert SpecConfig(method="draft", draft_layers=2).k_max == 4
    assert SpecConfig(num_speculative_tokens=6).k_max == 6


# -- the draft model's per-request k ---------------------------------------------


def test_best_k_grows_with_acceptance_and_shrinks_with_cost() -> None:
    assert best_k(0.05, 8, 0.1) == 0
    assert best_k(0.5, 8, 0.1) < best_k(0.9, 8, 0.1)
    assert best_k(1.0, 8, 0.0) == 8
    assert best_k(0.9, 8, 1.0) < best_k(0.9, 8, 0.05)


def test_low_acceptance_turns_speculation_off_then_probes() -> None:
    a = AdaptiveK(SpecConfig(num_speculative_tokens=4, probe_interval=3).adaptive_policy())
    assert a.k_for("s") > 0
    for _ in range(10):
        a.observe("s", 4, 0)
    assert a.acceptance("s") < 0.05
    assert [a.k_for("s") for _ in range(6)] == [0, 0, 1, 0, 0, 1]


def test_high_acceptance_uses_the_full_k() -> None:
    a = AdaptiveK(SpecConfig(num_speculative_tokens=5).adaptive_policy())
    for _ in range(10):
        a.observe("s", 5, 5)
    assert a.acceptance("s") > 0.9
    assert a.k_for("s") == 5


def test_recovery_after_a_bad_patch() -> None:
    a = AdaptiveK(SpecConfig(num_speculative_tokens=4).adaptive_policy())
    for _ in range(6):
        a.observe("s", 4, 0)
    low = a.k_for("s")
    for _ in range(10):
        a.observe("s", 4, 4)
    assert a.k_for("s") > low


def test_non_adaptive_k_ignores_acceptance() -> None:
    fixed = AdaptiveK(SpecConfig(adaptive=False, num_speculative_tokens=3).adaptive_policy())
    fixed.observe("s", 3, 0)
    assert fixed.k_for("s") == 3


def test_forget_resets_to_the_prior() -> None:
    a = AdaptiveK(SpecConfig(prior_acceptance=0.6).adaptive_policy())
    a.observe("s", 4, 0)
    a.forget("s")
    assert a.acceptance("s") == pytest.approx(0.6)

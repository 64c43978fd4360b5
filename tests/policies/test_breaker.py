"""The breaker: its transition table (every pair legal or an error), trips
on consecutive failures or a failure rate, ejection times base x n capped,
half-open probes, the fleet rule (never the last backend, at most a
fraction, in each model group apart), the retry budget and full-jitter backoff."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.breaker import (
    TRANSITIONS,
    BreakerError,
    BreakerEvent,
    BreakerOptions,
    BreakerPolicy,
    Breakers,
    BreakerState,
    CircuitBreaker,
    RetryBudget,
    full_jitter,
    next_state,
)
from policies.registry import create

S, E = BreakerState, BreakerEvent


@given(st.sampled_from(list(S)), st.sampled_from(list(E)))
def test_every_pair_is_in_the_table_or_an_error(state: BreakerState, event: BreakerEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert next_state(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(BreakerError):
            next_state(state, event)


def test_the_table_has_the_three_state_cycle() -> None:
    assert next_state(S.CLOSED, E.TRIP) is S.OPEN
    assert next_state(S.OPEN, E.COOLED) is S.HALF_OPEN
    assert next_state(S.HALF_OPEN, E.RECOVERED) is S.CLOSED
    assert next_state(S.HALF_OPEN, E.FAILURE) is S.OPEN
    with pytest.raises(BreakerError):
        next_state(S.CLOSED, E.COOLED)


def test_five_failures_in_a_row_open_it_and_a_success_resets_the_count() -> None:
    b = CircuitBreaker(BreakerOptions(consecutive_failures=5, failure_rate=2.0))
    for _ in range(4):
        b.record(False, 0.0)
    b.record(True, 0.0)
    for _ in range(4):
        assert b.record(False, 0.0) is S.CLOSED
    assert b.record(False, 0.0) is S.OPEN and not b.allows(0.0)


def test_open_half_open_probes_then_closed_and_a_failed_probe_reopens_for_longer() -> None:
    o = BreakerOptions(consecutive_failures=1, base_ejection=30, max_ejection=70, half_open_successes=2)
    b = CircuitBreaker(o)
    b.record(False, 0.0)
    assert not b.allows(29.9) and b.allows(30.0) and b.state is S.HALF_OPEN
    b.dispatched(30.0), b.dispatched(30.0)
    assert not b.allows(30.0)  # two probes in flight: no third
    assert b.record(False, 31.0) is S.OPEN and b.open_until == 31.0 + 60  # second ejection: 2 x base
    b.poll(91.0)
    b.record(False, 91.0)
    assert b.open_until == 91.0 + 70  # third: capped
    b.poll(161.0)
    assert b.record(True, 161.0) is S.HALF_OPEN and b.record(True, 161.5) is S.CLOSED


def test_a_failure_rate_over_the_window_opens_it() -> None:
    b = CircuitBreaker(BreakerOptions(consecutive_failures=100, failure_rate=0.5, min_requests=10, window=10))
    for i in range(10):
        state = b.record(i % 2 == 0, i * 0.1)
    assert state is S.OPEN
    # Old outcomes age out: the same pattern spread over a long time does not trip.
    b2 = CircuitBreaker(BreakerOptions(consecutive_failures=100, failure_rate=0.5, min_requests=10, window=10))
    assert all(b2.record(i % 2 == 0, i * 3.0) is S.CLOSED for i in range(40))


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 40)), max_size=80))
def test_an_open_breaker_refuses_and_only_a_probe_run_closes_it(steps: list[tuple[bool, float]]) -> None:
    b, now = CircuitBreaker(BreakerOptions(consecutive_failures=3, base_ejection=10, max_ejection=40)), 0.0
    for ok, dt in steps:
        now += dt
        before = b.poll(now)
        if b.allows(now):
            b.dispatched(now)
        after = b.record(ok, now)
        if before is S.OPEN:  # an outcome of a stream that started earlier: still open
            assert after is S.OPEN and not b.allows(now)
        if after is S.CLOSED and before is S.HALF_OPEN:
            assert ok
        if after is S.OPEN:
            assert b.open_until is not None and b.open_until - now <= 40 + 1e-9


@settings(max_examples=100)
@given(n=st.integers(1, 10), fraction=st.floats(0, 1), order=st.permutations(range(10)))
def test_the_fleet_never_ejects_its_last_backend_or_more_than_its_fraction(n: int, fraction: float, order: list[int]) -> None:
    fleet = Breakers(BreakerOptions(consecutive_failures=1, max_ejection_fraction=fraction))
    names = [f"b{i}" for i in range(n)]
    fleet.add(names)
    for i in order:
        if i < n:
            fleet.record(names[i], False, 0.0)
    ejected = sum(fleet.state(x, 0.0) is not S.CLOSED for x in names)
    assert ejected <= max(1, int(fraction * n)) and (ejected < n or ejected == 0)
    assert any(fleet.allows(x, 0.0) for x in names)


@settings(max_examples=100)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    loose=st.integers(0, 3),
    fraction=st.floats(0, 1),
    order=st.lists(st.integers(0, 17), max_size=40),
)
def test_the_fleet_rule_holds_in_each_group_apart(sizes: list[int], loose: int, fraction: float, order: list[int]) -> None:
    """Each model group keeps its own fraction and its last backend; the
    backends in no group form one more group."""
    fleet = Breakers(BreakerOptions(consecutive_failures=1, max_ejection_fraction=fraction))
    groups = [[f"g{g}b{i}" for i in range(n)] for g, n in enumerate(sizes)]
    rest = [f"r{i}" for i in range(loose)]
    fleet.add(rest)
    fleet.set_groups(groups)
    names = [b for g in groups for b in g] + rest
    for i in order:
        fleet.record(names[i % len(names)], False, 0.0)
    for group in [*groups, rest] if rest else groups:
        ejected = sum(fleet.state(x, 0.0) is not S.CLOSED for x in group)
        assert (ejected <= max(1, int(fraction * len(group))) and ejected < len(group)) or ejected == 0
        assert any(fleet.allows(x, 0.0) for x in group)


def test_one_groups_ejections_do_not_count_against_another() -> None:
    """Fleet-wide counting would refuse b's ejection here (a's group has its
    one allowed ejection, and 2 of 4 is the fleet's fraction); per group it
    is allowed, and a group's last backend is still never ejected."""
    fleet = Breakers(BreakerOptions(consecutive_failures=1, max_ejection_fraction=0.5))
    fleet.set_groups([["a1", "a2"], ["b1", "b2"]])
    fleet.record("a1", False, 0.0)
    fleet.record("b1", False, 0.0)
    assert fleet.state("a1", 0.0) is S.OPEN and fleet.state("b1", 0.0) is S.OPEN
    fleet.record("b2", False, 0.0)
    assert fleet.state("b2", 0.0) is S.CLOSED
    assert [s.refused_trips for s in fleet.statistics(0.0)] == [0, 0, 0, 1]
    # a backend in two groups goes only if both allow it
    shared = Breakers(BreakerOptions(consecutive_failures=1, max_ejection_fraction=0.5))
    shared.set_groups([["x", "s"], ["y", "s", "z", "w"]])
    shared.record("x", False, 0.0)
    shared.record("s", False, 0.0)
    assert shared.state("s", 0.0) is S.CLOSED


def test_the_fleet_policy_comes_from_the_registry_with_options() -> None:
    fleet = create("breaker", "standard", {"consecutive_failures": 2, "base_ejection": 5})
    assert isinstance(fleet, BreakerPolicy) and fleet.options.consecutive_failures == 2


@given(in_flight=st.integers(0, 1000), ratio=st.floats(0, 1), minimum=st.integers(0, 5), tries=st.integers(0, 400))
def test_retries_in_flight_stay_within_the_budget(in_flight: int, ratio: float, minimum: int, tries: int) -> None:
    budget = RetryBudget(ratio, minimum)
    granted = sum(budget.try_acquire(in_flight) for _ in range(tries))
    assert granted == min(tries, max(minimum, int(ratio * in_flight)))
    budget.release()
    assert budget.active == max(0, granted - 1)


@given(attempt=st.integers(1, 20), draw=st.floats(0, 0.9999))
def test_full_jitter_is_uniform_below_a_capped_exponential(attempt: int, draw: float) -> None:
    wait = full_jitter(attempt, draw, base=0.025, cap=0.25)
    assert 0 <= wait <= min(0.25, 0.025 * 2 ** (attempt - 1))


def test_a_probe_released_without_a_verdict_gives_its_half_open_slot_back() -> None:
    b = CircuitBreaker(BreakerOptions(consecutive_failures=1, base_ejection=10, half_open_successes=1))
    b.record(False, 0.0)
    b.dispatched(10.0)
    assert b.state is S.HALF_OPEN and not b.allows(10.0)  # the one probe is out
    b.release(10.0)  # cancelled: no verdict
    assert b.state is S.HALF_OPEN and b.allows(10.0)
    b.dispatched(11.0)
    assert b.record(True, 11.0) is S.CLOSED
    b.release(12.0)  # closed: nothing to give back
    assert b.probes == 0 and b.allows(12.0)


def test_the_retry_budget_reports_its_counters() -> None:
    budget = RetryBudget(ratio=0, min_retries=1)
    assert budget.try_acquire(10) and not budget.try_acquire(10)
    s = budget.statistics()
    assert (s.active, s.granted, s.refused) == (1, 1, 1)

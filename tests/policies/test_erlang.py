"""The M/M/c formulas (policies/erlang.py) against published values, and
the response-time tail against a direct numerical integration."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission import expected_wait as admission_wait
from policies.erlang import (
    erlang_b,
    erlang_c,
    expected_wait,
    mean_wait,
    response_quantile,
    response_tail,
    servers_needed,
    wait_tail,
)


def test_erlang_c_matches_the_published_call_centre_example() -> None:
    """The worked Erlang-C example of the call-centre literature (Mitan's
    "The Erlang-C formula", also in callcentrehelper.com's and the
    Nemotron-CC math corpus' copies): 360 calls per half hour, 240 s mean
    call, 55 agents, 15 s target. Published: traffic 48 erlangs, occupancy
    87.3%, probability of waiting 23.9%, mean answer time 8.2 s, service
    level 84.6% answered within 15 s."""
    lam, mu, c = 360 / 1800, 1 / 240, 55
    a = lam / mu
    assert a == pytest.approx(48)
    assert round(100 * a / c, 1) == 87.3
    assert round(100 * erlang_c(c, a), 1) == 23.9
    assert round(mean_wait(c, lam, mu), 1) == 8.2
    assert round(100 * (1 - wait_tail(15, c, lam, mu)), 1) == 84.6


@pytest.mark.parametrize(
    ("servers", "load", "expected"),
    [
        (3, 2.0, 4 / 9),  # Wolfram Language ErlangC[3, 2] = 4/9 (its documentation's basic example)
        (1, 0.5, 0.5),  # M/M/1: P(wait) = rho
        (2, 1.0, 1 / 3),  # M/M/2: 2 rho^2 / (1 + rho) at rho = 1/2
    ],
)
def test_erlang_c_known_values(servers: int, load: float, expected: float) -> None:
    assert erlang_c(servers, load) == pytest.approx(expected, rel=1e-12)


def _erlang_c_by_factorials(c: int, a: float) -> float:
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.floats(0.01, 0.99))
def test_the_recursion_equals_the_factorial_formula(c: int, rho: float) -> None:
    assert erlang_c(c, rho * c) == pytest.approx(_erlang_c_by_factorials(c, rho * c), rel=1e-9)


def test_unstable_and_idle_edges() -> None:
    assert erlang_c(4, 4.0) == 1.0 and erlang_c(4, 0.0) == 0.0
    assert mean_wait(2, 3.0, 1.0) == math.inf and wait_tail(1.0, 2, 3.0, 1.0) == 1.0
    assert response_quantile(0.99, 2, 2.0, 1.0) == math.inf
    assert erlang_b(0, 3.0) == 1.0
    with pytest.raises(ValueError):
        response_quantile(1.0, 2, 1.0, 1.0)


@pytest.mark.parametrize(("c", "lam", "mu"), [(1, 0.5, 1.0), (4, 3.0, 1.0), (8, 6.0, 0.75), (3, 1.0, 0.5)])
def test_response_tail_is_the_convolution_of_wait_and_service(c: int, lam: float, mu: float) -> None:
    """P(W + S > t) by integrating the waiting time's law numerically
    (an atom 1 - C at 0 and density C θ e^{-θw}) against P(S > t - w)."""
    theta, pc = c * mu - lam, erlang_c(c, lam / mu)
    for t in (0.1, 1.0, 3.0, 8.0):
        steps = 20000
        dw = t / steps
        integral = sum(pc * theta * math.exp(-theta * (i + 0.5) * dw) * math.exp(-mu * (t - (i + 0.5) * dw)) * dw for i in range(steps))
        direct = (1 - pc) * math.exp(-mu * t) + integral + pc * math.exp(-theta * t)  # W > t: S > t - W surely
        assert response_tail(t, c, lam, mu) == pytest.approx(direct, rel=1e-5)


def test_m_m_1_response_time_is_exponential() -> None:
    """M/M/1: T ~ Exp(μ - λ), so its p99 is ln(100) / (μ - λ)."""
    assert response_quantile(0.99, 1, 0.6, 1.0) == pytest.approx(math.log(100) / 0.4, rel=1e-6)


def test_servers_needed_is_the_fewest_that_meet_the_target() -> None:
    lam, mu, k, target = 40.0, 0.5, 8, 12.0  # 2 s per stream, 8 streams per replica
    n = servers_needed(target, lam, mu, per_replica=k)
    assert n is not None
    assert response_quantile(0.99, n * k, lam, mu) <= target < response_quantile(0.99, (n - 1) * k, lam, mu)
    assert servers_needed(target, 0.0, mu) == 0
    # the service time alone: p99 of Exp(0.5) = 9.2 s, past a 5 s target whatever the count
    assert servers_needed(5.0, lam, mu, per_replica=k) is None


def test_admission_uses_the_same_wait_estimate() -> None:
    assert admission_wait is expected_wait
    assert expected_wait(3, 2, 0.5) == 4.0 and expected_wait(0, 0, 1.0) == math.inf

"""The desired-replicas estimator (policies/capacity.py), fed directly with
``now`` passed in: arrival smoothing, service times, the M/M/c answer,
and the edges (nothing measured, unreachable target, clamps)."""

from __future__ import annotations

import math

import pytest

from policies.capacity import ArrivalRate, ReplicaEstimator
from policies.erlang import response_quantile, servers_needed


def test_a_steady_stream_reads_its_rate_and_a_stopped_one_fades() -> None:
    rate = ArrivalRate(window=10.0)
    for i in range(2000):  # 20 per second for 100 s
        rate.add(i * 0.05)
    assert rate.rate(99.95) == pytest.approx(20.0, rel=0.01)
    assert rate.rate(99.95 + 10.0) == pytest.approx(20.0 / math.e, rel=0.01)  # one time constant later
    assert ArrivalRate().rate(5.0) == 0.0
    with pytest.raises(ValueError):
        ArrivalRate(window=0)


def _fed(rps: float, hold: float, seconds: float = 300.0) -> ReplicaEstimator:
    est = ReplicaEstimator(target=10.0, targets={"small": 3.0}, window=30.0)
    n = int(rps * seconds)
    for i in range(n):
        for model in ("chat", "small"):
            est.arrive(model, i / rps)
            est.served(model, hold)
    return est


def test_desired_replicas_is_the_m_m_c_answer_for_the_live_rates() -> None:
    est = _fed(rps=20.0, hold=2.0)
    now = 300.0
    e = est.estimate("chat", now, replicas=2, slots=8)
    lam = e.arrival_rate
    assert lam == pytest.approx(20.0, rel=0.01)
    assert e.service_rate == pytest.approx(8 * 0.5)  # 8 streams of 2 s each: 4 completions/s per replica
    assert e.desired == servers_needed(10.0, lam, 0.5, per_replica=8)
    assert e.p99 is not None and e.p99 <= 10.0 < response_quantile(0.99, (e.desired - 1) * 8, lam, 0.5)
    assert e.reachable and e.desired > 5  # 40 erlangs of 8-stream replicas: more than 5


def test_a_model_gets_its_own_target_and_an_unreachable_one_keeps_utilisation_bounded() -> None:
    est = _fed(rps=20.0, hold=2.0)
    # p99 of a 2 s exponential service alone is 9.2 s: a 3 s target cannot be met by scaling
    e = est.estimate("small", 300.0, replicas=2, slots=8)
    assert not e.reachable and e.p99 is None
    assert e.desired == math.ceil(e.arrival_rate / (0.5 * 8 * 0.9))


def test_with_nothing_measured_it_keeps_what_the_model_has() -> None:
    est = ReplicaEstimator(target=10.0, min_replicas=1, max_replicas=10)
    assert est.estimate("chat", 0.0, replicas=3, slots=4).desired == 3
    assert est.estimate("chat", 0.0, replicas=0, slots=4).desired == 1  # never below min_replicas
    est.arrive("chat", 0.0)
    e = est.estimate("chat", 1.0, replicas=3, slots=4)
    assert e.service_rate is None and e.desired == 3


def test_arrivals_that_stop_let_the_estimate_fall_to_the_minimum() -> None:
    est = _fed(rps=20.0, hold=2.0)
    busy = est.estimate("chat", 300.0, replicas=2, slots=8).desired
    idle = est.estimate("chat", 300.0 + 30.0 * 20, replicas=2, slots=8).desired  # 20 time constants later
    assert busy > idle == 1


def test_the_answer_is_clamped_to_max_replicas() -> None:
    est = ReplicaEstimator(target=10.0, max_replicas=4)
    for i in range(3000):
        est.arrive("chat", i / 100)
        est.served("chat", 2.0)
    assert est.estimate("chat", 30.0, replicas=2, slots=8).desired == 4


def test_a_process_with_a_share_of_the_traffic_sizes_the_whole_fleet() -> None:
    """Two router processes each seeing half of 20 req/s give the answer one
    process seeing all of it gives."""
    whole, half = ReplicaEstimator(target=10.0), ReplicaEstimator(target=10.0, share=0.5)
    for i in range(6000):
        whole.arrive("chat", i / 20)
        whole.served("chat", 2.0)
        if i % 2 == 0:
            half.arrive("chat", i / 20)
            half.served("chat", 2.0)
    a, b = whole.estimate("chat", 300.0, replicas=2, slots=8), half.estimate("chat", 300.0, replicas=2, slots=8)
    assert b.arrival_rate == pytest.approx(a.arrival_rate / 2, rel=0.01)  # what this process saw
    assert b.desired == a.desired and b.p99 == pytest.approx(a.p99, rel=0.02)
    with pytest.raises(ValueError):
        ReplicaEstimator(target=1.0, share=0.0)


def test_a_fixed_service_time_meets_a_target_the_exponential_model_cannot() -> None:
    """3 s target, 2 s requests: an exponential service's own p99 is 9.2 s
    (unreachable); as a constant it is 2 s plus the wait."""
    exp, fixed = ReplicaEstimator(target=3.0), ReplicaEstimator(target=3.0, fixed=True)
    for est in (exp, fixed):
        for i in range(6000):
            est.arrive("chat", i / 20)
            est.served("chat", 2.0)
    e, f = exp.estimate("chat", 300.0, replicas=2, slots=8), fixed.estimate("chat", 300.0, replicas=2, slots=8)
    assert not e.reachable and f.reachable
    assert f.desired == servers_needed(3.0, f.arrival_rate, 0.5, per_replica=8, fixed=True)
    assert f.p99 is not None and 2.0 <= f.p99 <= 3.0

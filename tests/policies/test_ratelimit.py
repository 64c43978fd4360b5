"""Token buckets: never above the burst, accurate within 2% over random
arrivals, all-or-nothing across subjects, Retry-After no earlier than the refill."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.ratelimit import Limits, RateLimitPolicy, TokenBucket, TokenBuckets


@given(
    rate=st.floats(0.1, 1000),
    burst=st.floats(1, 10_000),
    steps=st.lists(st.tuples(st.floats(0, 5), st.floats(0, 500)), max_size=200),
)
def test_a_bucket_never_holds_more_than_its_burst(rate: float, burst: float, steps: list[tuple[float, float]]) -> None:
    bucket, now = TokenBucket(rate, burst, 0.0), 0.0
    for dt, amount in steps:
        now += dt
        if bucket.wait(amount, now) == 0:
            bucket.take(amount, now)
        assert bucket.refill(now) <= burst


@settings(max_examples=40, deadline=None)
@given(rpm=st.integers(60, 1200), seed=st.integers(0, 2**32 - 1), load=st.floats(1.5, 5))
def test_admitted_requests_are_within_2_percent_of_burst_plus_rate_times_time(rpm: int, seed: int, load: float) -> None:
    """Offered ``load`` times the limit for ten minutes of random (exponential) gaps."""

    rng = random.Random(seed)
    limiter, subject = TokenBuckets(), [("tenant:a", Limits(requests_per_minute=rpm))]
    now, horizon, admitted = 0.0, 600.0, 0
    while True:
        now += rng.expovariate(load * rpm / 60)
        if now > horizon:
            break
        if limiter.acquire(subject, 0, now).allowed:
            admitted += 1
            limiter.release(["tenant:a"], now)
    expected = rpm + rpm / 60 * horizon
    assert abs(admitted - expected) <= 0.02 * expected, (admitted, expected)


def test_a_request_refused_by_its_tenant_takes_nothing_from_its_key() -> None:
    limiter = TokenBuckets()
    key, tenant = ("key:k", Limits(requests_per_minute=10)), ("tenant:t", Limits(requests_per_minute=1))
    assert limiter.acquire([key, tenant], 0, 0.0).allowed
    refused = limiter.acquire([key, tenant], 0, 0.0)
    assert not refused.allowed and refused.limited == ("tenant:t", "requests")
    assert refused.retry_after == 60.0
    # The key lost only the first request: 9 of its 10 are left.
    assert [limiter.acquire([key], 0, 0.0).allowed for _ in range(10)].count(True) == 9


@given(tpm=st.integers(100, 100_000), prompt=st.integers(0, 5000), generated=st.integers(0, 200_000))
def test_streamed_tokens_are_debt_and_retry_after_is_exactly_when_it_is_paid(tpm: int, prompt: int, generated: int) -> None:
    limiter, subject = TokenBuckets(), [("t", Limits(tokens_per_minute=tpm))]
    assert limiter.acquire(subject, prompt, 0.0).allowed  # a full bucket admits even an oversized prompt
    limiter.charge(["t"], generated, 0.0)
    limiter.release(["t"], 0.0)
    decision = limiter.acquire(subject, 1, 0.0)
    if decision.allowed:
        return
    wait = decision.retry_after
    assert wait > 0 and decision.limited == ("t", "tokens")
    assert not limiter.acquire(subject, 1, wait * 0.999).allowed
    assert limiter.acquire(subject, 1, wait * 1.000001 + 1e-9).allowed


def test_concurrent_requests_are_counted_until_released() -> None:
    limiter, subject = TokenBuckets(), [("t", Limits(concurrent=2))]
    assert limiter.acquire(subject, 0, 0.0).allowed and limiter.acquire(subject, 0, 0.0).allowed
    third = limiter.acquire(subject, 0, 0.0)
    assert not third.allowed and third.limited == ("t", "concurrent")
    limiter.release(["t"], 1.0)
    assert limiter.acquire(subject, 0, 1.0).allowed


def test_the_decision_carries_the_tightest_subjects_header_figures() -> None:
    limiter = TokenBuckets()
    d = limiter.acquire([("a", Limits(requests_per_minute=100, tokens_per_minute=1000)),
                         ("b", Limits(requests_per_minute=10))], 100, 0.0)  # fmt: skip
    assert d.allowed
    assert (d.limit_requests, d.remaining_requests) == (10, 9)
    assert (d.limit_tokens, d.remaining_tokens) == (1000, 900)
    assert d.reset_requests is not None and abs(d.reset_requests - 6.0) < 1e-9


def test_a_changed_limit_takes_effect_and_keeps_the_concurrency_count() -> None:
    limiter = TokenBuckets()
    assert limiter.acquire([("t", Limits(concurrent=1))], 0, 0.0).allowed
    assert not limiter.acquire([("t", Limits(concurrent=1, requests_per_minute=5))], 0, 0.0).allowed


def test_token_buckets_satisfy_the_protocol() -> None:
    assert isinstance(TokenBuckets(), RateLimitPolicy)

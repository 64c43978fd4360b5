"""The fair queue: shares of tokens converge to the tenants' weights within
5% (charged at dispatch or as they stream), strict priority between classes,
aging bounds a batch request's wait, idleness banks no credit."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fairness import FairQueue, QueuePolicy, Waiting, rank_of

_ids = itertools.count()


def item(tenant: str, rank: int = 1, arrival: float = 0.0, weight: float = 1.0, cost: int = 0) -> Waiting:
    return Waiting(id=next(_ids), tenant=tenant, rank=rank, arrival=arrival, weight=weight, cost=cost)


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0, 5.0]), min_size=2, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    lag=st.integers(0, 8),
)
def test_token_shares_of_backlogged_tenants_converge_to_their_weights(weights: list[float], seed: int, lag: int) -> None:
    """Every tenant always has work waiting; each request's prompt is charged
    as it leaves the queue and its answer ``lag`` pops later (as streamed)."""
    rng = random.Random(seed)
    q = FairQueue(aging=0)
    tenants = {f"t{i}": w for i, w in enumerate(weights)}
    for t, w in tenants.items():
        for _ in range(3):
            q.push(item(t, weight=w, cost=rng.randint(1, 400)), 0.0)
    got = dict.fromkeys(tenants, 0)
    streaming: deque[tuple[str, int]] = deque()
    for _ in range(3000):
        out = q.pop(0.0)
        assert out is not None
        answer = rng.randint(0, 800)
        got[out.tenant] += out.cost + answer
        streaming.append((out.tenant, answer))
        if len(streaming) > lag:
            t, n = streaming.popleft()
            q.charge(t, tenants[t], n, 0.0)
        q.push(item(out.tenant, weight=tenants[out.tenant], cost=rng.randint(1, 400)), 0.0)
    total, wsum = sum(got.values()), sum(weights)
    for t, w in tenants.items():
        assert abs(got[t] / total - w / wsum) <= 0.05 * (w / wsum), (got, tenants)


def test_weight_2_gets_twice_the_tokens_of_weight_1() -> None:
    q = FairQueue()
    for _ in range(2):
        q.push(item("heavy", weight=2, cost=100), 0.0)
        q.push(item("light", weight=1, cost=100), 0.0)
    order = []
    for _ in range(30):
        out = q.pop(0.0)
        assert out is not None
        order.append(out.tenant)
        q.push(item(out.tenant, weight=out.weight, cost=100), 0.0)
    assert order.count("heavy") == 20 and order.count("light") == 10


def test_strict_priority_without_aging_serves_every_higher_class_first() -> None:
    q = FairQueue(aging=0)
    for rank in (2, 1, 0, 2, 0, 1):
        q.push(item("t", rank=rank), 0.0)
    assert [q.pop(1e9).rank for _ in range(6)] == [0, 0, 1, 1, 2, 2]  # type: ignore[union-attr]


@settings(max_examples=50, deadline=None)
@given(aging=st.floats(0.5, 20), dt=st.floats(0.01, 1.0), flooders=st.integers(1, 4), seed=st.integers(0, 1000))
def test_aging_bounds_a_batch_requests_wait_under_an_interactive_flood(
    aging: float, dt: float, flooders: int, seed: int
) -> None:
    """Tenants keep interactive work waiting and one request leaves every
    ``dt``; a batch request still leaves within ``2 * aging`` plus one round
    of the tenants (those no further ahead in tokens go first, once each)."""
    rng = random.Random(seed)
    q = FairQueue(aging=aging)
    for i in range(flooders):
        for _ in range(5):
            q.push(item(f"flood{i}", rank=0, arrival=0.0, cost=rng.randint(1, 50)), 0.0)
    batch = item("quiet", rank=rank_of("batch"), arrival=0.0, cost=10)
    q.push(batch, 0.0)
    now = 0.0
    while True:
        now += dt
        out = q.pop(now)
        assert out is not None
        if out.id == batch.id:
            break
        q.push(item(out.tenant, rank=0, arrival=now, cost=rng.randint(1, 50)), now)
        assert now <= 2 * aging + (flooders + 1) * dt
    assert now <= 2 * aging + (flooders + 1) * dt


def test_an_idle_tenant_banks_no_credit() -> None:
    """``a`` waits alone for a long time while ``b`` was served; when both
    are backlogged again they alternate instead of ``a`` catching up."""
    q = FairQueue()
    for _ in range(50):
        q.push(item("b", cost=10), 0.0)
        assert q.pop(0.0) is not None  # b alone: served 500 tokens
    for _ in range(10):
        q.push(item("a", cost=10), 0.0)
        q.push(item("b", cost=10), 0.0)
    first = [q.pop(0.0).tenant for _ in range(10)]  # type: ignore[union-attr]
    assert first.count("a") <= 6


def test_remove_takes_a_waiting_request_out_and_depth_counts_per_class() -> None:
    q = FairQueue()
    a, b, c = item("t", rank=0), item("t", rank=2), item("u", rank=2)
    for x in (a, b, c):
        q.push(x, 0.0)
    assert (q.depth(), q.depth(0), q.depth(2)) == (3, 1, 2)
    assert q.remove(b.id) and not q.remove(b.id)
    assert [q.pop(0.0), q.pop(0.0), q.pop(0.0)] == [a, c, None]


def test_a_request_cannot_wait_twice_or_in_no_class() -> None:
    q = FairQueue()
    x = item("t")
    q.push(x, 0.0)
    with pytest.raises(ValueError, match="already waiting"):
        q.push(x, 0.0)
    with pytest.raises(ValueError, match="not a class"):
        q.push(item("t", rank=3), 0.0)


def test_fair_queue_satisfies_the_protocol() -> None:
    assert isinstance(FairQueue(), QueuePolicy)

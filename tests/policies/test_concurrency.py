"""A backend's concurrency limit learned from its 429s (AIMD): one cut per
burst, growth only while the backend runs at its limit, always within
[minimum, maximum]; and the slot shares that keep a group's last free slots
for tenants under their weighted share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.concurrency import AIMDLimit
from policies.fairness import SlotShares


def test_a_429_halves_the_limit_and_the_rest_of_its_burst_does_not_cut_again() -> None:
    aimd = AIMDLimit(64)
    assert aimd.on_rate_limited(sent_at=1.0, now=2.0) and aimd.limit == 32
    # Sent before the cut: the same overload, already answered.
    assert not aimd.on_rate_limited(sent_at=1.5, now=2.1) and aimd.limit == 32
    # Sent after it: the backend still has less room.
    assert aimd.on_rate_limited(sent_at=2.5, now=3.0) and aimd.limit == 16
    assert aimd.statistics().decreases == 2


def test_answers_at_the_limit_grow_it_by_about_one_per_round_trip_up_to_the_maximum() -> None:
    aimd = AIMDLimit(10)
    aimd.on_rate_limited(0.0, 0.0)
    assert aimd.limit == 5
    for _ in range(6):  # about a round trip's worth of answers at the limit
        aimd.on_success(busy=5, now=1.0)
    assert aimd.limit == 6
    for _ in range(1000):
        aimd.on_success(busy=aimd.limit, now=2.0)
    assert aimd.limit == 10 and aimd.value == 10.0


def test_answers_below_the_limit_do_not_grow_it() -> None:
    aimd = AIMDLimit(10)
    aimd.on_rate_limited(0.0, 0.0)
    for _ in range(100):
        aimd.on_success(busy=2, now=1.0)
    assert aimd.limit == 5 and aimd.statistics().increases == 0


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 128),
    st.integers(1, 8),
    st.floats(0.1, 1.0),
    st.lists(st.tuples(st.booleans(), st.floats(0, 100), st.integers(0, 200)), max_size=200),
)
def test_the_limit_stays_within_its_bounds(maximum: int, minimum: int, backoff: float,
                                           steps: list[tuple[bool, float, int]]) -> None:  # fmt: skip
    minimum = min(minimum, maximum)
    aimd = AIMDLimit(maximum, minimum=minimum, backoff=backoff)
    now = 0.0
    for limited, dt, busy in steps:
        now += dt
        if limited:
            aimd.on_rate_limited(now - dt / 2, now)
        else:
            aimd.on_success(busy, now)
        assert minimum <= aimd.limit <= maximum


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        AIMDLimit(0)
    with pytest.raises(ValueError):
        AIMDLimit(4, minimum=5)
    with pytest.raises(ValueError):
        AIMDLimit(4, backoff=0)


def test_a_tenant_over_its_share_may_not_take_the_reserved_slots_while_another_is_about() -> None:
    shares = SlotShares(window=2.0, reserve=1)
    shares.asked("flood", 1, 1.0, 0.0)
    shares.take("flood", 1, 3)
    assert shares.reserved("flood", 1, 4, 0.0) == 0  # alone: its share is everything
    shares.asked("quiet", 1, 1.0, 0.5)  # asked, was served, holds nothing now
    assert shares.share("flood", 1, 4, 1.0) == 2.0
    assert shares.reserved("flood", 1, 4, 1.0) == 1  # holds 3 >= its share of 2
    assert shares.reserved("quiet", 1, 4, 1.0) == 0  # holds nothing: never held back
    assert shares.reserved("flood", 1, 4, 3.0) == 0  # quiet gone quiet for longer than the window


def test_shares_follow_the_weights_and_a_waiting_tenant_counts_as_active() -> None:
    shares = SlotShares(window=0.0, reserve=2)
    shares.asked("heavy", 1, 3.0, 0.0)
    shares.asked("light", 1, 1.0, 0.0)
    shares.take("heavy", 1, 6)
    shares.wait("light", 1, +1)
    assert shares.share("light", 1, 8, 10.0) == 2.0  # heavy holds slots: active
    assert shares.share("heavy", 1, 8, 10.0) == 6.0  # light waits: active
    assert shares.reserved("heavy", 1, 8, 10.0) == 2
    shares.wait("light", 1, -1)  # not waiting, not holding, out of the window: gone
    assert shares.reserved("heavy", 1, 8, 10.0) == 0
    assert shares.share("heavy", 1, 8, 10.0) == 8.0


def test_shares_are_within_a_class_and_a_higher_class_about_keeps_the_reserve_from_lower_ones() -> None:
    shares = SlotShares(window=5.0, reserve=3)
    shares.asked("bulk", 2, 1.0, 0.0)
    shares.take("bulk", 2, 10)
    shares.asked("chat", 0, 1.0, 0.0)
    shares.take("chat", 0, 10)
    # Different classes: each is alone in its class, so chat is never held back...
    assert shares.share("chat", 0, 16, 1.0) == 16.0 and shares.reserved("chat", 0, 16, 1.0) == 0
    # ...and bulk, a lower class, leaves the last 3 free slots to chat while it is about.
    assert shares.reserved("bulk", 2, 16, 1.0) == 3
    shares.give("chat", 0, 10)
    assert shares.reserved("bulk", 2, 16, 6.0) == 0  # chat gone for longer than the window
    assert shares.reserved("bulk", 2, 4, 1.0) == 2  # the reserve is at most half a small group

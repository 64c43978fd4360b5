"""Admission: admit only into free slots with nobody ahead, queue up to the
class's bound, shed at arrival only when the M/M/c wait estimate is past the
deadline; Retry-After at least a second; the measured service rate."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.admission import (
    AdmissionPolicy,
    AdmissionView,
    BoundedQueue,
    ErlangShedding,
    ServiceRate,
    expected_wait,
)

views = st.builds(
    AdmissionView,
    capacity=st.integers(0, 64),
    busy=st.integers(0, 64),
    slots=st.integers(1, 4),
    ahead=st.integers(0, 100),
    queued_in_class=st.integers(0, 100),
    queue_limit=st.integers(0, 100),
    service_rate=st.none() | st.floats(0.01, 100),
    time_left=st.none() | st.floats(0, 600),
)


@given(views)
def test_decisions_follow_capacity_queue_bound_and_deadline(view: AdmissionView) -> None:
    v = ErlangShedding().decide(view, 0.0)
    if view.capacity == 0:
        assert (v.action, v.code) == ("reject", "no_healthy_backend")
        return
    free = view.busy + min(view.slots, view.capacity) <= view.capacity
    if v.action == "admit":
        assert free and view.ahead == 0
    elif v.action == "reject":
        assert v.retry_after >= 1.0
        if v.code == "queue_full":
            assert view.queued_in_class >= view.queue_limit
        else:
            assert v.code == "shed" and v.wait is not None and view.time_left is not None
            assert v.wait > view.time_left
    else:
        assert view.queued_in_class < view.queue_limit and not (free and view.ahead == 0)
        assert v.wait is None or view.time_left is None or v.wait <= view.time_left


@given(views)
def test_bounded_queue_never_sheds(view: AdmissionView) -> None:
    assert BoundedQueue().decide(view, 0.0).code != "shed"


def test_the_wait_is_k_plus_one_departures_of_c_servers() -> None:
    # 4 slots turning over once per 2 s each: 2 departures/s; 5 ahead -> 3 s.
    assert expected_wait(5, 4, 0.5) == pytest.approx(3.0)
    assert expected_wait(0, 0, 1.0) == float("inf")
    view = AdmissionView(capacity=4, busy=4, ahead=5, queued_in_class=5, queue_limit=10, service_rate=0.5, time_left=2.0)
    v = ErlangShedding().decide(view, 0.0)
    assert (v.action, v.code, v.retry_after) == ("reject", "shed", pytest.approx(3.0))
    assert ErlangShedding().decide(msgspec.structs.replace(view, time_left=3.5), 0.0).action == "queue"


def test_service_rate_is_the_inverse_of_the_mean_hold_time() -> None:
    rate = ServiceRate(alpha=0.5)
    assert rate.rate is None
    rate.observe(2.0)
    assert rate.rate == pytest.approx(0.5)
    rate.observe(4.0)
    assert rate.rate == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        ServiceRate(alpha=0)


def test_admission_policies_satisfy_the_protocol() -> None:
    assert isinstance(ErlangShedding(), AdmissionPolicy) and isinstance(BoundedQueue(), AdmissionPolicy)

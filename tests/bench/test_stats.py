"""Percentile math: linear interpolation between order statistics (type 7)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.errors import BadRequest
from bench.stats import percentile, percentiles, summarize


def test_median_of_an_even_count_interpolates_between_the_middle_two() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)


def test_p99_of_one_to_a_hundred_is_interpolated_not_rounded() -> None:
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile(range(1, 101), 0) == 1
    assert percentile(range(1, 101), 100) == 100


def test_a_single_sample_is_every_percentile() -> None:
    assert percentiles([7.0], (0, 50, 99, 100)) == [7.0, 7.0, 7.0, 7.0]


def test_no_samples_give_none_rather_than_a_made_up_number() -> None:
    assert percentile([], 50) is None
    assert percentiles([], (50, 99)) == [None, None]
    empty = summarize([])
    assert empty.n == 0 and empty.p99 is None and empty.mean is None


@pytest.mark.parametrize("q", [-1.0, 100.5, float("nan")])
def test_a_percentile_outside_0_to_100_is_a_bad_request(q: float) -> None:
    with pytest.raises(BadRequest, match="percentile"):
        percentile([1.0, 2.0], q)


@settings(max_examples=60, deadline=None)
@given(
    samples=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=200),
    q=st.floats(0, 100),
)
def test_percentile_agrees_with_numpy_linear(samples: list[float], q: float) -> None:
    expected = float(np.percentile(np.array(samples), q, method="linear"))
    assert percentile(samples, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_summary_scales_seconds_to_milliseconds() -> None:
    s = summarize([0.001, 0.002, 0.003, 0.004], scale=1000.0)
    assert s.n == 4
    assert s.min == pytest.approx(1.0) and s.max == pytest.approx(4.0)
    assert s.mean == pytest.approx(2.5) and s.p50 == pytest.approx(2.5)
    assert s.p95 == pytest.approx(3.85) and s.p99 == pytest.approx(3.97)

"""Poisson arrivals and prompts: reproducible from the seed, right on average."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from backends.errors import BadRequest
from bench.schedule import make_prompt, poisson_schedule


def test_the_same_seed_gives_the_same_arrivals_and_another_seed_does_not() -> None:
    assert poisson_schedule(20.0, 10.0, seed=1) == poisson_schedule(20.0, 10.0, seed=1)
    assert poisson_schedule(20.0, 10.0, seed=1) != poisson_schedule(20.0, 10.0, seed=2)


def test_arrivals_are_sorted_and_inside_the_duration() -> None:
    times = poisson_schedule(50.0, 4.0, seed=3)
    assert times == sorted(times)
    assert all(0.0 < t < 4.0 for t in times)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_arrival_count_matches_the_rate_within_five_sigma(seed: int) -> None:
    rate, duration = 100.0, 100.0
    n = len(poisson_schedule(rate, duration, seed=seed))
    expected = rate * duration  # Poisson: variance equals the mean
    assert abs(n - expected) < 5 * math.sqrt(expected)


def test_gaps_are_exponential_mean_one_over_rate_and_unit_coefficient_of_variation() -> None:
    times = poisson_schedule(40.0, 250.0, seed=7)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 40.0, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.05)  # a fixed-interval schedule has 0


@pytest.mark.parametrize(("rate", "duration"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_a_non_positive_rate_or_duration_is_a_bad_request(rate: float, duration: float) -> None:
    with pytest.raises(BadRequest):
        poisson_schedule(rate, duration, seed=0)


def test_prompts_are_reproducible_distinct_per_request_and_sized_in_words() -> None:
    assert make_prompt(0, 5, 16) == make_prompt(0, 5, 16)
    assert make_prompt(0, 5, 16) != make_prompt(0, 6, 16)
    assert make_prompt(0, 5, 16) != make_prompt(1, 5, 16)
    assert len(make_prompt(0, 5, 16).split()) == 16
    with pytest.raises(BadRequest):
        make_prompt(0, 0, 0)

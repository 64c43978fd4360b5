"""Prompt lookup: longest suffix match, most recent occurrence, the match length
behind a proposal, and the incremental index agrees with the stateless definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.spec_propose import (
    MAX_MATCH,
    Lookup,
    NgramProposer,
    ngram_lookup,
    ngram_propose,
)


def test_the_longest_suffix_match_wins() -> None:
    # suffix (1, 2) occurs at 0 (followed by 9); suffix (2,) alone most recently at 4 (followed by 5)
    tokens = [1, 2, 9, 9, 2, 5, 1, 2]
    assert ngram_propose(tokens, 3, min_n=1, max_n=2) == [9, 9, 2]
    assert ngram_propose(tokens, 3, min_n=1, max_n=1) == [5, 1, 2]


def test_the_most_recent_occurrence_wins() -> None:
    tokens = [7, 1, 7, 2, 7]
    assert ngram_propose(tokens, 1, max_n=1) == [2]


def test_no_match_proposes_nothing() -> None:
    assert ngram_propose([1, 2, 3], 4) == []
    assert ngram_propose([5], 4) == []
    assert NgramProposer().propose("a", [1, 2, 3], 4) == []


def test_a_continuation_may_run_into_the_suffix() -> None:
    tokens = [4, 4, 4]
    assert ngram_propose(tokens, 5, max_n=2) == [4]


def test_the_match_length_counts_the_agreeing_context_past_n() -> None:
    # the 2-gram (2, 3) matched at 2..3; before it 1 and 5 agree as well: 4 tokens
    tokens = [5, 1, 2, 3, 9, 7, 5, 1, 2, 3]
    assert ngram_lookup(tokens, 2, max_n=2) == Lookup([9, 7], 4)
    assert NgramProposer(max_n=2).lookup("s", tokens, 2) == Lookup([9, 7], 4)
    assert ngram_lookup([1, 2, 3], 4) == Lookup([], 0)


def test_the_match_length_is_capped() -> None:
    tokens = [7] * 100
    assert ngram_lookup(tokens, 3).match == MAX_MATCH


def test_bad_n_range_is_an_error() -> None:
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        ngram_propose([1], 1, min_n=0)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=4),
    k=st.integers(0, 5),
    max_n=st.integers(1, 8),
)
def test_incremental_index_matches_the_stateless_scan(
    tokens: list[int], cuts: list[int], k: int, max_n: int
) -> None:
    """Growing a sequence step by step gives the same proposals as rescanning."""
    proposer = NgramProposer(min_n=1, max_n=max_n)
    for end in sorted({min(c, len(tokens)) for c in cuts} | {len(tokens)}):
        prefix = tokens[:end]
        assert proposer.lookup("s", prefix, k) == ngram_lookup(prefix, k, min_n=1, max_n=max_n)


def test_forget_drops_the_index_and_a_shorter_sequence_rebuilds_it() -> None:
    p = NgramProposer(max_n=2)
    assert p.propose("s", [1, 2, 1], 2) == [2, 1]
    assert p.num_tracked == 1
    assert p.propose("s", [3, 3], 1) == [3]  # shorter: rebuilt, not stale
    p.forget("s")
    assert p.num_tracked == 0

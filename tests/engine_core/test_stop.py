"""Incremental stop-string matching across streamed pieces."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.stop import StopMatcher
from backends.errors import BadRequest


def feed_all(m: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out, stopped = "", False
    for p in pieces:
        text, stopped = m.feed(p)
        out += text
        if stopped:
            return out, True
    return out + m.flush(), False


def test_a_stop_split_across_pieces_is_held_back_then_cut() -> None:
    m = StopMatcher(["END"])
    assert m.feed("Hello EN") == ("Hello ", False)
    assert m.feed("D more") == ("", True)
    assert m.matched == "END" and m.feed("x") == ("", True) and m.flush() == ""


def test_a_false_start_is_released() -> None:
    m = StopMatcher(["END"])
    assert m.feed("ab E") == ("ab ", False)
    assert m.feed("x") == ("Ex", False)
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN"


def test_the_stop_completed_first_wins() -> None:
    """"bc" is complete one character before "abcd" is, so generation would already
    have stopped there, whether "xxabcd" arrives in one piece or token by token."""
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xxabcd") == ("xxa", True) and m.matched == "bc"
    m = StopMatcher(["bc", "abcd"])
    assert feed_all(m, ["xxab", "c", "d"]) == ("xxa", True) and m.matched == "bc"
    m = StopMatcher(["bcd", "abcd"])  # completing together: the longer one, started first
    assert m.feed("xxabcd") == ("xx", True) and m.matched == "abcd"


def test_no_stops_passes_text_through_and_empty_stop_is_rejected() -> None:
    assert StopMatcher([]).feed("abc") == ("abc", False)
    with pytest.raises(BadRequest):
        StopMatcher([""])


@settings(max_examples=80, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_streaming_equals_matching_the_whole_text(text, stops, cuts) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    # the stop that completes first (smallest end, then earliest start)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = (text[: min(hits)[1]], True) if hits else (text, False)
    assert feed_all(StopMatcher(stops), pieces) == expected

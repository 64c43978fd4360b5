"""The SSE parser yields the same events however the bytes are split."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.sse import SSEEvent, SSEParser

STREAM = (
    ': keep-alive comment\n\n'
    'data: {"choices":[{"text":"héllo"}]}\r\n\r\n'
    'event: ping\ndata: one\ndata:two\n\n'
    'data: 😀 split\r\rdata: [DONE]\n\n'
).encode()
EXPECTED = [
    SSEEvent(data='{"choices":[{"text":"héllo"}]}'),
    SSEEvent(data="one\ntwo", event="ping"),
    SSEEvent(data="😀 split"),
    SSEEvent(data="[DONE]"),
]


def _parse(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return events + parser.close()


def test_a_whole_stream_in_one_chunk() -> None:
    assert _parse([STREAM]) == EXPECTED


def test_one_byte_at_a_time_splits_crlf_pairs_and_utf8_characters() -> None:
    assert _parse([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


@settings(max_examples=80, deadline=None)
@given(st.sets(st.integers(1, len(STREAM) - 1), max_size=12))
def test_any_split_of_the_stream_gives_the_same_events(cuts: set[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    assert _parse([STREAM[a:b] for a, b in itertools.pairwise(bounds)]) == EXPECTED


def test_an_event_is_dispatched_only_when_its_blank_line_arrives() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n") == []
    assert parser.feed(b"\n") == [SSEEvent(data="a")]


def test_a_cr_at_a_chunk_end_ends_the_line_and_a_following_lf_is_not_a_second_one() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == [SSEEvent(data="a")]  # dispatched without waiting
    assert parser.feed(b"\ndata: b\r") == []  # that LF completed the CRLF: no extra line
    assert parser.feed(b"\r") == [SSEEvent(data="b")]  # CR CR: two line ends


def test_close_flushes_a_last_event_without_its_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: tail") == []
    assert parser.close() == [SSEEvent(data="tail")]


LINES = st.lists(
    st.sampled_from(["data: a", "data:b", "data: ", "event: e", ": note", "", "id: 3", "data: {\"x\": 1}", "data: é"]),
    max_size=20,
)


@settings(max_examples=150, deadline=None)
@given(LINES, st.sets(st.integers(1, 200), max_size=8))
def test_lf_only_streams_parse_as_their_crlf_twins(lines: list[str], cuts: set[int]) -> None:
    """The LF-only fast path and the general line splitter agree."""
    lf = ("\n".join(lines) + "\n\n").encode()
    crlf = lf.replace(b"\n", b"\r\n")

    def split(data: bytes) -> list[bytes]:
        bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
        return [data[a:b] for a, b in itertools.pairwise(bounds)]

    assert _parse(split(lf)) == _parse(split(crlf)) == _parse([crlf])

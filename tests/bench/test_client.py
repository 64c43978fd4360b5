"""Timing one stream: TTFT, inter-token gaps, token counts and failure kinds."""

from __future__ import annotations

import json

import pytest

from bench.client import RequestResult, RequestSpec, StreamTimer, build_body


def _data(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _text(t: str) -> bytes:
    return _data({"choices": [{"text": t}]})


def _timer(start: float = 10.0) -> StreamTimer:
    return StreamTimer(RequestResult(index=0, scheduled=0.0), start)


def test_ttft_and_gaps_are_timed_from_the_planned_start_per_token_chunk() -> None:
    t = _timer(start=10.0)
    t.feed(_data({"choices": [{"text": ""}]}), 10.1)  # role/empty chunk: not a token
    t.feed(_text("a"), 10.5)
    t.feed(_text("b") + _text("c")[:7], 10.75)  # a chunk boundary inside an event
    t.feed(_text("c")[7:], 11.0)
    t.feed(_data({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}), 11.1)
    t.feed(b"data: [DONE]\n\n", 11.2)
    r = t.finish(11.2)
    assert r.ok
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.25, 0.25])
    assert r.e2e == pytest.approx(1.2)
    assert (r.output_tokens, r.prompt_tokens) == (3, 4)
    assert r.tpot == pytest.approx(0.7 / 2)


def test_chat_deltas_count_and_tokens_fall_back_to_chunks_without_usage() -> None:
    t = _timer(start=0.0)
    t.feed(_data({"choices": [{"delta": {"role": "assistant"}}]}), 0.1)
    for i, now in enumerate((0.2, 0.3, 0.4)):
        t.feed(_data({"choices": [{"delta": {"content": f"w{i}"}}]}), now)
    t.feed(b"data: [DONE]\n\n", 0.5)
    r = t.finish(0.5)
    assert r.ok and r.output_tokens == 3 and r.ttft == pytest.approx(0.2)


def test_a_stream_that_ends_without_done_is_a_truncated_error() -> None:
    t = _timer(start=0.0)
    t.feed(_text("a"), 0.1)
    r = t.finish(0.2)
    assert r.error == "truncated" and r.output_tokens == 1


def test_an_in_band_error_event_is_a_stream_error() -> None:
    t = _timer()
    t.feed(_text("a") + _data({"error": {"message": "backend died"}}), 10.1)
    t.feed(b"data: [DONE]\n\n", 10.2)
    r = t.finish(10.2)
    assert r.error == "stream_error" and "backend died" in r.detail


def test_an_undecodable_event_is_a_bad_json_error() -> None:
    t = _timer()
    t.feed(b"data: {not json\n\ndata: [DONE]\n\n", 10.1)
    assert t.finish(10.1).error == "bad_json"


def test_bodies_follow_the_openai_shapes() -> None:
    chat = build_body(RequestSpec(model="m", endpoint="chat", max_tokens=5), "hi")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    assert chat["stream_options"] == {"include_usage": True}
    plain = build_body(RequestSpec(model="m", stream=False, ignore_eos=True, max_tokens=7), "x")
    assert plain["prompt"] == "x" and "stream_options" not in plain
    assert plain["ignore_eos"] is True and plain["min_tokens"] == 7

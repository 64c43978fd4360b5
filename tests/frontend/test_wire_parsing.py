"""The sans-I/O parts of the HTTP adapter: SSE framing, chunk -> event
conversion, and the status-code translation table; and of the wire format:
logprob shapes and unset sampling fields."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Logprob, TopLogprob
from backends.errors import (
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    ClientError,
    ContextLengthExceeded,
    ModelNotFound,
    StreamBroken,
    Unauthorized,
    UpstreamError,
    UpstreamRateLimited,
)
from backends.openai_wire import ChunkParser, status_error
from frontend.sse import SSEParser
from frontend.wire import (
    decode_request,
    logprobs_payload,
    text_offsets,
    to_generate_requests,
)

PAYLOADS = ['{"a": 1}', '{"b": "x\\ny"}', "[DONE]"]


def _frame(payloads: list[str], newline: bytes) -> bytes:
    out = b": keep-alive comment" + newline + newline
    for p in payloads:
        out += b"event: message" + newline + b"data: " + p.encode() + newline + newline
    return out


@settings(max_examples=60, deadline=None)
@given(
    newline=st.sampled_from([b"\n", b"\r\n", b"\r"]), cuts=st.lists(st.integers(0, 200), max_size=8)
)
def test_sse_decoder_survives_any_chunking_and_line_ending(newline: bytes, cuts: list[int]) -> None:
    raw = _frame(PAYLOADS, newline)
    points = sorted({min(c, len(raw)) for c in cuts})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    decoder = SSEParser(strict=True)
    got = [e.data for piece in pieces for e in decoder.feed(piece)]
    assert got == PAYLOADS


def test_sse_decoder_joins_multiline_data_and_ignores_unknown_fields() -> None:
    decoder = SSEParser(strict=True)
    assert [e.data for e in decoder.feed(b"id: 7\nretry: 10\ndata:one\ndata: two\n\n")] == ["one\ntwo"]
    assert decoder.feed(b"data: partial") == []  # no blank line yet


def _chunk(
    text: str, ids: list[int] | None = None, finish: str | None = None, **top: object
) -> str:
    choice: dict[str, object] = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return json.dumps({"choices": [choice], **top})


def test_parser_stamps_the_first_event_and_holds_the_final_one_for_usage() -> None:
    parser = ChunkParser(chat=False)
    first = parser.feed(_chunk(" a", [300], prompt_token_ids=[1, 2], seed=9))
    assert first[0].prompt_token_ids == [1, 2] and first[0].seed == 9
    assert parser.feed(_chunk(" b", [301], finish="length")) == []
    usage = json.dumps(
        {
            "choices": [],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "prompt_tokens_details": None},
        }
    )
    assert parser.feed(usage) == []
    (final,) = parser.feed("[DONE]")
    assert final.finish_reason == "length" and final.token_ids == [301]
    assert final.usage is not None and final.usage.completion_tokens == 2


def test_parser_skips_role_only_chat_deltas_and_maps_unknown_finish_reasons_to_stop() -> None:
    parser = ChunkParser(chat=True)
    role = json.dumps(
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}], "prompt_token_ids": [5]}
    )
    assert parser.feed(role) == []
    tool = json.dumps(
        {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "tool_calls"}]}
    )
    assert parser.feed(tool) == []
    (final,) = parser.feed("[DONE]")
    assert final.finish_reason == "stop" and final.text == "x" and final.prompt_token_ids == [5]
    assert final.usage is not None and final.usage.prompt_tokens == 1


@pytest.mark.parametrize(
    "data",
    [
        "{not json",
        "[1, 2]",
        "[Infinity]",  # refused by the typed decoder before its bad JSON is seen: still a protocol error
        '{"id": "x"}',
        _chunk("a", ids=["x"]),  # type: ignore[list-item]
        json.dumps({"choices": [{"index": 1, "text": "a"}]}),
        json.dumps({"choices": [{"index": 0, "text": 7}]}),  # text that is not a string
        json.dumps({"choices": [{"index": 0, "text": ["a"]}, {"index": 0, "text": "b"}]}),
    ],
)
def test_parser_rejects_chunks_that_are_not_the_openai_shape(data: str) -> None:
    with pytest.raises(BackendProtocolError):
        ChunkParser(chat=False).feed(data)


def test_a_completion_chunk_with_null_or_empty_text_and_ids_is_a_token_event() -> None:
    parser = ChunkParser(chat=False)
    (event,) = parser.feed(json.dumps({"choices": [{"index": 0, "text": None, "token_ids": [4]}]}))
    assert event.text == "" and event.token_ids == [4]
    assert parser.feed(json.dumps({"choices": [{"index": 0, "text": ""}]})) == []  # nothing in it


def test_done_without_finish_reason_and_error_events_translate() -> None:
    with pytest.raises(BackendProtocolError):
        ChunkParser(chat=False).feed("[DONE]")
    parser = ChunkParser(chat=False)
    parser.feed(_chunk("a", [300]))
    error = json.dumps(
        {"error": {"message": "engine died", "type": "upstream_error", "code": None}}
    )
    with pytest.raises(StreamBroken, match="engine died"):
        parser.feed(error)
    with pytest.raises(UpstreamError):
        ChunkParser(chat=False).feed(error)


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (
            400,
            {"error": {"message": "bad", "type": "invalid_request_error", "code": None}},
            BadRequest,
        ),
        (
            400,
            {"error": {"message": "x", "code": "context_length_exceeded"}},
            ContextLengthExceeded,
        ),
        (
            400,
            {
                "object": "error",
                "message": "This model's maximum context length is 2048 tokens",
                "code": 400,
            },
            ContextLengthExceeded,
        ),
        (401, {"error": {"message": "key"}}, Unauthorized),
        (404, {"error": {"message": "The model `x` does not exist."}}, ModelNotFound),
        (418, {"error": {"message": "teapot"}}, ClientError),
        (429, {"error": {"message": "slow down"}}, UpstreamRateLimited),
        (503, {"error": {"message": "busy"}}, BackendUnavailable),
        (500, {"error": {"message": "boom"}}, UpstreamError),
        (504, {"error": {"message": "late"}}, BackendTimeout),
    ],
)
def test_status_error_table(status: int, body: dict[str, object], error: type[Exception]) -> None:
    exc = status_error(status, json.dumps(body).encode())
    assert type(exc) is error
    assert exc.message in json.dumps(body)
    if status == 418:
        assert exc.status == 418


def test_status_error_reads_retry_after_in_seconds_or_as_a_date_and_plain_text_bodies() -> None:
    assert status_error(429, b"", "5").retry_after == 5.0
    date = status_error(503, b"", "Wed, 21 Oct 2015 07:28:00 GMT")
    assert date.retry_after == 0.0  # in the past
    assert status_error(503, b"", "soon").retry_after is None
    assert status_error(502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"


# ---- the wire format (frontend.wire): logprob shapes, unset sampling fields


def _lp(token: str, logprob: float, top: list[tuple[str, float]], raw: bytes | None = None) -> Logprob:
    return Logprob(-1, logprob, token, [TopLogprob(-1, v, t) for t, v in top], raw)


def test_completion_logprobs_have_distinct_keys_the_chosen_token_and_text_offsets() -> None:
    entries = [
        _lp(" Paris", -0.1, [(" Paris", -0.1), (" Lyon", -2.5)]),
        _lp(".", -0.7, [("!", -0.6), (",", -1.0)]),  # sampled, not among the top 2
        _lp(" é", -0.2, [(" é", -0.2), (" '", -3.0)]),
    ]
    out = logprobs_payload("completion", entries)
    assert out["tokens"] == [" Paris", ".", " é"]
    assert out["token_logprobs"] == [-0.1, -0.7, -0.2]
    assert out["top_logprobs"] == [
        {" Paris": -0.1, " Lyon": -2.5},
        {"!": -0.6, ",": -1.0, ".": -0.7},
        {" é": -0.2, " '": -3.0},
    ]
    assert out["text_offset"] == [0, 6, 7]
    assert logprobs_payload("completion", entries[1:], offset=6)["text_offset"] == [6, 7]


def test_chat_logprobs_carry_each_tokens_bytes() -> None:
    top = [TopLogprob(-1, -0.5, "\\xe6", b"\xe6"), TopLogprob(-1, -1.0, "a")]
    entries = [Logprob(-1, -0.5, "\\xe6", top, b"\xe6"), _lp("x", -0.1, [])]
    content = logprobs_payload("chat", entries)["content"]
    assert content[0] == {
        "token": "\\xe6",
        "logprob": -0.5,
        "bytes": [0xE6],
        "top_logprobs": [
            {"token": "\\xe6", "logprob": -0.5, "bytes": [0xE6]},
            {"token": "a", "logprob": -1.0, "bytes": [97]},
        ],
    }
    assert content[1]["bytes"] == [120] and content[1]["top_logprobs"] == []


@pytest.mark.parametrize(
    ("pieces", "start", "offsets"),
    [
        ([b"a", b"\xe2", b"\x80\x99", b"b"], 0, [0, 1, 1, 2]),  # "a\u2019b": U+2019 in three pieces
        ([b" \xe6", b"\x97", b"\xa5", b"\xe6\x9c\xac", b" x"], 0, [0, 1, 1, 2, 3]),  # " 日本 x"
        ([b"\x80\x99", b"b"], 1, [1, 2]),  # a chunk that finishes a character of the last one
        ([b"\xe2", b"b"], 0, [0, 1]),  # a cut character shows as one U+FFFD
        ([], 5, []),
    ],
)
def test_text_offsets_count_whole_characters_before_each_token(
    pieces: list[bytes], start: int, offsets: list[int]
) -> None:
    assert text_offsets(pieces, start) == offsets


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=20), st.lists(st.integers(1, 4), max_size=30))
def test_text_offsets_of_any_split_point_at_the_characters_so_far(text: str, sizes: list[int]) -> None:
    raw = text.encode()
    pieces, pos = [], 0
    for n in [*sizes, len(raw)]:
        if pos < len(raw):
            pieces.append(raw[pos : pos + n])
            pos += n
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    want = [len(raw[:s].decode("utf-8", errors="ignore")) for s in starts]
    assert text_offsets(pieces) == want


def test_unset_sampling_fields_stay_unset_for_the_backend_to_fill() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    wire, extra = decode_request(body, "chat")
    (req,) = to_generate_requests(wire, extra, request_id="r")
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.repetition_penalty) == (None,) * 5
    given_ = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    wire, extra = decode_request(json.dumps({"prompt": "hi", **given_}).encode(), "completion")
    (req,) = to_generate_requests(wire, extra, request_id="r")
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0,
    )


def test_escaped_bytes_in_a_token_text_count_as_those_bytes() -> None:
    """Records that crossed an HTTP hop carry text only: ``\\xNN`` is a byte."""
    entries = [_lp(" \\xe6", -1.0, []), _lp("\\x97", -1.0, []), _lp("\\xa5", -1.0, []), _lp("!", -1.0, [])]
    out = logprobs_payload("completion", entries)
    assert out["text_offset"] == [0, 1, 1, 2]  # " 日!"
    chat = logprobs_payload("chat", entries)["content"]
    assert [e["bytes"] for e in chat] == [[32, 0xE6], [0x97], [0xA5], [33]]


@pytest.mark.parametrize("opening,closing", [(b"[", b"]"), (b'{"a":', b"}")])
def test_a_body_nested_a_thousand_deep_is_a_400_not_a_recursion_error(opening: bytes, closing: bytes) -> None:
    """Issue 17: even inside a field we do not know, deep nesting raised
    RecursionError out of the decoder (a 500 with a traceback per request)."""
    body = b'{"prompt": "x", "junk": ' + opening * 5000 + b"1" + closing * 5000 + b"}"
    with pytest.raises(BadRequest, match="nested too deeply"):
        decode_request(body, "completion")


@pytest.mark.parametrize(
    ("kind", "body", "ids"),
    [
        ("completion", {"prompt": [1, 2, 3], "resumed_tokens": 2}, [1, 2, 3]),
        ("completion", {"prompt": [[1, 2, 3]], "resumed_tokens": 1}, [1, 2, 3]),
        ("native", {"prompt_token_ids": [4, 5], "resumed_tokens": 1}, [4, 5]),
        ("native", {"prompt": [4, 5, 6], "resumed_tokens": 2}, [4, 5, 6]),
    ],
)
def test_resumed_tokens_next_to_a_token_id_prompt_reach_the_backend(
    kind: str, body: dict[str, object], ids: list[int]
) -> None:
    wire, extra = decode_request(json.dumps(body).encode(), kind)  # type: ignore[arg-type]
    (req,) = to_generate_requests(wire, extra, request_id="r")
    assert (req.prompt_token_ids, req.resumed_tokens) == (ids, body["resumed_tokens"])
    assert "resumed_tokens" not in req.extra


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("completion", {"prompt": [1, 2, 3], "resumed_tokens": 3}),  # no prompt token left
        ("completion", {"prompt": [1, 2, 3], "resumed_tokens": -1}),
        ("completion", {"prompt": [1, 2, 3], "resumed_tokens": 1.0}),
        ("completion", {"prompt": [1, 2, 3], "resumed_tokens": True}),
        ("completion", {"prompt": "text", "resumed_tokens": 1}),
        ("completion", {"prompt": [[1, 2], [3, 4]], "resumed_tokens": 1}),
        ("completion", {"prompt": [1, 2, 3], "resumed_tokens": 1, "n": 2}),
        ("native", {"prompt": "text", "resumed_tokens": 1}),
        ("native", {"messages": [{"role": "user", "content": "x"}], "resumed_tokens": 1}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "resumed_tokens": 1}),
    ],
)
def test_bad_resumed_tokens_are_a_400_naming_it(kind: str, body: dict[str, object]) -> None:
    with pytest.raises(BadRequest) as info:
        decode_request(json.dumps(body).encode(), kind)  # type: ignore[arg-type]
    assert info.value.param == "resumed_tokens"



def test_chunks_outside_the_typed_fast_path_parse_as_before_or_fail_as_protocol_errors() -> None:
    """What the typed decoder refuses goes through the generic checks: a
    float index 0.0 is the first choice as ever, a chat delta that is not an
    object is a protocol error (it was an AttributeError, a bug)."""
    parser = ChunkParser(chat=False)
    (event,) = parser.feed(json.dumps({"choices": [{"index": 0.0, "text": " a", "token_ids": [3]}]}))
    assert (event.text, event.token_ids) == (" a", [3])
    with pytest.raises(BackendProtocolError, match="delta is not an object"):
        ChunkParser(chat=True).feed(json.dumps({"choices": [{"index": 0, "delta": "x"}]}))
    with pytest.raises(StreamBroken):  # an error with a wrongly typed choices is still the error
        p = ChunkParser(chat=False)
        p.feed(_chunk("a", [300]))
        p.feed(json.dumps({"error": {"message": "died"}, "choices": "x"}))

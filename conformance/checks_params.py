"""Parameters honoured: max_tokens, stop, temperature 0, seed, n, logprobs."""

from __future__ import annotations

import itertools
from typing import Any

from .registry import expect, expect_equal, fail, skip
from .shapes import Completion, from_reply, from_stream
from .suite import HTTP, PROMPT, complete
from .target import HttpTarget

GREEDY: dict[str, Any] = {"temperature": 0, "seed": 1234}
EXTRAS: dict[str, Any] = {"ignore_eos_if_supported": True, "token_ids_if_supported": True}


def _usage_opt(stream: bool) -> dict[str, Any]:
    return {"stream_options": {"include_usage": True}} if stream else {}


@HTTP.check("params.max_tokens", "params")
async def max_tokens(t: HttpTarget) -> str:
    """max_tokens=7 yields exactly 7 tokens with finish_reason length (or fewer with stop)."""
    notes = []
    for stream in (False, True):
        out = await complete(t, stream=stream, max_tokens=7, **GREEDY, **EXTRAS, **_usage_opt(stream))
        count = out.completion_tokens()
        if out.ids or t.caps.token_ids:
            expect_equal(len(out.ids), count, "number of token_ids vs usage.completion_tokens")
        if out.finish[0] == "length":
            expect_equal(count, 7, "completion_tokens with finish_reason length")
        else:
            expect(count < 7, f"finish_reason stop after {count} tokens, more than max_tokens=7")
            notes.append(f"stopped at {count} (EOS)")
    return "; ".join(notes)


@HTTP.check("params.temperature0", "params")
async def temperature_zero(t: HttpTarget) -> None:
    """Two identical temperature-0 requests give the same text."""
    params = {"max_tokens": 16, "temperature": 0, **EXTRAS}
    first, second = await complete(t, **params), await complete(t, **params)
    expect_equal(second.text, first.text, "second greedy text")
    expect_equal(second.ids, first.ids, "second greedy token ids")


@HTTP.check("params.seed", "params", requires=("seeds",))
async def seed(t: HttpTarget) -> None:
    """Two sampled (temperature 1) requests with the same seed give the same text."""
    params = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 4242, **EXTRAS}
    first, second = await complete(t, **params), await complete(t, **params)
    expect_equal(second.text, first.text, "second seeded text")
    expect_equal(second.ids, first.ids, "second seeded token ids")
    streamed = await complete(t, stream=True, **params)
    expect_equal(streamed.text, first.text, "streamed seeded text")


@HTTP.check("params.stop", "params")
async def stop(t: HttpTarget) -> str:
    """A stop string taken from an unstopped run ends the text just before it."""
    return await _stop_check(t, straddle=False)


@HTTP.check("params.stop.split", "params")
async def stop_split(t: HttpTarget) -> str:
    """A stop string straddling a token boundary is still caught (stream and not)."""
    return await _stop_check(t, straddle=True)


async def _stop_check(t: HttpTarget, *, straddle: bool) -> str:
    params = {"max_tokens": 32, **GREEDY, **EXTRAS}
    unstopped = await _pieces(t, params)
    text = "".join(unstopped)
    start, stop_str = _pick_stop(unstopped, straddle)
    for stream in (False, True):
        out = await complete(t, stream=stream, stop=[stop_str], **params)
        where = "stream" if stream else "non-stream"
        expect_equal(out.text, text[:start], f"{where} text with stop={stop_str!r}")
        expect_equal(out.finish[0], "stop", f"{where} finish_reason with stop={stop_str!r}")
    return f"stop={stop_str!r} at char {start}"


async def _pieces(t: HttpTarget, params: dict[str, Any]) -> list[str]:
    """Token texts of a greedy run: a streamed chunk ends on a token boundary."""
    out = await complete(t, stream=True, **params)
    plain = await complete(t, **params)
    expect_equal(out.text, plain.text, "streamed vs plain greedy text")
    return out.pieces.get(0, [])


def _pick_stop(pieces: list[str], straddle: bool) -> tuple[int, str]:
    text = "".join(pieces)
    bounds, offset = [], 0
    for piece in pieces[:-1]:
        offset += len(piece)
        bounds.append(offset)
    third = len(text) // 3
    for b in sorted(bounds, key=lambda b: abs(b - third)):
        if straddle:
            start, cand = b - 2, text[max(b - 2, 0) : b + 2]
        else:
            nxt = min([x for x in bounds if x > b] + [len(text)])
            piece = text[b:nxt]  # word vocabularies lead with a space: stop on the word
            start, cand = b + len(piece) - len(piece.lstrip()), piece.strip()
        if _usable(text, start, cand, need=4 if straddle else 1):
            return start, cand
    if straddle:
        skip(f"no usable stop string straddling a token boundary in {text[:60]!r}")
    fail(f"no usable single-token stop string in {text[:60]!r}")


def _usable(text: str, start: int, cand: str, need: int) -> bool:
    return (
        start >= 1
        and len(cand) >= need
        and cand.strip() == cand
        and text.find(cand) == start
    )


@HTTP.check("params.n", "params")
async def n_choices(t: HttpTarget) -> str:
    """n=2 gives choices 0 and 1, each with its own finish_reason (stream and not)."""
    body = t.completion_body(PROMPT, n=2, max_tokens=6, temperature=1.0, seed=7)
    reply = await t.post("/v1/completions", body)
    if reply.status == 400:
        skip("target rejects n=2 with 400")
    plain = from_reply(reply, "completion")
    expect_equal(sorted(plain.texts), [0, 1], "choice indices with n=2")
    streamed = from_stream(await t.stream("/v1/completions", body), "completion")
    expect_equal(sorted(streamed.texts), [0, 1], "streamed choice indices with n=2")
    expect_equal(sorted(streamed.finish), [0, 1], "streamed choices with a finish_reason")
    return "2 choices"


@HTTP.check("params.logprobs", "params")
async def logprobs(t: HttpTarget) -> str:
    """Completions logprobs=2, greedy: one entry per token, each a non-empty token
    text, a log-probability <= 0, 2 or 3 alternatives with distinct texts among
    them the chosen token, and text offsets that rise from 0 within the text."""
    body = t.completion_body(PROMPT, max_tokens=5, temperature=0, logprobs=2)
    reply = await t.post("/v1/completions", body)
    if reply.status == 400:
        skip("target rejects logprobs with 400")
    out = from_reply(reply, "completion")
    lp = _single(out, 0)
    count = out.completion_tokens()
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        expect(isinstance(lp.get(key), list), f"logprobs.{key} is not a list")
        expect_equal(len(lp[key]), count, f"len(logprobs.{key}) vs completion_tokens")
    tokens = lp["tokens"]
    expect(all(isinstance(x, str) and x for x in tokens), f"logprobs.tokens has an empty or non-string token: {tokens!r}")
    _logprob_values(lp["token_logprobs"], "token_logprobs")
    for token, top in zip(tokens, lp["top_logprobs"], strict=True):
        # A dict of 2 alternatives plus the chosen token: fewer keys means two
        # alternatives share a text (a target that cannot name its tokens).
        expect(isinstance(top, dict) and 2 <= len(top) <= 3, f"top_logprobs entry {top!r}: not 2 or 3 distinct tokens")
        expect(all(isinstance(k, str) and k for k in top), f"top_logprobs entry {top!r} has an empty token")
        expect(token in top, f"top_logprobs entry {top!r} lacks the chosen (greedy) token {token!r}")
        _logprob_values(list(top.values()), "top_logprobs")
    _text_offsets(lp["text_offset"], out.texts.get(0, ""))
    return f"{count} tokens"


@HTTP.check("params.logprobs.chat", "params")
async def logprobs_chat(t: HttpTarget) -> str:
    """Chat logprobs with top_logprobs=2, greedy: content entries with a non-empty
    token, its bytes, a log-probability, and 2 alternatives with distinct tokens
    among them the chosen one."""
    body = t.chat_body(PROMPT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    reply = await t.post("/v1/chat/completions", body)
    if reply.status == 400:
        skip("target rejects chat logprobs with 400")
    out = from_reply(reply, "chat")
    content = _single(out, 0).get("content")
    expect(isinstance(content, list), "logprobs.content is not a list")
    expect_equal(len(content), out.completion_tokens(), "len(logprobs.content) vs completion_tokens")
    for entry in content:
        expect(isinstance(entry, dict), f"entry {entry!r}")
        _token_entry(entry, "content")
        top = entry.get("top_logprobs")
        expect(isinstance(top, list) and len(top) == 2, f"top_logprobs is {top!r}, not 2 entries")
        for alt in top:
            expect(isinstance(alt, dict), f"top_logprobs entry {alt!r}")
            _token_entry(alt, "top_logprobs")
        texts = [alt["token"] for alt in top]
        expect(len(set(texts)) == len(texts), f"top_logprobs tokens collide: {texts!r}")
        expect(entry["token"] in texts, f"top_logprobs {texts!r} lacks the chosen (greedy) token {entry['token']!r}")
    return f"{len(content)} tokens"


def _token_entry(entry: dict[str, Any], what: str) -> None:
    token = entry.get("token")
    expect(isinstance(token, str) and token, f"{what} token is {token!r}, not a non-empty string")
    _logprob_values([entry.get("logprob")], f"{what}.logprob")
    raw = entry.get("bytes")
    if raw is not None:
        ok = isinstance(raw, list) and raw and all(isinstance(b, int) and 0 <= b < 256 for b in raw)
        expect(bool(ok), f"{what} bytes of {token!r} are {raw!r}, not a non-empty list of bytes")


def _text_offsets(offsets: list[Any], text: str) -> None:
    expect(all(isinstance(o, int) and not isinstance(o, bool) for o in offsets), f"text_offset {offsets!r} is not ints")
    if not offsets:
        return
    expect(offsets[0] == 0, f"text_offset starts at {offsets[0]}, not 0")
    rising = all(a <= b for a, b in itertools.pairwise(offsets))
    expect(rising and offsets[-1] <= len(text), f"text_offset {offsets!r} does not rise within the text ({len(text)} chars)")
    if len(offsets) > 1 and len(text) > 1:
        expect(offsets[-1] > 0, f"text_offset {offsets!r} never leaves 0 in a {len(text)}-character text")


def _single(out: Completion, index: int) -> dict[str, Any]:
    entries = out.logprobs.get(index)
    expect(entries, f"choice {index} has no logprobs")
    assert entries is not None
    expect(isinstance(entries[0], dict), "logprobs is not an object")
    return dict(entries[0])


def _logprob_values(values: list[Any], what: str) -> None:
    for value in values:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value <= 1e-6
        expect(ok, f"{what} value {value!r} is not a log-probability (a float <= 0)")

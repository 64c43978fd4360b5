"""API contract: the endpoints and shapes every OpenAI client depends on."""

from __future__ import annotations

from .registry import expect, expect_equal
from .suite import HTTP, chat, complete
from .target import HttpTarget

SHORT = {"max_tokens": 8, "temperature": 0}


@HTTP.check("api.models", "api")
async def models(t: HttpTarget) -> str:
    """GET /v1/models lists the model under test."""
    reply = await t.get("/v1/models")
    expect_equal(reply.status, 200, "GET /v1/models status")
    doc = reply.json
    expect(isinstance(doc, dict) and doc.get("object") == "list", "body is not {'object': 'list', ...}")
    data = doc.get("data")
    expect(isinstance(data, list) and data, "data is not a non-empty list")
    for entry in data:
        expect(isinstance(entry, dict) and isinstance(entry.get("id"), str), f"bad model entry {entry!r}")
        expect(entry.get("object") == "model", f"model entry object is {entry.get('object')!r}")
    ids = [e["id"] for e in data]
    expect(t.model in ids, f"model {t.model!r} not listed in {ids}")
    return f"{len(ids)} model(s)"


@HTTP.check("api.completions", "api")
async def completions(t: HttpTarget) -> None:
    """A non-streaming completion has id, object, choices, finish_reason, usage."""
    out = await complete(t, **SHORT)
    expect_equal(sorted(out.texts), [0], "choice indices")


@HTTP.check("api.completions.stream", "api")
async def completions_stream(t: HttpTarget) -> str:
    """A streaming completion is well-framed SSE ending in [DONE], one id throughout."""
    out = await complete(t, stream=True, **SHORT)
    expect(out.usage is None, "usage sent in a stream without stream_options.include_usage")
    return f"{len(out.text)} chars"


@HTTP.check("api.chat", "api")
async def chat_completions(t: HttpTarget) -> None:
    """A non-streaming chat completion has an assistant message and usage."""
    out = await chat(t, **SHORT)
    expect_equal(sorted(out.texts), [0], "choice indices")


@HTTP.check("api.chat.stream", "api")
async def chat_stream(t: HttpTarget) -> None:
    """A streaming chat completion: role first, deltas, finish_reason, [DONE]."""
    await chat(t, stream=True, **SHORT)


@HTTP.check("api.stream_usage", "api")
async def stream_usage(t: HttpTarget) -> str:
    """stream_options.include_usage adds exactly one usage chunk, last, with no choices."""
    opts = {"stream_options": {"include_usage": True}}
    for kind, call in (("completion", complete), ("chat", chat)):
        body = {**SHORT, **opts}
        out = await call(t, stream=True, **body)
        expect(out.usage is not None, f"{kind}: no usage chunk with include_usage")
        assert out.usage is not None
        expect(out.usage["completion_tokens"] > 0, f"{kind}: usage.completion_tokens is 0")
    reply = await t.stream("/v1/completions", t.completion_body("Hi", **SHORT, **opts))
    last = reply.chunks[-1] if reply.chunks else {}
    expect(last.get("usage") is not None, "the usage chunk is not the last chunk before [DONE]")
    expect_equal(last.get("choices"), [], "choices of the usage chunk")
    return f"completion_tokens={out.usage['completion_tokens']}"


@HTTP.check("api.stream_matches_nonstream", "api")
async def stream_matches(t: HttpTarget) -> None:
    """At temperature 0 a stream carries the same text and usage as the plain answer."""
    plain = await complete(t, **SHORT)
    streamed = await complete(t, stream=True, stream_options={"include_usage": True}, **SHORT)
    expect_equal(streamed.text, plain.text, "streamed text vs non-streamed text")
    expect_equal(streamed.finish, plain.finish, "finish_reason")
    assert streamed.usage is not None and plain.usage is not None
    expect_equal(streamed.usage["completion_tokens"], plain.usage["completion_tokens"],
                 "usage.completion_tokens")

"""A body fuzzer over both OpenAI endpoints of the router: whatever bytes a
client sends as the body (mutated valid requests, broken JSON, invalid
UTF-8, lone surrogates, NaN literals, deep nesting, huge numbers, wrong
types, odd content types and request headers), the answer is never a 5xx,
and every error, in the status line or in-band in a stream, has exactly the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

tests/router/test_app.py fuzzes mostly valid bodies field by field; this one
works on the bytes, where a decoder's own failures (RecursionError from
nesting, UnicodeDecodeError, overflow) would surface as 500s."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.mock import MockBackend, MockConfig
from router.app import NamedBackend, Router
from router.config import decode_config

pytestmark = pytest.mark.timeout(300)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions"])


def valid(path: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "mock", "max_tokens": 3, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.sampled_from(["mock", "user", "assistant", "tool", "", "\x00", "\u202e"]),
)  # fmt: skip
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=10)


@st.composite
def mutated(draw: st.DrawFn, path: str) -> bytes:
    """A valid body's JSON text with a few bytes inserted, deleted or replaced."""
    text = bytearray(json.dumps(valid(path, draw(st.booleans()))).encode())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        how = draw(st.sampled_from(["insert", "delete", "replace"]))
        byte = draw(st.one_of(st.sampled_from(list(b'{}[]",:0-9eE.\\ntfu\x00\xff\xc3')), st.integers(0, 255)))
        if how == "insert":
            text[at:at] = bytes([byte])
        elif text and at < len(text):
            if how == "delete":
                del text[at]
            else:
                text[at] = byte
    return bytes(text)


@st.composite
def replaced(draw: st.DrawFn, path: str) -> bytes:
    """A valid body with some fields (known or not) set to arbitrary JSON."""
    body = valid(path, draw(st.booleans()))
    fields = ["model", "prompt", "messages", "max_tokens", "n", "stop", "logprobs", "top_logprobs", "temperature", "seed",
              "stream_options", "tools", "tool_choice", "response_format", "logit_bias", "user", "x-extra"]  # fmt: skip
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[field] = draw(json_values)
    return json.dumps(body).encode()


SPECIAL = [
    b"", b"null", b"[]", b"1e999999", b'"just a string"', b"{", b'{"prompt": NaN, "model": "mock"}',
    b'{"prompt": Infinity}', b"\xef\xbb\xbf{}", b'{"prompt": "\\ud800", "model": "mock"}', b'{"prompt": "\xff\xfe"}',
    b'{"model": "mock", "prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}",
    b'{"model": "mock", "model": 5, "prompt": "x"}',
    b'{"model": "mock", "prompt": ' + b"[" * 70 + b"]" * 70 + b"}",
    b'{"model": "mock", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "mock", "x": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
    b'{"model": "mock", "prompt": "x", "n": 100000}',
    b'{"model": "mock", "prompt": "x", "max_tokens": -1}',
    b'{"model": "mock", "prompt": [[1, 2], [3, -4]]}',
    b'{"model": "mock", "prompt": "' + b"x" * 200_000 + b'"}',
]
raw_bodies = st.one_of(st.binary(max_size=64), st.sampled_from(SPECIAL))
HEADERS = st.fixed_dictionaries({}, optional={
    "content-type": st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1", "", "multipart/form-data"]),
    "x-priority": st.sampled_from(["interactive", "batch", "urgent", "", "1"]),
    "x-deadline-ms": st.sampled_from(["100", "-5", "nan", "1e400", "0", "x"]),
    "x-request-id": st.sampled_from(["ok-1", "a b", "x" * 500, ""]),
})  # fmt: skip


def assert_openai_error(obj: Any) -> None:
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json")
        assert_openai_error(r.json())
    elif r.headers["content-type"].startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                assert_openai_error(json.loads(line[6:]))  # an in-band error keeps the shape too


def fuzz_router() -> Router:
    backends = [MockBackend(MockConfig(name=f"mock-{i}", models=("mock",), max_tokens=8)) for i in range(2)]
    return Router(decode_config({}), [NamedBackend(b.info().name, b) for b in backends])


async def _post(path: str, body: bytes, headers: dict[str, str]) -> None:
    router = fuzz_router()
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
            check(await client.post(path, content=body, headers=headers))
        nursery.cancel_scope.cancel()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), path=PATHS)
async def test_mutated_and_broken_bodies_never_get_a_5xx(data: st.DataObject, path: str) -> None:
    body = data.draw(st.one_of(mutated(path), replaced(path), raw_bodies))
    await _post(path, body, {"content-type": "application/json"})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), path=PATHS)
async def test_odd_headers_with_any_body_never_get_a_5xx(data: st.DataObject, path: str) -> None:
    body = data.draw(st.one_of(st.just(json.dumps(valid(path, data.draw(st.booleans()))).encode()), raw_bodies))
    await _post(path, body, data.draw(HEADERS))


@pytest.mark.parametrize("body", SPECIAL, ids=range(len(SPECIAL)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_each_special_body_gets_a_definite_answer(path: str, body: bytes) -> None:
    """The hand-picked cases, always (Hypothesis may not draw each)."""
    await _post(path, body, {"content-type": "application/json"})

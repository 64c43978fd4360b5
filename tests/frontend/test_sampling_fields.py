"""The sampling fields are declared once (backends.base.Sampling) and every
layer derives them: a client's value reaches the GenerateRequest, an HTTP
backend's upstream body, and the engine's SamplingParams, field by field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from backends.base import SAMPLING_FIELDS, GenerateRequest
from backends.engine.sequence import SamplingParams
from backends.openai_http import OpenAIHTTPBackend
from frontend.wire import decode_request, to_generate_requests

# A value other than the default for each field, as a client sends it.
CLIENT_VALUES: dict[str, Any] = {
    "max_tokens": 7,
    "min_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.3,
    "frequency_penalty": 0.4,
    "seed": 11,
    "stop": ["\n"],
    "stop_token_ids": [3],
    "ignore_eos": True,
    "logprobs": 2,
}


def test_the_table_here_covers_every_declared_field() -> None:
    assert set(CLIENT_VALUES) == {f.name for f in SAMPLING_FIELDS}


def _request() -> GenerateRequest:
    body = msgspec.json.encode({"prompt": "hi", **CLIENT_VALUES})
    wire, extra = decode_request(body, "completion")
    (request,) = to_generate_requests(wire, extra, request_id="r")
    return request


@pytest.mark.parametrize("name", sorted(CLIENT_VALUES))
def test_a_client_value_reaches_the_generate_request(name: str) -> None:
    assert getattr(_request(), name) == CLIENT_VALUES[name]


@pytest.mark.parametrize("name", sorted(CLIENT_VALUES))
def test_a_set_field_is_forwarded_upstream_and_an_unset_one_is_not(name: str) -> None:
    backend = OpenAIHTTPBackend("http://127.0.0.1:9")
    _, body = backend._payload(_request())
    assert body[name] == CLIENT_VALUES[name]
    _, bare = backend._payload(GenerateRequest(prompt="hi"))
    assert name not in bare


def test_the_engine_takes_every_field_it_implements_from_the_request() -> None:
    params = SamplingParams.from_request(_request(), default_max_tokens=16)
    implemented = set(SamplingParams.__struct_fields__) & set(CLIENT_VALUES)
    assert implemented >= {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens", "logprobs"}
    for name in implemented:
        want = CLIENT_VALUES[name]
        assert getattr(params, name) == (tuple(want) if isinstance(want, list) else want), name

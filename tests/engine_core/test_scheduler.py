"""The scheduler: continuous batching, chunked prefill, preemption, lifecycle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.block_manager import BlockManager
from backends.engine.scheduler import Scheduler, SchedulerOutput
from backends.engine.sequence import (
    TRANSITIONS,
    InvalidTransition,
    SamplingParams,
    SeqEvent,
    SeqStatus,
    Sequence,
)

from .fakes import FakeKV


def next_token(context: list[int]) -> int:
    """The fake model: a pure function of the tokens so far."""
    return (sum(context[-3:]) * 7 + len(context)) % 50


def make(num_blocks: int, bs: int, *, seqs: int = 8, budget: int = 16, caching: bool = True):
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs=seqs, max_num_batched_tokens=budget), FakeKV(num_blocks, bs)


def new(sid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0) -> Sequence:
    return Sequence(sid, prompt, SamplingParams(seed=0, max_tokens=max_tokens), priority=priority)


def run_step(sched: Scheduler, kv: FakeKV) -> SchedulerOutput:
    """One step with the fake model; finishes sequences at max_tokens."""
    out = sched.schedule()
    contexts = [(s, kv.run(s)) for s in out.scheduled]  # every scheduled token is written
    sampled = [next_token(ctx) for s, ctx in contexts if s.needs_sampling]
    sched.commit(out, sampled)
    for seq in list(sched.running):
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, SeqEvent.LENGTH)
    return out


def solo(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt) :]


def test_a_long_prompt_is_chunked_and_never_stalls_decoding() -> None:
    sched, kv = make(64, 4, budget=8)
    a = new("a", [1, 2, 3], max_tokens=30)
    sched.add(a)
    run_step(sched, kv)
    sched.add(new("b", list(range(40)), max_tokens=2))
    for _ in range(5):
        out = run_step(sched, kv)
        plan = {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}
        assert plan["a"] == 1 and plan["b"] == 7 and out.num_batched_tokens == 8
        assert out.scheduled[1].needs_sampling is False


@pytest.mark.parametrize("share", [True, False])
def test_a_request_sharing_a_running_prefill_waits_for_its_blocks_instead_of_computing_them(share: bool) -> None:
    """a and b send the same 20-token prompt (4 cacheable blocks of 4) in
    one step. With sharing, b is passed over while a prefills those blocks
    and admitted a step later with them cached: 4 prompt tokens computed
    for b instead of 20. Both answers are their solo answers either way."""
    _, kv = make(64, 4)
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=32, share_inflight_prefixes=share)
    prompt = list(range(20))
    a, b = new("a", prompt, max_tokens=3), new("b", prompt, max_tokens=3)
    sched.add(a)
    sched.add(b)
    computed = {"a": 0, "b": 0}
    while sched.has_unfinished():
        out = run_step(sched, kv)
        for s in out.scheduled:  # the prompt tokens this step computes for each
            computed[s.seq.seq_id] += max(0, min(s.end, len(prompt)) - s.start)
    assert a.output_token_ids == b.output_token_ids == solo(prompt, 3)
    assert b.num_cached_tokens == (16 if share else 0)
    assert computed == ({"a": 20, "b": 4} if share else {"a": 20, "b": 20})
    assert sched.statistics().num_prefix_waits == (1 if share else 0)


def test_a_short_overlap_with_a_running_prefill_does_not_wait() -> None:
    """Only one block in common (below the 2-block threshold): b is admitted at once."""
    sched, kv = make(64, 4, budget=64)
    sched.add(new("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1))
    sched.add(new("b", [1, 2, 3, 4, 50, 60, 70, 80, 90], max_tokens=1))
    out = run_step(sched, kv)
    assert [s.seq.seq_id for s in out.scheduled] == ["a", "b"] and sched.statistics().num_prefix_waits == 0


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    sched, kv = make(64, 4, seqs=1)
    for sid, prio in [("low", 0), ("high", 5), ("low2", 0), ("high2", 5)]:
        sched.add(new(sid, [1, 2], max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished():
        out = run_step(sched, kv)
        order += [s.seq.seq_id for s in out.scheduled]
    assert order == ["high", "high2", "low", "low2"]


def test_a_higher_priority_request_waits_one_step_of_a_lower_priority_prefill() -> None:
    """A 64-token prompt prefills 16 tokens a step; a priority-5 4-token
    request comes after its first chunk: it is admitted in the next step,
    which gives the long prompt what budget is left (12), then the long one
    goes on. Its decodes are never put off, and both answers are their solo
    answers."""
    sched, kv = make(64, 4, budget=16)
    long = new("long", list(range(64)), max_tokens=2)
    sched.add(long)
    assert {s.seq.seq_id: s.num_new_tokens for s in run_step(sched, kv).scheduled} == {"long": 16}
    urgent = new("urgent", [7, 8, 9, 10], max_tokens=3, priority=5)
    sched.add(urgent)
    plans = []
    while sched.has_unfinished():
        plans.append({s.seq.seq_id: s.num_new_tokens for s in run_step(sched, kv).scheduled})
    assert plans[:3] == [{"urgent": 4, "long": 12}, {"urgent": 1, "long": 15}, {"urgent": 1, "long": 15}]
    assert urgent.output_token_ids == solo([7, 8, 9, 10], 3) and long.output_token_ids == solo(list(range(64)), 2)


def test_a_lower_priority_decode_is_never_put_off() -> None:
    sched, kv = make(64, 4, budget=8)
    low = new("low", [1, 2, 3], max_tokens=6)
    sched.add(low)
    run_step(sched, kv)  # its prompt: decoding from now on
    sched.add(new("urgent", list(range(20)), max_tokens=1, priority=5))
    plan = [(s.seq.seq_id, s.num_new_tokens) for s in run_step(sched, kv).scheduled]
    assert plan == [("low", 1), ("urgent", 7)]


def test_preemption_takes_the_lowest_priority_most_recent_and_requeues_it_first() -> None:
    sched, kv = make(6, 2, budget=64)
    seqs = [new("p1-old", [1, 2], 8, 1), new("p0-old", [3, 4], 8, 0), new("p0-new", [5, 6], 8, 0)]
    for s in seqs:
        sched.add(s)
    run_step(sched, kv)  # 3 seqs x 2 tokens: 3 blocks, then one block each per 2 tokens
    preempted: list[str] = []
    while not preempted:
        preempted = [s.seq_id for s in run_step(sched, kv).preempted]
    assert preempted == ["p0-new"]
    victim = seqs[2]
    assert victim.status is SeqStatus.WAITING and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert sched.waiting[0] is victim
    sched.add(new("late", [7, 8], 1, 0))
    assert sched.waiting[0] is victim  # older arrival: ahead of newer requests


def test_abort_frees_blocks_at_once_from_running_and_waiting() -> None:
    sched, kv = make(16, 4, seqs=1)
    sched.add(new("r", list(range(9)), 10))
    sched.add(new("w", list(range(5)), 10))
    run_step(sched, kv)
    assert sched.block_manager.num_free_blocks == 13
    assert sched.abort("r").status is SeqStatus.FINISHED_ABORTED
    assert sched.block_manager.num_free_blocks == 16
    assert sched.abort("w").status is SeqStatus.FINISHED_ABORTED
    assert sched.abort("w") is None and not sched.has_unfinished()


def test_commit_checks_the_number_of_sampled_tokens() -> None:
    sched, _ = make(16, 4)
    sched.add(new("a", [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.commit(out, [])


def test_rollback_drops_tokens_and_the_blocks_holding_only_them() -> None:
    sched, kv = make(16, 2, caching=False)
    s = new("a", [1, 2, 3], 10)
    sched.add(s)
    for _ in range(4):
        run_step(sched, kv)
    assert len(s.token_ids) == 7 and len(s.block_table) == 3
    sched.rollback(s, 4)
    assert s.token_ids == [1, 2, 3, next_token([1, 2, 3])]
    assert s.num_computed_tokens == 4 and len(s.block_table) == 2
    assert sched.block_manager.num_free_blocks == 14
    with pytest.raises(ValueError):
        sched.rollback(s, 2)


def test_statistics_count_steps_batches_and_preemptions() -> None:
    sched, kv = make(64, 4)
    sched.add(new("a", [1, 2]))
    sched.add(new("b", [3, 4]))
    run_step(sched, kv)
    st_ = sched.statistics()
    assert (st_.num_running, st_.num_waiting, st_.num_steps) == (2, 0, 1)
    assert st_.last_batch_size == 2 and st_.last_num_batched_tokens == 4
    assert st_.kv.num_used == 2 and st_.num_preemptions == 0


# -- the lifecycle table ---------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(list(SeqEvent)), max_size=12))
def test_lifecycle_follows_the_table_and_rejects_unknown_moves(events) -> None:
    s = new("a", [1])
    for ev in events:
        before = s.status
        expected = TRANSITIONS.get((before, ev))
        if expected is None:
            with pytest.raises(InvalidTransition):
                s.transition(ev)
            assert s.status is before
        else:
            assert s.transition(ev) is expected
        if before.is_finished:
            assert s.status is before  # finished is final


# -- property test: everything admitted finishes, nothing leaks ------------------

request = st.tuples(
    st.integers(0, 6),  # arrival step
    st.lists(
        st.integers(0, 5), min_size=1, max_size=14
    ),  # prompt (small alphabet: shared prefixes)
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.integers(0, 20)),  # abort at step
)


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    bm, bs = sched.block_manager, sched.block_manager.block_size
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    refs: dict[int, int] = {}
    for s in sched.running:
        assert s.status is SeqStatus.RUNNING
        assert len(s.block_table) == -(-s.num_computed_tokens // bs)
        assert s.num_computed_tokens < len(s.token_ids)  # always something to compute next
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
        for i in range(s.num_computed_tokens // bs):
            toks = bm.cached_tokens(s.block_table[i])
            assert toks is None or list(toks) == s.token_ids[i * bs : (i + 1) * bs]
    for s in sched.waiting:
        assert s.status is SeqStatus.WAITING and s.block_table == [] and s.num_computed_tokens == 0
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == refs.get(b, 0)
    assert bm.num_free_blocks == bm.num_blocks - len(refs)


@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(request, min_size=1, max_size=8),
    bs=st.integers(1, 4),
    spare_blocks=st.integers(0, 6),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 5),
    caching=st.booleans(),
)
def test_every_admitted_request_finishes_with_its_solo_tokens(
    requests, bs, spare_blocks, budget, max_seqs, caching
) -> None:
    longest = max(len(p) + m for _, p, m, _, _ in requests)
    num_blocks = -(-longest // bs) + spare_blocks  # the biggest request just fits
    sched, kv = make(num_blocks, bs, seqs=max_seqs, budget=budget, caching=caching)
    seqs = {}
    for step in range(3000):
        for i, (at, prompt, max_tokens, prio, abort_at) in enumerate(requests):
            if at == step:
                seqs[i] = new(str(i), prompt, max_tokens, prio)
                sched.add(seqs[i])
            if abort_at == step and i in seqs and not seqs[i].is_finished:
                sched.abort(str(i))
        out = run_step(sched, kv)
        check_invariants(sched, out)
        if step > 6 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "a request never finished"
    assert sched.block_manager.num_free_blocks == num_blocks
    for i, s in seqs.items():
        _, prompt, max_tokens, _, _ = requests[i]
        if s.status is SeqStatus.FINISHED_LENGTH:
            assert s.output_token_ids == solo(prompt, max_tokens)
        else:
            assert s.status is SeqStatus.FINISHED_ABORTED
            assert s.output_token_ids == solo(prompt, max_tokens)[: s.num_output_tokens]

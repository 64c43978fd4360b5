"""The sharding plan covers every query head, intermediate feature and vocab row exactly
once, keeps each query head with its KV head, and the transform keeps exactly its shard."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.tp import ShardPlan, apply_tp, even_ranges, local_args, plan_tp
from backends.engine.tp_comm import Comm, TensorParallelError
from tests.engine_tp.models import RandomModel, tiny_args


def _flatten(ranges: list[range]) -> list[int]:
    return [i for r in ranges for i in r]


def _check_plan(plan: ShardPlan) -> None:
    group = plan.n_heads // plan.n_kv_heads
    shards = plan.shards
    assert [s.rank for s in shards] == list(range(plan.world_size))
    assert _flatten([s.q_heads for s in shards]) == list(range(plan.n_heads))
    assert _flatten([s.hidden for s in shards]) == list(range(plan.hidden_dim))
    assert _flatten([s.vocab for s in shards]) == list(range(plan.vocab_size))
    for sizes in ([len(s.hidden) for s in shards], [len(s.vocab) for s in shards]):
        assert max(sizes) - min(sizes) <= 1
    for s in shards:
        lq, lkv = len(s.q_heads), len(s.kv_heads)
        assert lq > 0 and lkv > 0 and lq % lkv == 0
        # The model maps local q head j to local KV head j // (lq // lkv): that must be
        # the global KV head of global q head s.q_heads[j].
        for j, head in enumerate(s.q_heads):
            assert s.kv_heads[j // (lq // lkv)] == head // group
    held = [sum(h in s.kv_heads for s in shards) for h in range(plan.n_kv_heads)]
    if plan.world_size <= plan.n_kv_heads:
        assert held == [1] * plan.n_kv_heads  # no replication: each KV head exactly once
        groups = [len(s.kv_heads) for s in shards]
        assert max(groups) - min(groups) <= 1
    else:
        assert all(len(s.kv_heads) == 1 for s in shards)
        assert min(held) >= 1 and max(held) - min(held) <= 1
    assert plan.kv_replicas == max(held)


@settings(max_examples=200, deadline=None)
@given(
    n_kv=st.integers(1, 8),
    group=st.integers(1, 6),
    hidden=st.integers(1, 300),
    vocab=st.integers(1, 500),
    data=st.data(),
)
def test_plan_covers_everything_exactly_once(
    n_kv: int, group: int, hidden: int, vocab: int, data: st.DataObject
) -> None:
    n_heads = n_kv * group
    world = data.draw(st.integers(1, min(n_heads, hidden, vocab)))
    _check_plan(plan_tp(n_heads, n_kv, hidden, vocab, world))


def test_every_world_size_up_to_the_head_count_is_planned() -> None:
    for n_heads, n_kv in [(9, 3), (6, 3), (8, 2), (12, 4), (7, 7), (5, 1), (32, 8)]:
        for world in range(1, n_heads + 1):
            _check_plan(plan_tp(n_heads, n_kv, 2 * n_heads + 1, 1000, world))


def test_smollm2_splits_unevenly_by_kv_group_at_two_ranks() -> None:
    plan = plan_tp(9, 3, 1536, 49152, 2)
    r0, r1 = plan.shards
    assert (r0.q_heads, r0.kv_heads) == (range(6), range(2))
    assert (r1.q_heads, r1.kv_heads) == (range(6, 9), range(2, 3))
    assert (len(r0.hidden), len(r1.hidden), len(r0.vocab)) == (768, 768, 24576)
    three = plan_tp(9, 3, 1536, 49152, 3)
    assert [(len(s.q_heads), len(s.kv_heads), len(s.hidden)) for s in three.shards] == [
        (3, 1, 512)
    ] * 3


def test_more_ranks_than_kv_heads_replicates_kv_heads() -> None:
    plan = plan_tp(9, 3, 1536, 49152, 4)
    assert [s.kv_heads for s in plan.shards] == [range(1), range(1), range(1, 2), range(2, 3)]
    assert [s.q_heads for s in plan.shards] == [range(2), range(2, 3), range(3, 6), range(6, 9)]
    assert plan.kv_replicas == 2


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "hidden", "vocab", "world", "match"),
    [
        (9, 3, 100, 100, 10, "query heads"),
        (4, 2, 3, 100, 4, "intermediate size"),
        (4, 2, 100, 100, 0, ">= 1"),
        (9, 2, 100, 100, 2, "groups"),
    ],
)
def test_impossible_plans_are_refused_clearly(
    n_heads: int, n_kv: int, hidden: int, vocab: int, world: int, match: str
) -> None:
    with pytest.raises(TensorParallelError, match=match):
        plan_tp(n_heads, n_kv, hidden, vocab, world)


def test_even_ranges() -> None:
    assert even_ranges(7, 3) == [range(3), range(3, 5), range(5, 7)]
    assert even_ranges(2, 2) == [range(1), range(1, 2)]


def test_apply_tp_is_a_no_op_at_one_rank() -> None:
    model = RandomModel(tiny_args())()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_tp(model, plan_tp(6, 3, 77, 101, 1), 0, None) is model
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("world", "tie", "bias"), [(2, True, False), (3, False, True), (4, True, True)]
)
def test_each_rank_keeps_exactly_its_slices(world: int, tie: bool, bias: bool) -> None:
    """Concatenating the ranks' shards gives back the full weights."""
    build = RandomModel(tiny_args(tie=tie, bias=bias))
    full = build()
    plan = plan_tp(6, 3, 77, 101, world)
    ranks = [apply_tp(build(), plan, r, Comm(r, world, 1.0)) for r in range(world)]
    for r, (model, shard) in enumerate(zip(ranks, plan.shards, strict=True)):
        assert model.args == local_args(full.args, shard)
        attn = model.layers[0].attention
        assert (attn.n_heads, attn.n_kv_heads) == (len(shard.q_heads), len(shard.kv_heads))
        assert attn.wk.weight.shape == (len(shard.kv_heads) * 8, 48), r
        assert (model.output.weight is model.tok_embeddings.weight) == tie
    for i, layer in enumerate(full.layers):
        attn = [m.layers[i].attention for m in ranks]
        ffn = [m.layers[i].feed_forward for m in ranks]
        assert torch.equal(torch.cat([a.wq.weight for a in attn]), layer.attention.wq.weight)
        assert torch.equal(torch.cat([a.wo.weight for a in attn], 1), layer.attention.wo.weight)
        assert torch.equal(torch.cat([f.w1.weight for f in ffn]), layer.feed_forward.w1.weight)
        assert torch.equal(torch.cat([f.w2.weight for f in ffn], 1), layer.feed_forward.w2.weight)
        if bias:
            assert torch.equal(torch.cat([a.wq.bias for a in attn]), layer.attention.wq.bias)
        if world <= 3:  # KV heads held once each: the shards tile wk exactly
            assert torch.equal(torch.cat([a.wk.weight for a in attn]), layer.attention.wk.weight)
    assert torch.equal(
        torch.cat([m.tok_embeddings.weight for m in ranks]), full.tok_embeddings.weight
    )
    assert torch.equal(torch.cat([m.output.weight for m in ranks]), full.output.weight)
